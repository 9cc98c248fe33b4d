"""Fixes for megatron-core releases run without TransformerEngine (CPU and GPU alike).

megatron-core 0.16.1's MoE router reads a module global ``te_general_gemm`` that is only defined
when TransformerEngine imports; without TE the router raises ``NameError``. Defining it as None
selects the router's own torch path, which is what the code intends without TE.
"""

from __future__ import annotations


def apply() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
