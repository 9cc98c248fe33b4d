"""``posttrain validate`` checks of deepspeed roles (driver side; no torch, no deepspeed import)."""

from __future__ import annotations

from typing import Any

from posttrain import ErrorReport, did_you_mean, join_path
from posttrain_deepspeed import ds_schema

# Top-level keys the plugin sets from the workflow; set them there, not in ds_config.
_OWNED = {
    "train_batch_size": "training_args.per_device_train_batch_size",
    "train_micro_batch_size_per_gpu": "strategy_config.micro_batch_size",
    "gradient_accumulation_steps": "training_args (micro-batches follow the step's batch)",
    "managed_gradient_accumulation": "nothing: the plugin owns the accumulation boundary",
    "gradient_clipping": "training_args.max_grad_norm",
    "bf16": "model_args.dtype: bf16",
    "bfloat16": "model_args.dtype: bf16",
    "fp16": "model_args.dtype: fp16",
    "optimizer": "training_args (AdamW hyper-parameters) and strategy_config.offload_optimizer",
    "scheduler": "training_args.lr_scheduler_type / warmup_steps",
}
# zero_optimization keys that are typed fields of strategy_config.
_TYPED_ZERO = {
    "stage": "zero_stage",
    "offload_optimizer": "offload_optimizer",
    "offload_param": "offload_param",
    "overlap_comm": "overlap_comm",
    "contiguous_gradients": "contiguous_gradients",
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "stage3_param_persistence_threshold": "stage3_param_persistence_threshold",
    "stage3_max_live_parameters": "stage3_max_live_parameters",
    "stage3_max_reuse_distance": "stage3_max_reuse_distance",
    "stage3_prefetch_bucket_size": "stage3_prefetch_bucket_size",
}


def check_role(role_name: str, config: Any, report: ErrorReport) -> None:
    where = join_path(role_name, "strategy_args", "strategy_config")
    if config.offload_param and config.zero_stage != 3:
        report.error(
            f"{where}.offload_param",
            f"parameter offload partitions parameters: it needs zero_stage 3, got "
            f"{config.zero_stage}",
            "set zero_stage: 3, or offload_param: false",
        )
    if config.overlap_comm and config.zero_stage == 1:
        report.error(
            f"{where}.overlap_comm",
            "DeepSpeed overlaps communication with unmanaged gradient accumulation (which this "
            "plugin uses for variable micro-batch counts) only at ZeRO-2/3",
            "set overlap_comm: false, or zero_stage: 2 or 3",
        )
    _check_ds_config(where, config.ds_config, report)


def _check_ds_config(where: str, ds_config: dict[str, Any], report: ErrorReport) -> None:
    if not ds_config:
        return
    known = ds_schema.known_config_strings()
    for key, value in ds_config.items():
        path = f"{where}.ds_config.{key}"
        if key in _OWNED:
            report.error(
                path,
                f"{key} is set by the plugin from the workflow",
                f"set {_OWNED[key]} instead",
            )
        elif key == "zero_optimization":
            _check_zero(path, value, report)
        elif known is not None and key not in known:
            report.error(path, "not a DeepSpeed config key", did_you_mean(key, known))


def _check_zero(path: str, value: Any, report: ErrorReport) -> None:
    if not isinstance(value, dict):
        report.error(path, f"expected a mapping, got {type(value).__name__}", "")
        return
    fields = ds_schema.zero_config_keys()
    for key in value:
        sub = f"{path}.{key}"
        if key in _TYPED_ZERO:
            report.error(
                sub,
                "a typed field of strategy_config",
                f"set strategy_config.{_TYPED_ZERO[key]} instead",
            )
        elif fields is not None and key not in fields:
            report.error(
                sub,
                "not a field of DeepSpeed's zero_optimization (DeepSpeedZeroConfig)",
                did_you_mean(key, fields),
            )
