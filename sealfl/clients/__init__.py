"""Partner side: the Flower ClientApp, the task plug-ins (:mod:`.plugins`: ``heart``,
``causal-lm``), data loading and the partner's kit. A partner never sees another partner's
update; its own leaves only as HE ciphertext."""
