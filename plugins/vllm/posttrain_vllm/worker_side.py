"""Code that runs inside vLLM's worker: a worker extension, called by method name through
``llm.collective_rpc("posttrain_reload_weights", ...)``.

vLLM mixes :class:`PosttrainWorkerExtension` into its worker class (engine argument
``worker_extension_cls``), so the calls work with the in-process and the multiprocessing engine
alike (vLLM will not serialize a function across processes without pickle fallback).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.v1.worker.gpu_worker import Worker

    # What reload_weights reads: (name, tensor) pairs.
    Weights = Iterable[tuple[str, torch.Tensor]]

EXTENSION = "posttrain_vllm.worker_side.PosttrainWorkerExtension"


class PosttrainWorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker)."""

    def posttrain_reload_weights(
        self,
        weights_iterator: Weights | None = None,
        weights_path: str | None = None,
        retie: bool = False,
    ) -> bool:
        return reload_weights(self, weights_iterator, weights_path, retie)

    def posttrain_lora_modules(self) -> list[str]:
        return lora_modules(self)


def reload_weights(
    worker: Worker,
    weights_iterator: Weights | None = None,
    weights_path: str | None = None,
    retie: bool = False,
) -> bool:
    """vLLM's in-place ``reload_weights``, then re-tie a tied LM head when the embeddings
    changed: Qwen2/Llama skip ``lm_head.weight`` for tied models, and on CPU the head keeps a
    prepacked copy of the old embedding (the new weights would never reach the logits)."""
    worker.reload_weights(
        weights_iterator=weights_iterator, weights_path=weights_path, is_checkpoint_format=True
    )
    if retie:
        retie_lm_head(worker)
    return True


def retie_lm_head(worker: Worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform

    model = worker.model_runner.get_model()
    hf_config = worker.model_runner.model_config.hf_config
    text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
    lm_head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if not getattr(text_config, "tie_word_embeddings", False) or lm_head is None or embed is None:
        return
    with set_current_vllm_config(worker.vllm_config):
        lm_head.tie_weights(embed)
        if current_platform.is_cpu():
            lm_head.quant_method.process_weights_after_loading(lm_head)


def lora_modules(worker: Worker) -> list[str]:
    """The module names (last component, HF's: ``q_proj``, not vLLM's packed ``qkv_proj``)
    whose adapters vLLM's LoRA applies on this model: the names its adapter loader accepts."""
    manager = worker.model_runner.lora_manager._adapter_manager
    names: set[str] = set()
    for module in manager.supported_lora_modules:
        names.update(manager.packed_modules_mapping.get(module, [module]))
    return sorted(names)
