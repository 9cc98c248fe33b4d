"""The ``hf_infer`` engine: generation, log-probs and reward scores with plain transformers,
and its fixed-shape decoders and kernels. A backend like the plugins' (registered through
``plugin.py``), above the plumbing in ``backends/`` and the shared log-prob head in
``scoring/``."""
