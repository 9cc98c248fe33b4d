"""The plugin's own HF <-> megatron-core converter for dense models (``use_mbridge: false``).

It has the face of the mbridge bridge :mod:`posttrain_megatron.model_builder` and
:mod:`posttrain_megatron.weights` use (``get_model``, ``load_weights``, ``export_weights``,
``hf_config``, ``vocab_size``), so the rest of the plugin does not know which one it holds.

* **build**: a GPTModel per virtual pipeline stage from the plugin's layer spec
  (:func:`posttrain_megatron.layer_spec.decoder_block_spec`), with the shape
  :mod:`posttrain_megatron.dense_models` reads from the HF config; Float16Module and DDP wrappers
  as Megatron-LM adds them.
* **load**: every rank reads the HF tensors its own parameters need from the safetensors files
  and cuts its tensor-parallel shard (:mod:`posttrain_megatron.dense_mapping`); pipeline stages
  own their layers (each layer's ``layer_number`` is its global index). No collective runs.
* **export**: yields ``(hf_name, full tensor)`` on every rank, one parameter at a time, as
  mbridge's walk does: the owning stage gathers the TP shards, then broadcasts the HF tensors over
  the pipeline group. The stages first exchange what they hold (names, shapes, dtypes), so every
  rank runs the same collectives in the same order.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from posttrain.backend import HEAD_WEIGHT
from posttrain_megatron import dense_mapping
from posttrain_megatron.dense_models import (
    gpt_model_kwargs,
    transformer_config_kwargs,
    unsupported_reason,
)

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from transformers import PretrainedConfig

# A critic's value head, in place of the vocabulary output layer (posttrain_megatron.value_head).
VALUE_HEAD = "output_layer.weight"


class DenseBridge:
    def __init__(
        self,
        hf_config: PretrainedConfig,
        dtype: torch.dtype,
        attention_backend: str,
        overrides: dict[str, Any],
        value_head: bool = False,
    ) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer import TransformerConfig

        reason = unsupported_reason(hf_config)
        if reason is not None:
            raise ValueError(
                f"megatron: use_mbridge is false and {reason}; set use_mbridge: true, or "
                "use_dist_checkpointing: true with a checkpoint from `posttrain convert`"
            )
        self.hf_config = hf_config
        # A critic: output_layer is the value head, HF's score.weight (posttrain_megatron.
        # value_head puts it there through the model-creation callbacks).
        self.value_head = value_head
        self.dtype = dtype
        self.attention_backend = attention_backend
        self.make_vocab_size_divisible_by: int | None = None
        self.vocab_size = hf_config.vocab_size
        self.padded_vocab_size = hf_config.vocab_size
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        pp = ps.get_pipeline_model_parallel_world_size()
        kwargs: dict[str, Any] = {
            **transformer_config_kwargs(hf_config),
            "params_dtype": dtype,
            "pipeline_dtype": dtype,
            "bf16": dtype == torch.bfloat16,
            "fp16": dtype == torch.float16,
            "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": vpp,
            "context_parallel_size": ps.get_context_parallel_world_size(),
            # As mbridge sets them, so both loaders run the same schedule.
            "overlap_p2p_comm": vpp is not None and pp > 1,
            "batch_p2p_comm": False,
            # No experts here, but TransformerConfig refuses its default (allgather) together
            # with variable_seq_lengths, which pipeline parallelism sets.
            "moe_token_dispatcher_type": "alltoall",
            **overrides,
        }
        self.config = TransformerConfig(**kwargs)

    # -- build -------------------------------------------------------------------------------

    def get_model(
        self,
        wrap_with_ddp: bool,
        fp16: bool,
        bf16: bool,
        use_cpu_initialization: bool,
        data_parallel_random_init: bool,
        ddp_config: dict[str, Any] | None,
        post_model_creation_callbacks: list[Callable[..., None]]
        | tuple[Callable[..., None], ...] = (),
    ) -> list[torch.nn.Module]:
        """As mbridge's ``get_model``: ``post_model_creation_callbacks(model, pre_process=...,
        post_process=..., config=..., hf_config=...)`` run on each chunk after it is built."""
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.enums import ModelType
        from megatron.core.transformer.module import Float16Module

        divisor = self.make_vocab_size_divisible_by or 1
        self.padded_vocab_size = math.ceil(self.vocab_size / divisor) * divisor
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        if ps.get_pipeline_model_parallel_world_size() > 1 and vpp is not None:
            chunks = [
                self._gpt_model(
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
                    vp_stage=i,
                )
                for i in range(vpp)
            ]
        else:
            chunks = [
                self._gpt_model(
                    pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(),
                    vp_stage=None,
                )
            ]
        for chunk in chunks:
            for callback in post_model_creation_callbacks:
                callback(
                    chunk,
                    pre_process=chunk.pre_process,
                    post_process=chunk.post_process,
                    config=self.config,
                    hf_config=self.hf_config,
                )
            chunk.model_type = ModelType.encoder_or_decoder  # read by megatron's schedules
            for param in chunk.parameters():
                # The optimizer reads these on every parameter, not only the TP-split ones.
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
            if not use_cpu_initialization:
                chunk.cuda(torch.cuda.current_device())
        if fp16 or bf16:
            chunks = [Float16Module(self.config, chunk) for chunk in chunks]
        if wrap_with_ddp:
            chunks = self._wrap_ddp(chunks, ddp_config or {}, data_parallel_random_init)
        return chunks

    def _gpt_model(self, pre_process: bool, post_process: bool, vp_stage: int | None) -> GPTModel:
        from megatron.core.models.gpt.gpt_model import GPTModel

        from posttrain_megatron.layer_spec import decoder_block_spec

        return GPTModel(
            config=self.config,
            transformer_layer_spec=decoder_block_spec(
                self.config, self.attention_backend, vp_stage=vp_stage
            ),
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            **gpt_model_kwargs(self.hf_config, self.padded_vocab_size),
        )

    def _wrap_ddp(
        self, chunks: list[torch.nn.Module], ddp_config: dict[str, Any], random_init: bool
    ) -> list[DistributedDataParallel]:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        config = DistributedDataParallelConfig(**ddp_config)
        if config.overlap_grad_reduce:
            # Megatron-LM's default: buckets large enough to stay bandwidth-bound at any DP size.
            dp = ps.get_data_parallel_world_size(with_context_parallel=True)
            config.bucket_size = max(40_000_000, 1_000_000 * dp)
        else:
            config.bucket_size = None  # one bucket: nothing to overlap with
        wrapped = [
            DistributedDataParallel(
                config=self.config,
                ddp_config=config,
                module=chunk,
                # Later chunks' communication overlaps with compute anyway (Megatron-LM).
                disable_bucketing=index > 0,
            )
            for index, chunk in enumerate(chunks)
        ]
        if random_init:
            for model in wrapped:
                model.broadcast_params()
        return wrapped

    # -- HF <-> megatron -----------------------------------------------------------------------

    def _dims(self) -> dense_mapping.Dims:
        from megatron.core import parallel_state as ps

        return dense_mapping.Dims(
            heads=self.config.num_attention_heads,
            groups=self.config.num_query_groups,
            head_dim=self.config.kv_channels,
            vocab_size=self.vocab_size,
            padded_vocab_size=self.padded_vocab_size,
            tied=bool(getattr(self.hf_config, "tie_word_embeddings", False)),
            tp=ps.get_tensor_model_parallel_world_size(),
        )

    def _params(self, models: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(global megatron name, parameter)`` of this rank's chunks."""
        for model in models:
            chunk = _unwrap(model)
            numbers = {i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}
            for name, param in chunk.named_parameters():
                yield dense_mapping.global_name(name, numbers), param

    def _hf_names(self, name: str, tied: bool) -> tuple[tuple[str, ...], str]:
        if self.value_head and name == VALUE_HEAD:
            return (HEAD_WEIGHT,), dense_mapping.REPLICATED  # [1, hidden] on every TP rank
        return dense_mapping.hf_names(name, tied)

    def load_weights(self, models: list[torch.nn.Module], weights_path: str) -> None:
        from megatron.core import parallel_state as ps

        dims = self._dims()
        rank = ps.get_tensor_model_parallel_rank()
        with _SafetensorsDir(weights_path) as files, torch.no_grad():
            for name, param in self._params(models):
                names, kind = self._hf_names(name, dims.tied)
                if names == (HEAD_WEIGHT,) and not files.has(HEAD_WEIGHT):
                    # A policy's checkpoint: the critic's head starts at zero, as HF's does.
                    param.zero_()
                    continue
                shard = dense_mapping.to_shard(kind, [files.get(n) for n in names], dims, rank)
                if shard.shape != param.shape:
                    raise ValueError(
                        f"megatron: {'+'.join(names)} gives {name} the shape "
                        f"{tuple(shard.shape)}, the model has {tuple(param.shape)}"
                    )
                param.copy_(shard)

    def export_weights(self, models: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
        from megatron.core import parallel_state as ps

        dims = self._dims()
        tp_group = ps.get_tensor_model_parallel_group()
        pp_group = ps.get_pipeline_model_parallel_group()
        pp_rank = ps.get_pipeline_model_parallel_rank()
        pp_size = ps.get_pipeline_model_parallel_world_size()
        mine, plan = [], []
        for name, param in self._params(models):
            if name == "output_layer.weight" and dims.tied:
                continue  # the embedding, exported by the first stage
            names, kind = self._hf_names(name, dims.tied)
            mine.append((param, kind))
            shapes = dense_mapping.hf_shapes(kind, tuple(param.shape), dims)
            plan.append((names, shapes, param.dtype))
        device = mine[0][0].device if mine else torch.device("cpu")
        plans: list[Any] = [plan]
        if pp_size > 1:
            plans = [None] * pp_size
            dist.all_gather_object(plans, plan, group=pp_group)
        for stage, stage_plan in enumerate(plans):
            for index, (names, shapes, dtype) in enumerate(stage_plan):
                if stage == pp_rank:
                    param, kind = mine[index]
                    tensors = dense_mapping.from_shards(
                        kind, _tp_shards(param, kind, tp_group), dims
                    )
                else:
                    tensors = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
                if pp_size > 1:
                    src = dist.get_process_group_ranks(pp_group)[stage]
                    for tensor in tensors:
                        dist.broadcast(tensor, src=src, group=pp_group)
                yield from zip(names, tensors)


def _tp_shards(
    param: torch.Tensor, kind: str, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    local = param.detach()
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if kind == dense_mapping.REPLICATED or size == 1:
        return [local]
    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local, group=group)
    return shards


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


class _SafetensorsDir:
    """The tensors of an HF directory (``model.safetensors`` or an indexed set of shards), each
    read from disk on request."""

    def __init__(self, path: str) -> None:
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            self._where: dict[str, str] | None = {
                name: os.path.join(path, file) for name, file in weight_map.items()
            }
        elif os.path.exists(single):
            self._where = None
            self._single = single
        else:
            raise ValueError(
                f"megatron: {path} has no model.safetensors (or its index); the dense converter "
                "reads safetensors weights"
            )
        self._open: dict[str, Any] = {}

    def __enter__(self) -> _SafetensorsDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self._open.clear()

    def has(self, name: str) -> bool:
        if self._where is not None:
            return name in self._where
        from safetensors import safe_open

        with safe_open(self._single, framework="pt") as handle:
            return name in set(handle.keys())

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self._single if self._where is None else self._where.get(name)
        if file is None:
            raise ValueError(f"megatron: the HF checkpoint has no tensor {name!r}")
        if file not in self._open:
            handle = safe_open(file, framework="pt")
            self._open[file] = (handle, set(handle.keys()))
        handle, names = self._open[file]
        if name not in names:
            raise ValueError(f"megatron: the HF checkpoint has no tensor {name!r}")
        return handle.get_tensor(name)
