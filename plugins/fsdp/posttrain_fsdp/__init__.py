"""posttrain-fsdp: PyTorch FSDP2 strategies for posttrain (``fsdp2_train``, ``fsdp2_infer``).

Cheap to import; the engine (:mod:`posttrain_fsdp.engine`) is imported by the hooks on first use.
"""

__version__ = "0.1.0"
