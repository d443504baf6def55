"""Partner side: Flower ClientApp, local training tasks, data loading, BFV encryption
of updates. A partner never sees another partner's update."""
