"""What the conformance kit compares a strategy against: plain transformers forward passes over
the same weights, and the batches and weights it feeds both."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from posttrain.config.converter import CONVERTER
from posttrain.host.plugin_host import create_plugin_host
from posttrain.protocol import SequenceBatch, build_sequence_batch, concat_tensor_rows
from posttrain.scoring.modeling import shifted_token_logprobs, shifted_values
from posttrain.testing.batches import PROMPTS

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from posttrain.host.plugin_host import PluginHost
    from posttrain.host.strategy import StrategySpec
    from posttrain.launch.base import WorkerGroup
    from posttrain.launch.worker import WorkerRuntime
    from posttrain.protocol import RolloutSamples


def kit_host(plugins: tuple[str, ...] = ()) -> PluginHost:
    """The plugin host a run builds, with the module ``plugins`` a workflow would name loaded
    too (a plugin under test that is not installed)."""
    host = create_plugin_host()
    problems = host.load_workflow_plugins(list(plugins))
    if problems:
        pytest.fail("; ".join(f"{message} ({hint})" for _, message, hint in problems))
    return host


def structure_config(
    strategy: str, raw: dict[str, Any], plugins: tuple[str, ...] = ()
) -> tuple[StrategySpec, Any]:

    spec = kit_host(plugins).strategies().get(strategy)
    if spec is None:
        pytest.skip(f"strategy {strategy!r} is not installed")
    return spec, CONVERTER.structure(raw, spec.config_class)


def reference_logprobs(
    model_path: str, state: dict[str, torch.Tensor] | None, batch: SequenceBatch
) -> torch.Tensor:
    """Log-probs of ``batch`` from a plain transformers forward pass (the ground truth)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state, strict=False)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return shifted_token_logprobs(logits, batch.input_ids) * batch.attention_mask


def perturbed_state(model_path: str, seed: int = 7, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded noise: what a weight import must reproduce exactly."""
    state = load_file(os.path.join(model_path, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state.items()}


def samples_batch(out: RolloutSamples, pad_id: int = 0) -> SequenceBatch:
    return build_sequence_batch(out.prompt_ids, out.response_ids, pad_id)


def forward_logprobs(model: PreTrainedModel, out: RolloutSamples, pad_id: int = 0) -> torch.Tensor:
    """Log-probs of the samples ``out`` (prompts and responses) from ``model``'s own forward pass
    on its device and in its dtype, laid out as :func:`max_sample_logprob_diff` reads them."""
    batch = samples_batch(out, pad_id)
    ids = batch.input_ids.to(model.device)
    mask = batch.attention_mask.to(model.device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return (shifted_token_logprobs(logits, ids) * mask).cpu()


def forward_logprob_gap(model: PreTrainedModel, out: RolloutSamples) -> float:
    """The largest gap between the samples' log-probs and ``model``'s own forward pass's
    (:func:`forward_logprobs`)."""
    return max_sample_logprob_diff(out, forward_logprobs(model, out))


def max_sample_logprob_diff(out: RolloutSamples, ref: torch.Tensor) -> float:
    worst = 0.0
    for i, (p, lps) in enumerate(zip(out.prompt_ids, out.response_logprobs)):
        for j, lp in enumerate(lps):
            worst = max(worst, abs(float(ref[i, len(p) + j]) - lp))
    return worst


def cut_after_stop_string(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], logprobs: list[float], stop: Iterable[str]
) -> tuple[list[int], list[float]]:
    """What a rollout engine returns for a free-running sample once given stop strings: the
    tokens up to the first one after which the text (special tokens skipped) holds a stop
    string, and their log-probs."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if any(s in text for s in stop):
            return ids[:k], logprobs[:k]
    return ids, logprobs


def synthetic_train_batch(seed: int = 0, dp_size: int = 1) -> SequenceBatch:
    """Uneven-length sequences with advantages, as the loop hands them to ``train_step``."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(8):
        prompts.append(PROMPTS[i % len(PROMPTS)])
        length = 1 + i % 3
        responses.append(torch.randint(4, 19, (length,), generator=gen).tolist())
    batch = build_sequence_batch(prompts, responses, 0)
    adv = torch.randn(len(batch), generator=gen)
    batch = batch.with_tensors(
        old_logprobs=torch.zeros_like(batch.response_mask) - 2.5,
        advantages=adv[:, None] * batch.response_mask,
    )
    batch.meta.update(
        global_tokens=float(batch.response_mask.sum()),
        global_seqs=float(len(batch)),
        dp_size=dp_size,
    )
    return batch


def value_train_batch(group: WorkerGroup, seed: int = 0) -> SequenceBatch:
    """:func:`synthetic_train_batch` as the loop hands it to a critic: the values the critic
    ``group`` gives it now (``values``) and the returns to regress on, one per row, at most 0.4
    from those (inside the default ``cliprange_value`` of 0.5: the clip does not hide a step's
    progress)."""
    batch = synthetic_train_batch(seed, group.dp_size)
    values = group_values(group, batch)
    gen = torch.Generator().manual_seed(100 + seed)
    offset = (torch.rand(len(batch), 1, generator=gen) * 0.8 - 0.4) * batch.response_mask
    return batch.with_tensors(values=values, returns=(values + offset) * batch.response_mask)


def reference_values(hf_dir: str, batch: SequenceBatch) -> torch.Tensor:
    """Values of ``batch`` from a plain transformers forward pass of an exported critic: the
    value model it declares itself to be (``*ForTokenClassification``, one label, no bias)."""
    model = AutoModelForTokenClassification.from_pretrained(hf_dir, dtype=torch.float32)
    assert model.num_labels == 1
    assert model.score.bias is None
    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return shifted_values(out) * batch.attention_mask


def masked_value_loss(values: torch.Tensor, batch: SequenceBatch) -> float:
    """The unclipped value loss of ``values`` on ``batch`` (mean over response tokens)."""
    mask = batch.response_mask
    return float((0.5 * (values - batch["returns"]) ** 2 * mask).sum() / mask.sum())


def export_state(group: WorkerGroup) -> dict[str, torch.Tensor]:
    """Every HF-named tensor a trainer exports (weight-sync buckets, rank 0's copy). Every rank
    must yield one bucket (an empty one where it holds none) for each of rank 0's: a transport
    steps all ranks together, and a rank that stops early leaves the others' gathers waiting."""
    group.call("export_begin", 64 << 10)
    state: dict[str, torch.Tensor] = {}
    sent = 0
    while True:
        buckets = group.call("export_next")
        ended = [rank for rank, bucket in enumerate(buckets) if bucket is None]
        if ended and len(ended) < len(buckets):
            going = [rank for rank in range(len(buckets)) if rank not in ended]
            pytest.fail(
                f"export_weights: rank(s) {ended} ended after {sent} bucket(s) while rank(s) "
                f"{going} yielded more: every rank must yield one bucket per step of the export "
                "(an empty one where it holds no gathered weights)",
                pytrace=False,
            )
        bucket = buckets[0]
        if bucket is None:
            return state
        names = [n for n, _ in bucket.tensors]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            pytest.fail(f"export_weights: a bucket names {duplicated} twice", pytrace=False)
        state.update(dict(bucket.tensors))
        sent += 1


def state_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str:
    """How two exports differ ("" when they are equal bitwise): the tensors that differ, the
    largest difference and where."""
    if got.keys() != expected.keys():
        missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
        return f"names differ (missing {missing[:3]}, unexpected {extra[:3]})"
    differing = [k for k in expected if not torch.equal(got[k], expected[k])]
    if not differing:
        return ""
    worst = max(differing, key=lambda k: float((got[k].float() - expected[k].float()).abs().max()))
    gap = float((got[worst].float() - expected[worst].float()).abs().max())
    return f"{len(differing)} of {len(expected)} tensors differ, by up to {gap:.3g} in {worst!r}"


def rng_fingerprint(runtime: WorkerRuntime) -> str:
    """Rank side (``group.call("run_function", ...)``): a digest of the random state a step
    draws from (torch's CPU generator, and its GPU's on a GPU rank: what ``posttrain.backend``'s
    ``rng_state`` saves), read without drawing."""
    import hashlib

    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        digest.update(torch.cuda.get_rng_state().numpy().tobytes())
    return digest.hexdigest()


def value_probe() -> SequenceBatch:
    """The batch whose values the critic contract compares."""
    return synthetic_train_batch(seed=2)


def group_values(group: WorkerGroup, batch: SequenceBatch) -> torch.Tensor:
    """A critic group's values of ``batch`` (each DP rank scores its share), masked."""
    shares = group.call_dp("compute_values", batch.split(group.dp_size))
    return concat_tensor_rows(shares) * batch.attention_mask
