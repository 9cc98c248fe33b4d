"""The CLI's commands beside ``cli.py``: ``run`` (a workflow's life cycle), ``eval`` (a
checkpoint scored on held-out data) and ``export-hf``; ``config_keys`` describes a config class's
keys for ``posttrain plugins --config`` and the generated config reference. The top floor: they
compose every phase and nothing imports them but the CLI and the config reference."""
