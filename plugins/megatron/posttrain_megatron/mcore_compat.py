"""Fixes for the megatron-core / mbridge releases this plugin supports (CPU and GPU alike).

* megatron-core 0.16.1's MoE router reads a module global ``te_general_gemm`` that is only
  defined when TransformerEngine imports; without TE the router raises ``NameError``. Defining
  it as None selects the router's own torch path, which is what the code intends without TE.
* megatron-core 0.19 dropped ``ModelType.encoder_and_decoder``; mbridge 0.15.1's ``get_model``
  still compares with it (``AttributeError`` on every model build). mbridge's module gets a
  ``ModelType`` whose ``encoder_and_decoder`` matches nothing (decoder-only models, as intended).
"""

from __future__ import annotations

import types


def apply() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _mbridge_model_type()


def _mbridge_model_type() -> None:
    from megatron.core.transformer.enums import ModelType

    if "encoder_and_decoder" in vars(ModelType):  # megatron-core < 0.19
        return
    from mbridge.core import util as mbridge_util

    mbridge_util.ModelType = types.SimpleNamespace(
        encoder_or_decoder=ModelType.encoder_or_decoder, encoder_and_decoder=object()
    )
