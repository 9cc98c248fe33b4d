"""The GPT layer spec ``megatron_train`` builds models with.

With TransformerEngine installed, megatron-core's TE spec is used as is. Without it, megatron-core's
local spec runs unfused attention (a [b, heads, s, s] score matrix and softmax in eager PyTorch),
which makes it several times slower than torch's fused kernels on GPUs. ``attention_backend:
sdpa`` (the default without TE) swaps in:

* :class:`SDPACoreAttention`: core attention through ``torch.nn.functional.
  scaled_dot_product_attention`` (flash / cuDNN / memory-efficient kernels), GQA without copying
  keys and values, causal masking by the kernel. Sequences are right-padded, so causal attention
  alone is exact for every real token (padding comes after them and is never attended to).
  Under context parallelism it gathers keys and values over the CP ranks
  (:mod:`posttrain_megatron.context_parallel`); packed sequences (THD) are attended one by one
  (:mod:`posttrain_megatron.packing`);
* :class:`TorchNorm`: torch's fused ``RMSNorm`` / ``LayerNorm``, whose weights are tagged
  ``sequence_parallel`` so megatron all-reduces their gradients across TP ranks (the local spec's
  norm refuses sequence parallelism).

Every Megatron parallelism (TP, PP, VPP, EP, SP, CP, DP) is kept: only the two leaf modules differ.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import TYPE_CHECKING

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


class TorchNorm:
    """torch's fused RMSNorm / LayerNorm, built from megatron's norm arguments.

    A factory (``__new__`` returns the torch module) so parameter names stay ``<norm>.weight``,
    the names megatron's checkpoints and mbridge's HF mapping expect.
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str | None = None,
    ) -> torch.nn.Module:
        kind = normalization or config.normalization
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        kwargs = {"eps": eps, "device": device, "dtype": config.params_dtype}
        if kind == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, **kwargs)
        elif kind == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, **kwargs)
        else:
            raise ValueError(f"megatron: normalization {kind!r} is not supported by TorchNorm")
        for param in norm.parameters():
            # Read by megatron's finalize_model_grads: all-reduce these grads over TP under SP.
            param.sequence_parallel = config.sequence_parallel
        return norm


class SDPACoreAttention(MegatronModule):
    """megatron-core core attention on ``torch.nn.functional.scaled_dot_product_attention``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        from megatron.core import parallel_state

        self.cp_size = config.context_parallel_size
        if self.cp_size > 1:
            self.cp_group = (
                pg_collection.cp
                if pg_collection is not None
                else parallel_state.get_context_parallel_group()
            )
        tp = (
            pg_collection.tp.size()
            if pg_collection is not None
            else parallel_state.get_tensor_model_parallel_world_size()
        )
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= max(1, layer_number)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPA core attention takes no attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.cp_size > 1:
            out = self._context_parallel(q, k, v)
        else:
            out = self._attend(q, k, v, is_causal=True)
        # [b, n, s, d] -> [s, b, n * d]
        b, n, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, n * d)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **mask: bool | torch.Tensor
    ) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=self.heads != self.groups,
            **mask,
        )

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSeqParams
    ) -> torch.Tensor:
        """Packed sequences (THD: [t, n, d], boundaries on the host, see
        :mod:`posttrain_megatron.packing`): causal attention within each sequence, [t, n * d]."""
        if params.qkv_format != "thd" or self.cp_size > 1:
            raise ValueError("SDPA core attention packs THD sequences without context parallelism")
        cu = params.cu_seqlens_q_padded
        bounds = (cu if cu is not None else params.cu_seqlens_q).tolist()
        outs = []
        for start, end in itertools.pairwise(bounds):
            if end > start:
                # [len, n, d] -> [1, n, len, d]
                q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                outs.append(self._attend(q, k, v, is_causal=True)[0].transpose(0, 1))
        out = torch.cat(outs, dim=0)
        return out.reshape(out.shape[0], -1)

    def _context_parallel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's two query chunks against the whole sequence's keys up to each chunk's end
        (the causal mask aligned to the bottom right: query i of chunk c is position c * L + i)."""
        from torch.nn.attention.bias import causal_lower_right

        from posttrain_megatron import context_parallel

        keys = context_parallel.gather_sequence(k, 2, self.cp_group)
        values = context_parallel.gather_sequence(v, 2, self.cp_group)
        length = q.shape[2] // 2
        rank = torch.distributed.get_rank(self.cp_group)
        outs = []
        for half, chunk in enumerate(context_parallel.chunk_ids(self.cp_size, rank)):
            end = (chunk + 1) * length
            outs.append(
                self._attend(
                    q[:, :, half * length : (half + 1) * length],
                    keys[:, :, :end],
                    values[:, :, :end],
                    attn_mask=causal_lower_right(length, end),
                )
            )
        return torch.cat(outs, dim=2)


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def decoder_block_spec(
    config: TransformerConfig, attention_backend: str, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """The decoder block spec for this rank's layers (``vp_stage`` for interleaved PP)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = attention_backend == "transformer_engine"
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=config.normalization, vp_stage=vp_stage
    )
    if use_te or attention_backend == "local":
        return spec
    spec = copy.deepcopy(spec)
    spec.layer_norm = TorchNorm
    for layer in spec.layer_specs:
        sub = layer.submodules
        sub.input_layernorm = TorchNorm
        sub.pre_mlp_layernorm = TorchNorm
        sub.self_attention.submodules.core_attention = SDPACoreAttention
    return spec
