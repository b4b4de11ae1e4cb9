"""The training side, free of Lightning: the policy and its reference (:mod:`.policy`) and the
per-batch PPO step on plain tensors (:mod:`.step`)."""
