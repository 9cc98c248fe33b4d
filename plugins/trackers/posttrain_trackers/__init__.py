"""Experiment trackers for posttrain: the ``wandb`` and ``mlflow`` loggers (``trainer.logger``).

The entry point (:mod:`posttrain_trackers.plugin`) only declares them; a tracker's library is
imported when a run that names it starts.
"""
