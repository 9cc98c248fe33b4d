"""Rank function of the vision-language tests of the HF trainers (tests/fsdp and tests/deepspeed,
``test_*_vision.py``), run in a spawned process: the trainer and hf_infer on the tiny Qwen2-VL
preset, in one process as in the hybrid engine, weights synced in process; prompts with images
from the count_shapes task, processed once."""

from __future__ import annotations

import os

VLM = "preset:tiny-qwen2-vl"


def _trainer(name: str):
    """The trainer's plugin, its strategy config (two micro-batches of 4 rows, in scoring and
    in the update: the images split with their rows) and the config of its reference strategy."""
    if name == "fsdp2_train":
        import posttrain_fsdp.plugin

        config = posttrain_fsdp.plugin.FSDP2TrainConfig(
            micro_batch_size=4, logprob_micro_batch_size=4
        )
        return posttrain_fsdp.plugin.plugin, config, None
    import posttrain_deepspeed.plugin
    from posttrain_deepspeed.config import DeepSpeedInferConfig, DeepSpeedTrainConfig

    # The trainer at ZeRO-2 (the default); the reference at ZeRO-3, built partitioned
    # (zero_init), loads the model's image-text-to-text class inside deepspeed.zero.Init.
    config = DeepSpeedTrainConfig(micro_batch_size=4, logprob_micro_batch_size=4)
    return posttrain_deepspeed.plugin.plugin, config, DeepSpeedInferConfig(micro_batch_size=4)


def _runtimes(rank: int, world_size: int, trainer: str):
    """The trainer's and hf_infer's runtimes, and the trainer plugin's reference strategy's
    (deepspeed_infer; None for fsdp2_train, whose reference is hf_infer's scoring)."""
    import posttrain_hf_infer.plugin
    from posttrain.config.sections import AlgorithmConfig, ModelArgs, TrainingArgs
    from posttrain.launch.worker import WorkerContext, WorkerRuntime
    from posttrain.testing.groups import engine_hook_relay
    from posttrain_hf_infer.plugin import HFInferConfig

    plugin, config, reference_config = _trainer(trainer)
    model_args = ModelArgs(model_name_or_path=VLM, dtype="fp32")
    algorithm = AlgorithmConfig(old_logprobs="recompute")
    contexts = [
        WorkerContext(
            role="actor_train",
            strategy_name=trainer,
            config=config,
            model_args=model_args,
            training_args=TrainingArgs(learning_rate=1e-2, max_steps=10),
            rank=rank,
            world_size=world_size,
            algorithm=algorithm,
            hook=engine_hook_relay(plugin, trainer),
        ),
        WorkerContext(
            role="actor_infer",
            strategy_name="hf_infer",
            config=HFInferConfig(batch_size=2),
            model_args=model_args,
            rank=rank,
            world_size=world_size,
            algorithm=algorithm,
            hook=engine_hook_relay(posttrain_hf_infer.plugin.plugin, "hf_infer"),
        ),
    ]
    if reference_config is not None:
        contexts.append(
            WorkerContext(
                role="reference",
                strategy_name="deepspeed_infer",
                config=reference_config,
                model_args=model_args,
                rank=rank,
                world_size=world_size,
                algorithm=algorithm,
                hook=engine_hook_relay(plugin, "deepspeed_infer"),
            )
        )
    runtimes = []
    for ctx in contexts:
        runtime = WorkerRuntime(ctx)
        runtime.setup()
        runtimes.append(runtime)
    return runtimes if reference_config is not None else [*runtimes, None]


def _prompts(tokenizer, count: int):
    """``count`` count_shapes prompts of different images; the last one twice, with text ids
    of different lengths (padding differs by row)."""
    from posttrain.tasks.vision import count_shapes, load_image_processor, process_prompt

    processor = load_image_processor(tokenizer)
    prompts = []
    for index, record in enumerate(count_shapes(count)):
        text = record["prompt"] if index % 2 else "1+2=" + record["prompt"]
        prompts.append(process_prompt(text, record["images"], tokenizer, processor))
    return prompts


def _rollout(infer, tokenizer, seed: int):
    from posttrain import GenerationRequest, SamplingParams
    from posttrain.protocol import build_sequence_batch
    from posttrain.testing.batches import on_policy_train_batch

    prompts = _prompts(tokenizer, 4)
    sampling = SamplingParams(n=2, max_new_tokens=4, ignore_eos=True)
    request = GenerationRequest(
        prompt_ids=[ids for ids, _ in prompts],
        images=[images for _, images in prompts],
        sampling=sampling,
        seed=seed,
    )
    samples = infer.generate(request)
    batch = build_sequence_batch(
        samples.prompt_ids,
        samples.response_ids,
        tokenizer.pad_token_id,
        samples.response_logprobs,
        images=samples.images,
    )
    return on_policy_train_batch(batch, seed)


def scenario_sync_parity(
    rank: int, world_size: int, out_dir: str, trainer: str = "fsdp2_train"
) -> None:
    """A training step (vision tower frozen), a weight sync of the whole model into hf_infer,
    then the trainer's log-probs of a new rollout's samples against the rollout's; and the
    same samples scored without their images, which must differ. With a reference strategy
    (deepspeed_infer), its log-probs of the first rollout's samples, before the update, against
    that rollout's."""
    import torch

    from posttrain.backend import forward_logits, load_tokenizer

    train, infer, reference_role = _runtimes(rank, world_size, trainer)
    ctx = train.ctx
    model = getattr(ctx.model, "module", ctx.model)  # the HF model inside a DeepSpeed engine
    tokenizer = load_tokenizer(ctx.model_args)
    vision = model.model.visual
    frozen_before = {k: v.detach().clone() for k, v in vision.state_dict().items()}
    text_before = model.model.language_model.norm.weight.detach().clone()
    first = _rollout(infer, tokenizer, seed=1)
    out = {}
    if reference_role is not None:
        before = reference_role.compute_logprobs(first)
        out["initial_reference_gap"] = float(
            ((before - first["rollout_logprobs"]).abs() * first.response_mask).max()
        )
    metrics = train.train_step(first)
    train.export_begin(bucket_bytes=1 << 20)
    buckets = []
    while (bucket := train.export_next()) is not None:
        buckets.append(bucket)
    infer.import_weights(buckets)
    synced = {name for bucket in buckets for name, _ in bucket.tensors}

    batch = _rollout(infer, tokenizer, seed=2)
    mask = batch.response_mask
    scored = train.compute_logprobs(batch)
    reference = infer.compute_logprobs(batch)
    text_only = {k: v for k, v in batch.tensors.items() if k not in ("pixel_values",)}
    text_only["pixel_values"] = torch.zeros_like(batch["pixel_values"])
    from posttrain.protocol import SequenceBatch

    blind = train.compute_logprobs(SequenceBatch(text_only, dict(batch.meta)))
    rollout = batch["rollout_logprobs"]
    out |= {
        "gap": float(((scored - rollout).abs() * mask).max()),
        "reference_gap": float(((reference - rollout).abs() * mask).max()),
        "blind_gap": float(((blind - rollout).abs() * mask).max()),
        "grad_norm": float(metrics.get("actor/grad_norm", 0.0)),
        "vision_frozen": all(
            torch.equal(frozen_before[k], v) for k, v in vision.state_dict().items()
        ),
        "vision_trainable": any(p.requires_grad for p in vision.parameters()),
        "text_moved": not torch.equal(text_before, model.model.language_model.norm.weight),
        "synced_vision": any(".visual." in name for name in synced),
        "rows": len(batch),
        "patches": tuple(batch["pixel_values"].shape),
    }
    # export-hf: the trained model, its tokenizer and image processor, and the logits of the
    # new rollout's rows the export must reproduce.
    train.export_hf(os.path.join(out_dir, "hf"))
    with torch.no_grad():
        out["probe"] = {k: v for k, v in batch.tensors.items() if k in PROBE_KEYS}
        out["logits"] = forward_logits(model, batch)
    torch.save(out, os.path.join(out_dir, "vision_parity.pt"))


PROBE_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")


# -- what the tests call in the pytest process ---------------------------------------------------


def run_scenario(out_dir, trainer: str) -> dict:
    """:func:`scenario_sync_parity` of ``trainer`` in a spawned rank, writing into ``out_dir``:
    what it found, and ``hf``, the directory of its export."""
    import torch

    from posttrain.tasks.presets import preset_path
    from posttrain.testing.spawn import run_ranks

    preset_path(VLM)  # built once, before the rank starts
    run_ranks(
        "vision_workers:scenario_sync_parity", 1, str(out_dir), timeout=240.0, trainer=trainer
    )
    found = torch.load(os.path.join(out_dir, "vision_parity.pt"), weights_only=False)
    found["hf"] = os.path.join(out_dir, "hf")
    return found


def check_export(parity: dict) -> None:
    """The scenario's export-hf loads in transformers with its image processor and gives the
    trainer's logits of the probe rows."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from posttrain.backend import model_inputs
    from posttrain.protocol import SequenceBatch

    model = AutoModelForImageTextToText.from_pretrained(parity["hf"], dtype=torch.float32)
    processor = AutoImageProcessor.from_pretrained(parity["hf"])
    assert processor.merge_size == 2 and processor.patch_size == 8
    probe = SequenceBatch(dict(parity["probe"]))
    with torch.no_grad():
        logits = model(
            **model_inputs(model, probe), attention_mask=probe.attention_mask, use_cache=False
        ).logits
    mask = probe.attention_mask.bool()
    assert (logits[mask] - parity["logits"][mask]).abs().max() < 1e-4


def check_frozen_tower(parity: dict) -> None:
    """The step trained the text model, not the frozen tower, and the sync sent the tower."""
    assert parity["grad_norm"] > 0
    assert parity["text_moved"]
    assert parity["vision_frozen"]
    assert not parity["vision_trainable"]
    assert parity["synced_vision"]
