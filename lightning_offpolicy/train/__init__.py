"""The training side, free of Lightning: the policy and its reference (:mod:`.policy`), the PPO
update of one rollout batch (:mod:`.update`), its per-micro-batch correction and loss
(:mod:`.micro_step`) and their eager pieces (:mod:`.step`)."""
