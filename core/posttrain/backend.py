"""posttrain.backend: the face for backend authors - what a strategy's engine shares with the
others: a rank's micro-batches and passes, model loading, torch and process-group plumbing, LoRA,
exported weights and checkpoints, memory estimates. Workflow and plugin authors need only
``posttrain``; a backend imports both (docs/plugin-guide.md, "The public face").

Like ``posttrain``, importing it is cheap: each name is imported when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.lazy_names import lazy_names

# Public name -> the module that defines it.
_PUBLIC = {
    # A rank's share of a batch: micro-batches, training passes, scoring
    "fixed_micro_batches": "posttrain.training.micro_batching",
    "token_budget_micro_batches": "posttrain.training.micro_batching",
    "micro_batch_size": "posttrain.training.rank_batches",
    "plan_micro_batches": "posttrain.training.rank_batches",
    "accumulate_gradients": "posttrain.training.rank_batches",
    "score_logprobs": "posttrain.training.rank_batches",
    "score_values": "posttrain.training.rank_batches",
    "score_sequences": "posttrain.training.rank_batches",
    "score_rows": "posttrain.training.rank_batches",
    "logprob_forward": "posttrain.scoring.logprob_head",
    "TokenLogprobs": "posttrain.scoring.logprob_head",
    "shifted_token_logprobs": "posttrain.scoring.modeling",
    "shifted_entropy": "posttrain.scoring.modeling",
    "shifted_values": "posttrain.scoring.modeling",
    "sequence_scores": "posttrain.scoring.modeling",
    "lr_lambda": "posttrain.training.lr_schedule",
    # Routing replay of mixture-of-experts models (algorithm.routing_replay)
    "ROUTING_KEY": "posttrain.training.routing_replay",
    "moe_routers": "posttrain.training.routing_replay",
    "routing_geometry": "posttrain.training.routing_replay",
    "routing_dtype": "posttrain.training.routing_replay",
    "record_routing": "posttrain.training.routing_replay",
    "replay_routing": "posttrain.training.routing_replay",
    "RoutingRecord": "posttrain.training.routing_replay",
    "RoutingReplay": "posttrain.training.routing_replay",
    "model_experts": "posttrain.training.routing_replay",
    "routing_replay_problem": "posttrain.training.routing_replay",
    "OldPolicyRouting": "posttrain.training.routing_replay",
    "scoring_forward": "posttrain.training.routing_replay",
    "update_forward": "posttrain.training.routing_replay",
    # Models and tokenizers
    "DTYPES": "posttrain.backends.models",
    "HEAD_WEIGHT": "posttrain.backends.models",
    "torch_dtype": "posttrain.backends.models",
    "resolve_model_path": "posttrain.backends.models",
    "load_tokenizer": "posttrain.backends.models",
    "load_causal_lm": "posttrain.backends.models",
    "load_model_with_head": "posttrain.backends.models",
    "no_hf_progress_bars": "posttrain.hf_progress",
    "is_preset": "posttrain.tasks.presets",
    "PRESETS": "posttrain.tasks.presets",
    # Torch plumbing of backends
    "is_cuda": "posttrain.backends.plumbing",
    "rank_device": "posttrain.backends.plumbing",
    "is_rank0": "posttrain.backends.plumbing",
    "log_once": "posttrain.backends.plumbing",
    "export_dtype": "posttrain.backends.plumbing",
    "forward_logits": "posttrain.backends.plumbing",
    "model_inputs": "posttrain.backends.plumbing",
    # Vision-language models: a batch's images as a model's forward takes them
    "image_forward_inputs": "posttrain.protocol",
    "image_tensors": "posttrain.protocol",
    "shown_token": "posttrain.protocol",
    "IMAGE_KEYS": "posttrain.protocol",
    "enable_gradient_checkpointing": "posttrain.backends.plumbing",
    "MEMORY_TAGS": "posttrain.backends.plumbing",
    "memory_tags": "posttrain.backends.plumbing",
    "drain": "posttrain.backends.plumbing",
    "adamw": "posttrain.backends.plumbing",
    "rng_state": "posttrain.backends.plumbing",
    "restore_rng_state": "posttrain.backends.plumbing",
    "tensor_parallel_replicas": "posttrain.backends.plumbing",
    "leads_replica": "posttrain.backends.plumbing",
    "move_optimizer_state": "posttrain.backends.plumbing",
    "settle_cuda": "posttrain.backends.plumbing",
    "save_tokenizer_beside": "posttrain.backends.plumbing",
    "end_process_group": "posttrain.backends.plumbing",
    "backend_for": "posttrain.backends.distributed",
    "init_default_process_group": "posttrain.backends.distributed",
    "destroy_default_process_group": "posttrain.backends.distributed",
    "agree_max": "posttrain.backends.distributed",
    "collective_timeout_s": "posttrain.backends.distributed",
    # LoRA adapters of trainers (model_args.lora)
    "LORA_ADAPTER": "posttrain.backends.lora",
    "LORA_RECORD": "posttrain.backends.lora",
    "lora_args": "posttrain.backends.lora",
    "wrap_lora": "posttrain.backends.lora",
    "adapter_sync": "posttrain.backends.lora",
    "synced_adapter": "posttrain.backends.lora",
    "lora_scaling": "posttrain.backends.lora",
    "adapter_wire_name": "posttrain.backends.lora",
    "parse_adapter_wire_name": "posttrain.backends.lora",
    "lora_layers": "posttrain.backends.lora",
    "lora_base_model": "posttrain.backends.lora",
    "lora_plain_name": "posttrain.backends.lora",
    "is_lora_adapter_entry": "posttrain.backends.lora",
    "lora_adapter_keys": "posttrain.backends.lora",
    "merge_lora_weight": "posttrain.backends.lora",
    "lora_record": "posttrain.backends.lora",
    "check_lora_record": "posttrain.backends.lora",
    "write_lora_adapter": "posttrain.backends.lora",
    # Exported weights and checkpoints
    "write_shards": "posttrain.backends.safetensors_shards",
    "export_streamed": "posttrain.backends.safetensors_shards",
    "unshare_storage": "posttrain.backends.tensors",
    "BackgroundSave": "posttrain.checkpoint.background",
    "HostBuffers": "posttrain.checkpoint.host_buffers",
    "write_threads": "posttrain.checkpoint.host_buffers",
    "FileDigests": "posttrain.checkpoint.digests",
    "HashingStream": "posttrain.checkpoint.digests",
    # Memory estimates (posttrain_estimate_memory)
    "MemoryQuery": "posttrain.memory.estimate",
    "RoleMemory": "posttrain.memory.estimate",
    "Workload": "posttrain.memory.estimate",
    "ModelGeometry": "posttrain.memory.geometry",
    "dtype_bytes": "posttrain.memory.estimate",
    "training_activation_bytes": "posttrain.memory.estimate",
    "forward_working_bytes": "posttrain.memory.estimate",
    "logit_bytes": "posttrain.memory.estimate",
    "release_knobs": "posttrain.memory.estimate",
    "ReleaseKnob": "posttrain.memory.estimate",
    "adam_trainer_state": "posttrain.memory.estimate",
    "hf_trainer_phases": "posttrain.memory.estimate",
}

__all__ = [*_PUBLIC]


__getattr__, __dir__ = lazy_names("posttrain.backend", _PUBLIC, globals())


if TYPE_CHECKING:  # what type checkers see of the names above (a test keeps both lists equal)
    from posttrain.backends.distributed import (
        agree_max,
        backend_for,
        collective_timeout_s,
        destroy_default_process_group,
        init_default_process_group,
    )
    from posttrain.backends.lora import (
        LORA_ADAPTER,
        LORA_RECORD,
        adapter_sync,
        adapter_wire_name,
        check_lora_record,
        is_lora_adapter_entry,
        lora_adapter_keys,
        lora_args,
        lora_base_model,
        lora_layers,
        lora_plain_name,
        lora_record,
        lora_scaling,
        merge_lora_weight,
        parse_adapter_wire_name,
        synced_adapter,
        wrap_lora,
        write_lora_adapter,
    )
    from posttrain.backends.models import (
        DTYPES,
        HEAD_WEIGHT,
        load_causal_lm,
        load_model_with_head,
        load_tokenizer,
        resolve_model_path,
        torch_dtype,
    )
    from posttrain.backends.plumbing import (
        MEMORY_TAGS,
        adamw,
        drain,
        enable_gradient_checkpointing,
        end_process_group,
        export_dtype,
        forward_logits,
        is_cuda,
        is_rank0,
        leads_replica,
        log_once,
        memory_tags,
        model_inputs,
        move_optimizer_state,
        rank_device,
        restore_rng_state,
        rng_state,
        save_tokenizer_beside,
        settle_cuda,
        tensor_parallel_replicas,
    )
    from posttrain.backends.safetensors_shards import export_streamed, write_shards
    from posttrain.backends.tensors import unshare_storage
    from posttrain.checkpoint.background import BackgroundSave
    from posttrain.checkpoint.digests import FileDigests, HashingStream
    from posttrain.checkpoint.host_buffers import HostBuffers, write_threads
    from posttrain.hf_progress import no_hf_progress_bars
    from posttrain.memory.estimate import (
        MemoryQuery,
        ReleaseKnob,
        RoleMemory,
        Workload,
        adam_trainer_state,
        dtype_bytes,
        forward_working_bytes,
        hf_trainer_phases,
        logit_bytes,
        release_knobs,
        training_activation_bytes,
    )
    from posttrain.memory.geometry import ModelGeometry
    from posttrain.protocol import IMAGE_KEYS, image_forward_inputs, image_tensors, shown_token
    from posttrain.scoring.logprob_head import TokenLogprobs, logprob_forward
    from posttrain.scoring.modeling import (
        sequence_scores,
        shifted_entropy,
        shifted_token_logprobs,
        shifted_values,
    )
    from posttrain.tasks.presets import PRESETS, is_preset
    from posttrain.training.lr_schedule import lr_lambda
    from posttrain.training.micro_batching import fixed_micro_batches, token_budget_micro_batches
    from posttrain.training.rank_batches import (
        accumulate_gradients,
        micro_batch_size,
        plan_micro_batches,
        score_logprobs,
        score_rows,
        score_sequences,
        score_values,
    )
    from posttrain.training.routing_replay import (
        ROUTING_KEY,
        OldPolicyRouting,
        RoutingRecord,
        RoutingReplay,
        model_experts,
        moe_routers,
        record_routing,
        replay_routing,
        routing_dtype,
        routing_geometry,
        routing_replay_problem,
        scoring_forward,
        update_forward,
    )
