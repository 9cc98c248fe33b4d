"""The CLI's commands beside ``cli.py``: ``run`` (a workflow's life cycle), ``eval`` (a
checkpoint scored on held-out data) and ``export-hf``. The top floor: they compose every
phase and nothing imports them but the CLI."""
