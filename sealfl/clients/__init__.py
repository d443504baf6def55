"""Partner side: Flower ClientApp, local training tasks, data loading, HE (CKKS or BFV) encryption
of updates. A partner never sees another partner's update."""
