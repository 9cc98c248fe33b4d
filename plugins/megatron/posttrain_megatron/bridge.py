"""HF <-> Megatron through mbridge, for the layer specs this plugin builds.

mbridge maps HF tensors onto megatron-core's TransformerEngine module names (norms fused into
``linear_qkv`` / ``linear_fc1``, experts as ``linear_fc1.weight<i>`` of a grouped MLP). Without
TransformerEngine the model is built from the local / SDPA spec instead, where norms are their
own modules (``input_layernorm``, ``pre_mlp_layernorm``) and experts are a ``SequentialMLP``
(``local_experts.<i>.linear_fc1.weight``). :func:`make_bridge` subclasses the model's registered
bridge so that names are translated at the one place mbridge resolves them
(``_weight_name_mapping_mcore_local_to_global``) and models are built from
:func:`posttrain_megatron.layer_spec.decoder_block_spec`; everything else (TP/PP/EP gathers and
splits, q/k/v and gate/up packing) is mbridge's own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mbridge.core.bridge import Bridge
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from transformers import PretrainedConfig
else:
    # make_bridge puts the mixin before the model's registered mbridge class; to mypy it is a
    # subclass of mbridge's Bridge (untyped: Any), whose methods and attributes it uses.
    Bridge = object

_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def _hf_config_for_mbridge(hf_config: PretrainedConfig) -> PretrainedConfig:
    """transformers 5 moved ``rope_theta`` under ``rope_parameters``; mbridge reads the former."""
    if getattr(hf_config, "rope_theta", None) is None:
        params = getattr(hf_config, "rope_parameters", None) or {}
        hf_config.rope_theta = params.get("rope_theta", 10000.0)
    return hf_config


class _PosttrainNames(Bridge):
    """Mixed into a registered mbridge class (see :func:`make_bridge`)."""

    attention_backend = "sdpa"

    def _get_transformer_layer_spec(
        self, vp_stage: int | None = None
    ) -> TransformerBlockSubmodules:
        from posttrain_megatron.layer_spec import decoder_block_spec

        self.has_vp_stage = True
        return decoder_block_spec(self.config, self.attention_backend, vp_stage=vp_stage)

    def export_weights(self, models: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
        """mbridge's walk, without its per-tensor object collectives when there is one pipeline
        stage and no expert parallelism: mbridge broadcasts every tensor's name and spec across
        the pipeline group (four object collectives per tensor, each a host round trip), which
        made an in-process sync of a 1.5B model take 0.3 s instead of a few milliseconds of
        copies. The TP gather and the HF conversion are mbridge's own."""
        if self.mpu.pp_size > 1 or self.mpu.ep_size > 1:
            yield from super().export_weights(models)
            return
        from mbridge.core.util import unwrap_model

        for model in (unwrap_model(m) for m in models):
            to_global = self._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
            named = dict(model.named_parameters())
            # As mbridge: a router's expert_bias is in the state dict only.
            named.update(
                (key, value)
                for key, value in model.state_dict().items()
                if "expert_bias" in key and "_extra_state" not in key and key not in named
            )
            for local_name, param in named.items():
                name = to_global[local_name]
                if getattr(param, "tensor_model_parallel", False):
                    shards = [param]
                    if self.mpu.tp_size > 1:
                        shards = [torch.empty_like(param) for _ in range(self.mpu.tp_size)]
                        torch.distributed.all_gather(shards, param, group=self.mpu.tp_group)
                    merged = self._weight_merge_across_tp(name, shards, param)
                else:
                    merged = param
                yield from zip(*self._weight_to_hf_format(name, merged))

    def _weight_name_mapping_mcore_local_to_global(
        self, model: torch.nn.Module, consider_ep: bool = True
    ) -> dict[str, str]:
        mapping = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
        dense_norm_fused = "pre_mlp_layernorm" not in self._MLP_MAPPING
        per_rank = (self.config.num_moe_experts or 0) // max(1, self.mpu.ep_size)
        offset = per_rank * self.mpu.ep_rank if consider_ep else 0
        out = {}
        for local, name in mapping.items():
            if name.endswith(".input_layernorm.weight"):
                name = name.replace(
                    ".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"
                )
            elif name.endswith(".pre_mlp_layernorm.weight") and dense_norm_fused:
                name = name.replace(
                    ".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"
                )
            else:
                match = _LOCAL_EXPERT.search(name)
                if match:
                    expert = int(match.group(1)) + offset
                    name = name[: match.start()] + f".mlp.experts.{match.group(2)}.weight{expert}"
            out[local] = name
        return out


def make_bridge(
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    attention_backend: str,
    overrides: dict[str, Any],
    mixins: tuple[type, ...] = (),
) -> Any:
    """An mbridge bridge for ``hf_config`` whose TransformerConfig carries ``overrides``;
    ``mixins`` go first in its bases (the critic's head names:
    :class:`posttrain_megatron.value_head.ValueHeadNames`)."""
    from mbridge.core.bridge import _MODEL_REGISTRY

    hf_config = _hf_config_for_mbridge(hf_config)
    base = _MODEL_REGISTRY.get(hf_config.model_type)
    if base is None:
        raise ValueError(
            f"mbridge has no bridge for model_type {hf_config.model_type!r}; "
            f"supported: {', '.join(sorted(_MODEL_REGISTRY))}"
        )
    bases = (*mixins, _PosttrainNames, base)
    cls = type(f"Posttrain{base.__name__}", bases, {"attention_backend": attention_backend})
    bridge = cls(hf_config, dtype=dtype)
    if overrides:
        bridge.set_extra_args(**overrides)
    return bridge
