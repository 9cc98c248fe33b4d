"""Next-token log-probs and entropy of ``token_scores`` against ``torch.log_softmax`` over the
real vocabulary columns: values and gradients, dtypes, padding columns, a vocabulary split over
two gloo ranks, and the Triton kernels (in Triton's interpreter on CPU when Triton is installed;
on the GPU in test_megatron_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain_megatron import token_scores

HERE = Path(__file__).parent


def make_case(rows: int, width: int, dtype, device="cpu", seed: int = 0):
    """Logits [rows, width] (the last 3 columns padding), targets with some NO_TARGET rows, and
    random output gradients."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, width, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, width - 3, (rows,), generator=gen)
    targets[::5] = token_scores.NO_TARGET
    grads = torch.randn(2, rows, generator=gen)
    return logits.to(device), targets.to(device), grads.to(device)


def reference(logits, targets, vocab_size, grads):
    """log_softmax over the first ``vocab_size`` columns in float64: values and d/dlogits of
    grads[0] . logp + grads[1] . entropy."""
    z = logits.detach().double().requires_grad_(True)
    logp_all = torch.log_softmax(z[:, :vocab_size], dim=-1)
    logp = logp_all.gather(1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(targets >= 0, logp, 0.0)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (grads[0].double() * logp + grads[1].double() * entropy).sum().backward()
    return logp.detach(), entropy.detach(), z.grad


def ours(logits, targets, vocab_size, grads, vocab_start=0, group=None):
    x = logits.detach().clone().requires_grad_(True)
    logp, entropy = token_scores.next_token_scores(
        x, targets, vocab_start=vocab_start, vocab_size=vocab_size, group=group
    )
    logp = torch.where(targets.to(logp.device) >= 0, logp, 0.0)
    (grads[0] * logp + grads[1] * entropy).sum().backward()
    return logp, entropy, x.grad


def max_errors(logits, targets, grads, vocab_size=None) -> dict[str, float]:
    vocab_size = vocab_size or logits.shape[1] - 3
    want = reference(logits.cpu(), targets.cpu(), vocab_size, grads.cpu())
    got = ours(logits, targets, vocab_size, grads)
    # Differences relative to max(1, |value|): bf16 gradients are rounded to 8 bits.
    errors = {
        name: float(((g.detach().cpu().double() - w).abs() / w.abs().clamp(min=1)).max())
        for name, g, w in zip(("logp", "entropy", "grad"), got, want)
    }
    errors["padding_grad"] = float(got[2][:, vocab_size:].abs().max())
    errors["grad_dtype_kept"] = float(got[2].dtype == logits.dtype)
    return errors


# bf16 gradients are rounded to 8 bits: one ulp is 2**-7 relative.
@pytest.mark.parametrize(
    "dtype, tol, grad_tol",
    [(torch.float32, 1e-5, 1e-6), (torch.bfloat16, 1e-4, 8e-3)],
)
def test_torch_path_matches_log_softmax(dtype, tol, grad_tol):
    logits, targets, grads = make_case(37, 301, dtype)
    errors = max_errors(logits, targets, grads)
    assert errors["logp"] < tol and errors["entropy"] < tol, errors
    assert errors["grad"] < grad_tol, errors
    assert errors["padding_grad"] == 0.0 and errors["grad_dtype_kept"] == 1.0


def test_torch_path_chunks_rows(monkeypatch):
    """Row chunks (the float32 temporaries' bound) change nothing."""
    logits, targets, grads = make_case(50, 64, torch.float32, seed=1)
    whole = ours(logits, targets, 61, grads)
    monkeypatch.setattr(token_scores, "_CHUNK_ELEMENTS", 64 * 7)
    chunked = ours(logits, targets, 61, grads)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


def test_rows_without_target_have_no_target_gradient():
    logits, targets, grads = make_case(10, 40, torch.float32, seed=2)
    targets[:] = token_scores.NO_TARGET
    grads[1] = 0.0  # only the log-prob term: every row lacks a target
    _, _, grad = ours(logits, targets, 37, grads)
    assert torch.equal(grad, torch.zeros_like(grad))


def scenario_split_vocabulary(rank: int, world_size: int, out_dir: str) -> None:
    """Each rank holds half of the columns (the second half with the padding)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    logits, targets, grads = make_case(23, 2 * 50, torch.float32, seed=3)
    vocab_size = 2 * 50 - 3
    shard = logits[:, rank * 50 : (rank + 1) * 50]
    got = ours(shard, targets, vocab_size, grads, vocab_start=rank * 50, group=dist.group.WORLD)
    torch.save([t.detach() for t in got], os.path.join(out_dir, f"rank{rank}.pt"))


def test_vocabulary_split_over_two_ranks_matches_one(tmp_path):
    from posttrain.testing.spawn import run_ranks

    sys.path.insert(0, str(HERE))
    run_ranks(f"{Path(__file__).stem}:scenario_split_vocabulary", 2, str(tmp_path), timeout=120)
    logits, targets, grads = make_case(23, 100, torch.float32, seed=3)
    want = reference(logits, targets, 97, grads)
    shards = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank, (logp, entropy, grad) in enumerate(shards):
        assert (logp.double() - want[0]).abs().max() < 1e-5
        assert (entropy.double() - want[1]).abs().max() < 1e-5
        cols = slice(rank * 50, (rank + 1) * 50)
        assert (grad.double() - want[2][:, cols]).abs().max() < 1e-6
    assert torch.equal(shards[1][2][:, 47:], torch.zeros(23, 3))  # padding columns


def head_case(rows: int, hidden: int, width: int, dtype=torch.float32, seed: int = 0):
    """Hidden states [rows, hidden], an output weight [width, hidden] (the last 3 vocabulary
    columns padding), targets with some NO_TARGET rows and random output gradients."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.randn(width, hidden, generator=gen) / hidden**0.25).to(dtype)
    targets = torch.randint(0, width - 3, (rows,), generator=gen)
    targets[::5] = token_scores.NO_TARGET
    return h, weight, targets, torch.randn(2, rows, generator=gen)


def head_scores(h, weight, targets, grads, *, chunk, vocab_size, vocab_start=0, group=None):
    """(log-probs, entropy, d/dhidden, d/dweight) of grads[0] . logp + grads[1] . entropy, with
    the logits chunked (``chunk`` > 0) or whole (the output layer's product, then the scores)."""
    h = h.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    where = {"vocab_start": vocab_start, "vocab_size": vocab_size, "group": group}
    if chunk:
        logp, entropy = token_scores.chunked_next_token_scores(
            h, weight, targets, chunk_tokens=chunk, **where
        )
    else:
        logits = torch.nn.functional.linear(h, weight)
        logp, entropy = token_scores.next_token_scores(logits, targets, **where)
    logp = torch.where(targets >= 0, logp, 0.0)
    (grads[0] * logp + grads[1] * entropy).sum().backward()
    return logp.detach(), entropy.detach(), h.grad, weight.grad


def relative_errors(got, want) -> list[float]:
    return [
        float(((g.double() - w.double()).abs() / w.double().abs().clamp(min=1)).max())
        for g, w in zip(got, want)
    ]


@pytest.mark.parametrize("chunk", [8, 37, 100])
def test_chunked_head_matches_whole_logits(chunk):
    """Chunks of 8 rows (the last one short), exactly the rows, more than the rows: log-probs,
    entropy and the gradients of hidden states and weight as from the whole logits."""
    h, weight, targets, grads = head_case(37, 16, 53)
    want = head_scores(h, weight, targets, grads, chunk=0, vocab_size=50)
    got = head_scores(h, weight, targets, grads, chunk=chunk, vocab_size=50)
    assert max(relative_errors(got, want)) < 1e-5
    assert torch.equal(got[3][50:], torch.zeros(3, 16))  # padding rows of the weight


def test_chunked_head_keeps_bf16():
    """bf16 in, bf16 gradients out (the weight's summed over chunks in float32, cast once)."""
    h, weight, targets, grads = head_case(29, 16, 40, dtype=torch.bfloat16, seed=1)
    want = head_scores(h, weight, targets, grads, chunk=0, vocab_size=37)
    got = head_scores(h, weight, targets, grads, chunk=6, vocab_size=37)
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    errors = relative_errors(got, want)
    assert errors[0] < 1e-4 and errors[1] < 1e-4, errors  # scores: float32 sums of one product
    assert errors[2] < 2e-2 and errors[3] < 2e-2, errors  # a few bf16 ulps (2**-7)


def scenario_chunked_split_vocabulary(rank: int, world_size: int, out_dir: str) -> None:
    """Each rank holds half of the output weight's rows (the second half with the padding)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    h, weight, targets, grads = head_case(23, 16, 2 * 30, seed=3)
    shard = weight[rank * 30 : (rank + 1) * 30]
    where = {"vocab_size": 57, "vocab_start": rank * 30, "group": dist.group.WORLD}
    out = {chunk: head_scores(h, shard, targets, grads, chunk=chunk, **where) for chunk in (0, 5)}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def test_chunked_head_over_two_ranks_matches_whole_logits(tmp_path):
    """TP2: each rank's scores, its share of d/dhidden and its weight shard's gradient equal the
    whole logits' (the sums combined over both ranks), and the scores equal one rank's."""
    from posttrain.testing.spawn import run_ranks

    sys.path.insert(0, str(HERE))
    run_ranks(
        f"{Path(__file__).stem}:scenario_chunked_split_vocabulary", 2, str(tmp_path), timeout=120
    )
    h, weight, targets, grads = head_case(23, 16, 60, seed=3)
    single = head_scores(h, weight, targets, grads, chunk=0, vocab_size=57)
    shares = []
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert max(relative_errors(out[5], out[0])) < 1e-5
        assert max(relative_errors(out[5][:2], single[:2])) < 1e-5
        cols = slice(rank * 30, (rank + 1) * 30)
        assert max(relative_errors(out[5][3:], [single[3][cols]])) < 1e-5
        shares.append(out[5][2])
    # the TP region's backward sums the ranks' shares of the hidden states' gradient
    assert max(relative_errors([shares[0] + shares[1]], single[2:3])) < 1e-5


def triton_kernel_errors(device: str) -> dict[str, float]:
    """Largest differences of the Triton kernels from the float64 reference (CUDA, or CPU
    tensors in Triton's interpreter): rows longer than one block, bf16 and fp32."""
    from posttrain_megatron import token_scores_triton

    worst: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        # 9000 columns: two full 4096-blocks and a partial one.
        logits, targets, grads = make_case(6, 9003, dtype, device=device, seed=4)
        assert token_scores._impl(logits) is token_scores_triton or device == "cpu"
        if device == "cpu":  # the interpreter: call the kernels' module directly
            original = token_scores._impl
            token_scores._impl = lambda _: token_scores_triton
            try:
                errors = max_errors(logits, targets, grads)
            finally:
                token_scores._impl = original
        else:
            errors = max_errors(logits, targets, grads)
        for key, value in errors.items():
            worst[f"{dtype}:{key}"] = value
    return worst


def check_triton_errors(errors: dict[str, float]) -> None:
    for key, value in errors.items():
        if key.endswith("grad_dtype_kept"):
            assert value == 1.0, key
        elif key.endswith("padding_grad"):
            assert value == 0.0, key
        elif key.startswith("torch.float32"):
            assert value < 2e-5, (key, value)
        else:
            assert value < 8e-3, (key, value)  # bf16: one ulp (2**-7) relative


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="with a GPU the compiled kernels are tested instead"
)
def test_triton_kernels_in_the_interpreter():
    pytest.importorskip("triton")
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_token_scores as t; "
        "print('ERRORS', json.dumps(t.triton_kernel_errors('cpu')))"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(HERE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    line = next(x for x in proc.stdout.splitlines() if x.startswith("ERRORS "))
    check_triton_errors(json.loads(line[len("ERRORS ") :]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_on_the_gpu():
    check_triton_errors(triton_kernel_errors("cuda"))
    # A real vocabulary (Qwen2's 151,936 columns) in bf16, against the float64 reference.
    logits, targets, grads = make_case(64, 151936 + 3, torch.bfloat16, device="cuda", seed=5)
    errors = max_errors(logits, targets, grads)
    check_triton_errors({f"torch.bfloat16:{k}": v for k, v in errors.items()})


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_chunked_head_in_the_model_matches_whole_logits(tmp_path):
    """Through megatron's GPTModel at TP2 with sequence parallelism and tied embeddings: old
    log-probs, the step's metrics and the updated weights with logprob_chunk_tokens 5 equal
    those from the whole logits (logprob_chunk_tokens 0)."""
    from megatron_workers import build_hf_model, launch
    from safetensors.torch import load_file

    model = build_hf_model(str(tmp_path / "qwen2"), "qwen2")
    layout = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    launch("chunked_head", 2, str(tmp_path), model=model, layout=layout, chunk=5)
    out = torch.load(tmp_path / "chunked_head.pt", weights_only=False)
    whole, chunked = out[0], out[5]
    assert whole["rows"] == []
    # every forward (scoring, training) and its backward went through chunks of 5 tokens
    assert chunked["rows"] and max(chunked["rows"]) > 5
    assert (chunked["logprobs"] - whole["logprobs"]).abs().max() < 1e-5
    for key, value in whole["metrics"].items():
        assert chunked["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    params = whole["params"]
    assert params.keys() == chunked["params"].keys()
    for name, tensor in params.items():
        assert (chunked["params"][name] - tensor).abs().max() < 1e-5, name
    # the step moved the weights (equal untouched weights would prove nothing)
    initial = load_file(f"{model}/model.safetensors")
    assert max(float((params[k] - initial[k]).abs().max()) for k in initial) > 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_head_on_the_gpu():
    """Qwen2-1.5B's output layer (151,936 x 1536, bf16) over 16k tokens on the Triton kernels:
    chunks of 1024 tokens give the whole logits' scores and gradients, and the head's forward
    and backward peak at a fraction of the whole logits' (4.6 GiB, and their gradient)."""
    h, weight, targets, grads = head_case(16384, 1536, 151936 + 3, seed=6)
    h, weight, targets, grads = (
        h.cuda().bfloat16(),
        weight.cuda().bfloat16(),
        targets.cuda(),
        grads.cuda(),
    )
    peaks, results = {}, {}
    for chunk in (0, 1024):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        results[chunk] = head_scores(h, weight, targets, grads, chunk=chunk, vocab_size=151936)
        torch.cuda.synchronize()
        peaks[chunk] = torch.cuda.max_memory_allocated() - base
    errors = relative_errors(results[1024], results[0])
    # One bf16 rounding of a logit (2**-8 relative) moves a log-prob by up to ~0.03.
    assert errors[0] < 5e-2 and errors[1] < 5e-2, errors
    assert errors[2] < 5e-2 and errors[3] < 5e-2, errors
    whole_logits = 16384 * 151936 * 2
    assert peaks[0] > 2 * whole_logits, peaks
    # a chunk's logits and their gradient (0.6 GB), the float32 weight gradient (0.9 GB) and
    # a chunk's bf16 share of it (0.5 GB), the weight's copy here (0.5 GB): ~2.3 GB, not ~10.9
    assert peaks[1024] < 0.6 * whole_logits, peaks
