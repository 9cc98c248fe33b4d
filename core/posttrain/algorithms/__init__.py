"""RL algorithms: advantage estimators and the policy loss (torch imported inside functions)."""
