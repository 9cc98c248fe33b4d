"""3. Rollout: a step's prompts sampled on the rollout role, as single turns or as multi-turn
episodes in an environment (``rollout.environments``), produced when the step asks or ahead of it
(asynchronous rollout), with dynamic sampling's groups."""
