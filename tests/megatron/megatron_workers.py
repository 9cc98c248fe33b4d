"""Rank functions run by the megatron tests in spawned processes (importable by the children).

Each scenario builds :class:`WorkerContext` objects by hand, drives them through
:class:`WorkerRuntime` (so the plugin's hooks are what runs) and writes what the parent compares
into ``out_dir`` with ``torch.save``. Models are tiny HF checkpoints the parent builds locally.

Ranks run on the CPU over gloo; ``POSTTRAIN_MEGATRON_TEST_DEVICE=cuda`` runs the same scenarios
on CUDA GPUs over NCCL (one GPU per rank, fp32 without TF32: the tolerances stay those of CPU).
"""

from __future__ import annotations

import os

BATCH_ROWS = 8
DEVICE = os.environ.get("POSTTRAIN_MEGATRON_TEST_DEVICE", "cpu")


def launch(scenario: str, world_size: int, out_dir: str, timeout: float = 240.0, **kwargs):
    """Run ``scenario`` on ``world_size`` spawned ranks (gloo); raise on failure or timeout."""
    from posttrain.testing.spawn import run_ranks

    run_ranks(
        f"megatron_workers:scenario_{scenario}", world_size, out_dir, timeout=timeout, **kwargs
    )


# --------------------------------------------------------------------------------------------
# Models (built by the parent process)
# --------------------------------------------------------------------------------------------


def build_hf_model(path: str, arch: str) -> str:
    """A tiny HF checkpoint of ``arch`` at ``path`` (fp32, fixed seed)."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=31,  # odd: the vocabulary is padded to split over 2 TP ranks
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(num_hidden_layers=4, tie_word_embeddings=True, **common)
        )
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(
                num_hidden_layers=2, head_dim=16, tie_word_embeddings=False, **common
            )
        )
    elif arch == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(num_hidden_layers=2, tie_word_embeddings=False, **common)
        )
    elif arch == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                num_hidden_layers=2,
                head_dim=16,
                moe_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                tie_word_embeddings=False,
                **common,
            )
        )
    else:
        raise ValueError(arch)
    model.save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def hook_relay():
    import posttrain_megatron.plugin
    from posttrain.testing.groups import engine_hook_relay

    return engine_hook_relay(posttrain_megatron.plugin.plugin, "megatron")


def make_runtime(
    rank,
    world_size,
    model_path,
    strategy="megatron_train",
    training=None,
    dtype="fp32",
    **layout,
):
    from posttrain.config.sections import AlgorithmConfig, ModelArgs, TrainingArgs
    from posttrain.launch.worker import WorkerContext, WorkerRuntime
    from posttrain_megatron.config import MegatronInferConfig, MegatronTrainConfig

    train = strategy == "megatron_train"
    config = (MegatronTrainConfig if train else MegatronInferConfig)(**layout)
    targs = TrainingArgs(
        learning_rate=1e-3,
        weight_decay=0.01,
        max_grad_norm=1.0,
        # TP changes the summation order of row-parallel matmuls, so gradients differ in the last
        # bits; with Adam's default eps (1e-8) the update of an entry whose gradient is ~1e-8 is
        # +-lr depending on that noise. A larger eps keeps updates linear in such gradients, so
        # layouts are compared on their arithmetic rather than on Adam's sign of noise.
        adam_epsilon=1e-4,
        lr_scheduler_type="cosine",
        max_steps=10,
        per_device_train_batch_size=2,
        **(training or {}),
    )
    ctx = WorkerContext(
        role="actor_train" if train else "reference",
        strategy_name=strategy,
        config=config,
        model_args=ModelArgs(model_name_or_path=model_path, dtype=dtype),
        training_args=targs if train else None,
        rank=rank,
        world_size=world_size,
        algorithm=AlgorithmConfig(entropy_coef=1e-3),
        hook=hook_relay(),
        device=DEVICE,
    )
    if DEVICE == "cuda":
        _no_tf32()
    runtime = WorkerRuntime(ctx)
    runtime.setup()
    return runtime


def _no_tf32() -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def step_batch(step: int, vocab: int):
    from posttrain.testing.batches import random_step_batch

    return random_step_batch(step, vocab, BATCH_ROWS)


def engine_state(ctx):
    """The role's typed megatron engine state (step counters, optimizer, vocabulary size)."""
    from posttrain_megatron.state import MegatronState

    return ctx.engine_state(MegatronState)


def train_one(runtime, step: int) -> dict:
    """One RL step on this rank's data-parallel share: old log-probs, then the update."""
    ctx = runtime.ctx
    batch = step_batch(step, engine_state(ctx).vocab_size)
    share = batch.split(ctx.dp_size)[ctx.dp_rank]
    share.meta["dp_size"] = ctx.dp_size
    old = runtime.compute_logprobs(share)
    # Perturb so the importance ratio is not exactly one (exercises clipping).
    share = share.with_tensors(old_logprobs=old + 0.05 * (share.response_mask - 0.5))
    return runtime.train_step(share)


def hf_params(runtime) -> dict:
    """Every HF-named tensor (collective); full on rank 0, empty elsewhere."""
    from posttrain_megatron.weights import hf_tensors

    rank0 = runtime.ctx.rank == 0
    return {name: t.clone() for name, t in hf_tensors(runtime.ctx, keep=rank0) if rank0}


def adam_steps(runtime) -> list[float]:
    from posttrain_megatron.wrappers import inner_optimizers

    return sorted(
        {
            float(state["step"])
            for inner in inner_optimizers(engine_state(runtime.ctx).optimizer)
            for state in inner.state.values()
            if "step" in state
        }
    )


# --------------------------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------------------------


def scenario_train(
    rank,
    world_size,
    out_dir,
    model,
    tag,
    steps=2,
    save_after=None,
    load=None,
    layout=None,
    training=None,
):
    """``steps`` RL steps under ``layout`` (and ``training`` args); with ``save_after`` a
    checkpoint after that step, with ``load`` the run starts from that checkpoint."""
    import torch

    def save(obj, name):
        if rank == 0:
            torch.save(obj, os.path.join(out_dir, name))

    rt = make_runtime(rank, world_size, model, training=training, **(layout or {}))
    start = 0
    if load:
        rt.load_checkpoint(os.path.join(out_dir, load))
        start = engine_state(rt.ctx).step
        save(
            {"step": start, "updates": engine_state(rt.ctx).updates, "adam": adam_steps(rt)},
            f"resumed_{tag}.pt",
        )
    metrics = []
    for step in range(start, steps):
        metrics.append(train_one(rt, step))
        if save_after is not None and step + 1 == save_after:
            rt.save_checkpoint(os.path.join(out_dir, f"ckpt_{tag}"))
    save({"params": hf_params(rt), "metrics": metrics, "adam": adam_steps(rt)}, f"{tag}.pt")
    rt.shutdown()


def scenario_logits(rank, world_size, out_dir, model, tag, layout=None):
    """Logits of a probe batch (gathered over TP) and the exported HF tensors right after load."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    rt = make_runtime(rank, world_size, model, strategy="megatron_infer", **(layout or {}))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 31, (2, 12), generator=g)
    positions = torch.arange(12).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        logits = rt.ctx.model[0](
            input_ids=ids.to(DEVICE), position_ids=positions.to(DEVICE), attention_mask=None
        )
    full = gather_from_tensor_model_parallel_region(logits)[..., : engine_state(rt.ctx).vocab_size]
    full = full.cpu()
    exported = hf_params(rt)
    if rank == 0 and ps.is_pipeline_last_stage():
        torch.save({"ids": ids, "logits": full, "exported": exported}, f"{out_dir}/{tag}.pt")
    rt.shutdown()


def scenario_chunked_head(rank, world_size, out_dir, model, layout, chunk):
    """One RL step (old log-probs, then the update) of two trainers in this process, one scoring
    from the whole logits and one ``chunk`` tokens at a time; the rows each call of the chunked
    scores got show that it ran, in chunks."""
    import torch

    from posttrain_megatron import token_scores

    rows: list[int] = []
    original = token_scores.chunked_next_token_scores

    def counted(hidden, *args, **kwargs):
        rows.append(hidden.shape[0])
        return original(hidden, *args, **kwargs)

    # _chunked_model_scores calls it through the module global.
    token_scores.chunked_next_token_scores = counted
    out = {}
    for tokens in (0, chunk):
        rows.clear()
        rt = make_runtime(rank, world_size, model, logprob_chunk_tokens=tokens, **layout)
        ctx = rt.ctx
        batch = step_batch(0, engine_state(ctx).vocab_size)
        share = batch.split(ctx.dp_size)[ctx.dp_rank]
        out[tokens] = {
            "logprobs": rt.compute_logprobs(share),
            "metrics": train_one(rt, 0),
            "params": hf_params(rt),
            "rows": list(rows),
        }
    if rank == 0:
        torch.save(out, os.path.join(out_dir, "chunked_head.pt"))


def held_bytes(runtime) -> dict[str, int]:
    """What a megatron trainer holds, by part, in bytes of distinct storages: ``weights`` (the
    model chunks' parameters), ``grads`` (their ``main_grad``: the DDP gradient buffers) and
    ``optimizer`` (the inner optimizers' state and the float32 master parameters they step,
    where those are not the model's own)."""
    import torch

    from posttrain_megatron.wrappers import inner_optimizers

    parts: dict[str, dict[int, int]] = {"weights": {}, "grads": {}, "optimizer": {}}
    owner: dict[int, str] = {}

    def add(part, tensor):
        if tensor is None:
            return
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in owner:
            owner[storage.data_ptr()] = part
            parts[part][storage.data_ptr()] = storage.nbytes()

    params = [p for model in runtime.ctx.model for p in model.parameters()]
    for param in params:
        add("weights", param.data)
    for param in params:
        add("grads", getattr(param, "main_grad", None))
        add("grads", param.grad)
    for inner in inner_optimizers(engine_state(runtime.ctx).optimizer):
        for group in inner.param_groups:
            for master in group["params"]:
                add("optimizer", master)
        for state in inner.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    add("optimizer", value)
    return {part: sum(storages.values()) for part, storages in parts.items()}


def scenario_memory(rank, world_size, out_dir, model, layout, dtypes=("fp32",)):
    """One RL step under ``layout`` in each of ``dtypes``; what the trainer holds by part after
    it (``memory_{dtype}.pt``: a dict of parts per rank)."""
    import torch

    for dtype in dtypes:
        rt = make_runtime(rank, world_size, model, dtype=dtype, **layout)
        train_one(rt, 0)
        measured = held_bytes(rt)
        everyone = [None] * world_size
        torch.distributed.all_gather_object(everyone, measured)
        if rank == 0:
            torch.save(everyone, os.path.join(out_dir, f"memory_{dtype}.pt"))
        del rt  # not shutdown(): that ends the process groups the next one needs
