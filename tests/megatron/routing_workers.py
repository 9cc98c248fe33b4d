"""Rank function of the megatron routing replay test (importable by the spawned children).

scenario_routing_replay: one run of a tiny Qwen3-MoE (2 MoE layers, 4 experts, top-2) at EP2
over gloo: the log-probs of each rank's share with the routers' own choice, then replaying given
routing (scoring and an update with activation recompute), then ``old_policy`` (record the old
pass, perturb the routers, update). Forward hooks on megatron's routers keep the experts each
call used (its routing map); this rank checks them against what should have been replayed and
saves what the parent compares with transformers. scenario_routing_layout: the replayed
log-probs and the old-policy pass's recorded routing under another parallel layout (the token
order of its shards and stages).
"""

from __future__ import annotations

import os

BASE = {
    "moe_token_dispatcher_type": "allgather",
    # Every layer recomputed in the update's backward pass: the routers run again there.
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
    # No load-balancing loss: the routers' gradient comes only through the replayed gates.
    "override_transformer_config": {"moe_aux_loss_coeff": 0.0},
}
LAYOUT = {**BASE, "expert_model_parallel_size": 2}
# Rows of a micro-batch (the trainer's per_device_train_batch_size in megatron_workers).
MB_ROWS = 2


def build_mixtral(path: str) -> str:
    """A tiny Mixtral (2 MoE layers, 4 experts, top-2; no q/k norms, so sequence parallelism
    runs on the CPU's torch norms) at ``path``."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    transformers.MixtralForCausalLM(config).save_pretrained(path)
    return path


def replay_ids(batch, layers: int, experts: int, k: int, seed: int = 5):
    """Random distinct top-k ids per token and layer, ``[B, T, layers, k]`` uint8, zeros on
    padding (as the rollout's routing travels)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows, width = batch.input_ids.shape
    ids = torch.rand(rows, width, layers, experts, generator=g).argsort(dim=-1)[..., :k]
    mask = batch.attention_mask.bool()[:, :, None, None]
    return torch.where(mask, ids, 0).to(torch.uint8)


def _groups(rows: int) -> list[list[int]]:
    return [list(range(i, min(i + MB_ROWS, rows))) for i in range(0, rows, MB_ROWS)]


def check_maps(calls, routing, lengths) -> tuple[int, set]:
    """Router calls ``(layer, routing_map [s * b, E])`` against ``routing`` [B, T, layers, k]
    on real tokens: each call must match one micro-batch's rows (megatron's token order: the
    sequence-major ``[s, b]``). Returns (calls matching none, the (layer, micro-batch) matched)."""
    import torch

    groups = _groups(routing.shape[0])
    misses, hits = 0, set()
    for layer, chosen in calls:
        experts = chosen.shape[1]
        matched = None
        for g, rows in enumerate(groups):
            width = chosen.shape[0] // len(rows)
            grid = chosen.view(width, len(rows), experts)
            want = [
                torch.zeros(lengths[r], experts, dtype=torch.bool).scatter_(
                    1, routing[r, : lengths[r], layer].long(), True
                )
                for r in rows
            ]
            if all(
                torch.equal(grid[: lengths[r], i], w) for i, (r, w) in enumerate(zip(rows, want))
            ):
                matched = g
                break
        if matched is None:
            misses += 1
        else:
            hits.add((layer, matched))
    return misses, hits


def routing_of(calls, rows: int, width: int, k: int):
    """The routing ``[rows, width, layers, k]`` a scoring pass's router calls chose (each layer
    called once per micro-batch, in micro-batch order)."""
    import torch

    layers = 1 + max(layer for layer, _ in calls)
    out = torch.zeros(rows, width, layers, k, dtype=torch.long)
    seen = dict.fromkeys(range(layers), 0)
    groups = _groups(rows)
    for layer, chosen in calls:
        group = groups[seen[layer]]
        seen[layer] += 1
        cols = chosen.shape[0] // len(group)
        ids = chosen.view(cols, len(group), -1).int().topk(k, dim=-1).indices.sort(-1).values
        for i, r in enumerate(group):
            n = min(cols, width)
            out[r, :n, layer] = ids[:n, i]
    return out


def scenario_routing_replay(rank, world_size, out_dir, model):
    import attrs
    import torch
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron_workers import engine_state, make_runtime, step_batch

    rt = make_runtime(rank, world_size, model, **LAYOUT)
    ctx = rt.ctx
    state = engine_state(ctx)
    routers = [m for chunk in ctx.model for m in chunk.modules() if isinstance(m, TopKRouter)]
    calls: list = []

    def keep(layer):
        def hook(module, args, output):
            calls.append((layer, output[1].detach().cpu()))

        return hook

    for layer, router in enumerate(routers):
        router.register_forward_hook(keep(layer))
    k = routers[0].topk

    def algorithm(**kwargs):
        ctx.algorithm = attrs.evolve(ctx.algorithm, **kwargs)

    batch = step_batch(0, state.vocab_size)
    routing = replay_ids(batch, len(routers), routers[0].config.num_moe_experts, k)
    share = batch.split(ctx.dp_size)[ctx.dp_rank]
    routing = routing.split(len(share))[ctx.dp_rank]
    share.meta["dp_size"] = ctx.dp_size
    lengths = [int(n) for n in share.attention_mask.sum(dim=1)]
    out = {"routing": routing, "share": share}

    # The routers' own choice, then the replayed routing: scoring, and an update (recompute).
    out["own"] = rt.compute_logprobs(share)
    algorithm(routing_replay="rollout")
    routed = share.with_tensors(routing=routing)
    calls.clear()
    out["replayed"] = rt.compute_logprobs(routed)
    out["scoring_check"] = check_maps(calls, routing, lengths)

    grads: list[float] = []
    optimizer_step = state.optimizer.step

    def step():
        grads.extend(float(r.weight.main_grad.norm()) for r in routers)
        return optimizer_step()

    state.optimizer.step = step
    calls.clear()
    rt.train_step(routed.with_tensors(old_logprobs=out["replayed"]))
    out["update_calls"] = len(calls)
    out["update_check"] = check_maps(calls, routing, lengths)
    out["router_grads"] = grads

    # old_policy: the old pass's own routing replayed in the update after the routers moved.
    algorithm(routing_replay="old_policy", old_logprobs="recompute")
    calls.clear()
    old = rt.compute_logprobs(share)
    recorded = routing_of(calls, len(share), share.input_ids.shape[1], k)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for router in routers:
            router.weight.add_(5.0 * torch.randn(router.weight.shape, generator=g))
    algorithm(routing_replay="off")
    calls.clear()
    rt.compute_logprobs(share)
    out["perturbed_check"] = check_maps(calls, recorded, lengths)
    algorithm(routing_replay="old_policy")
    calls.clear()
    rt.train_step(share.with_tensors(old_logprobs=old))
    out["old_policy_check"] = check_maps(calls, recorded, lengths)
    torch.save(out, os.path.join(out_dir, f"routing_{rank}.pt"))
    rt.shutdown()


def scenario_routing_layout(rank, world_size, out_dir, model, layout, tag):
    """Under ``layout``: log-probs replaying given routing, an update replaying it, and the
    routing the old-policy pass recorded (whole: every shard and stage) as the update gets it."""
    import attrs
    import torch
    from megatron_workers import engine_state, make_runtime, step_batch

    from posttrain.backend import ROUTING_KEY

    rt = make_runtime(rank, world_size, model, **{**BASE, **layout})
    ctx = rt.ctx
    state = engine_state(ctx)

    def algorithm(**kwargs):
        ctx.algorithm = attrs.evolve(ctx.algorithm, **kwargs)

    batch = step_batch(0, state.vocab_size)
    routing = replay_ids(batch, layers=2, experts=4, k=2)
    share = batch.split(ctx.dp_size)[ctx.dp_rank]
    routing = routing.split(len(share))[ctx.dp_rank]
    share.meta["dp_size"] = ctx.dp_size
    routed = share.with_tensors(routing=routing)
    algorithm(routing_replay="rollout")
    out = {"share": share, "routing": routing, "replayed": rt.compute_logprobs(routed)}
    algorithm(routing_replay="old_policy", old_logprobs="recompute")
    rt.compute_logprobs(share)
    out["recorded"] = state.old_routing.attach(share, torch.device("cpu"))[ROUTING_KEY]
    algorithm(routing_replay="rollout")
    metrics = rt.train_step(routed.with_tensors(old_logprobs=out["replayed"]))
    out["grad_norm"] = metrics["actor/grad_norm"]
    torch.save(out, os.path.join(out_dir, f"layout_{tag}_{rank}.pt"))
    rt.shutdown()
