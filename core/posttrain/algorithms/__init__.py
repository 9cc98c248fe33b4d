"""6. Algorithms: advantage estimators, policy and value losses, KL and rollout corrections, the
presets that combine them, and their registries (filled by hooks; the core's pieces in
``algorithms.builtin``)."""
