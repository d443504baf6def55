"""Partner side: Flower ClientApp, local training tasks, data loading, CKKS encryption
of updates. A partner never sees another partner's update."""
