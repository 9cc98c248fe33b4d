"""The loop: the run's life cycle and its step (``trainer.run``), the phase timer, the history
and the loggers, the curves plotted at the end."""
