"""hf_infer with synced LoRA adapters (``model_args.lora.sync: adapter``): the adapters a sync
brings land in buffers allocated at load, and every decode path (the dynamic cache, the fixed-
shape step with stacked projections, the compiled step's view of the model) and the scoring
give the peft model's log-probs; a second sync changes them with the same buffers."""

from __future__ import annotations

import pytest
import torch

from posttrain.protocol import GenerationRequest, SamplingParams, WeightBucket
from posttrain.testing.batches import PROMPTS
from posttrain.testing.expected import forward_logprobs, max_sample_logprob_diff, samples_batch

# q and v adapted, k not; up adapted, gate not: stacked groups with members of both kinds. The
# head is tied to the embedding: its adapter is the head's alone, as peft's.
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "lm_head"]
RANK, ALPHA = 4, 8.0
TOLERANCE = 1e-4  # fp32


@pytest.fixture(scope="module")
def peft_model(tiny_model_path):
    """The peft reference: the tiny model with adapters on :data:`TARGETS`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(base, config).eval()


@pytest.fixture(scope="module")
def worker(tiny_model_path):
    """hf_infer loaded as the actor_infer of a policy whose syncs carry adapters."""
    from posttrain.config.sections import LoraArgs, ModelArgs
    from posttrain.launch.worker import WorkerContext
    from posttrain_hf_infer import engine as hf_infer
    from posttrain_hf_infer.plugin import HFInferConfig

    lora = LoraArgs(rank=RANK, alpha=ALPHA, target_modules=TARGETS, sync="adapter")
    worker = WorkerContext(
        role="actor_infer",
        strategy_name="hf_infer",
        config=HFInferConfig(),
        model_args=ModelArgs(model_name_or_path=tiny_model_path, dtype="fp32", lora=lora),
        device="cpu",
    )
    worker.model = hf_infer.load_model(worker)
    return worker


def randomize(peft_model, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random non-zero A and B in the peft model; what a trainer's adapter sync sends of them."""
    from posttrain.backend import adapter_wire_name, is_lora_adapter_entry

    gen = torch.Generator().manual_seed(seed)
    sent = []
    with torch.no_grad():
        for name, tensor in peft_model.state_dict(keep_vars=True).items():
            if is_lora_adapter_entry(name):
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=gen))
                sent.append((adapter_wire_name(name), tensor.detach().clone()))
    return sent


def generate(worker, decode: str):
    import attrs

    from posttrain_hf_infer import engine as hf_infer
    from posttrain_hf_infer.engine import HFInferState

    worker.config = attrs.evolve(worker.config, decode=decode)
    worker.engine_state(HFInferState).decoders = None
    request = GenerationRequest(
        prompt_ids=PROMPTS[:3], sampling=SamplingParams(n=2, max_new_tokens=6), seed=3
    )
    return hf_infer.generate(worker, request)


def check_parity(worker, peft_model, decodes) -> None:
    """Each decode's samples score as the peft model scores them, and so does hf_infer's own
    scoring."""
    from posttrain_hf_infer import engine as hf_infer

    for decode in decodes:
        out = generate(worker, decode)
        gap = max_sample_logprob_diff(out, forward_logprobs(peft_model, out))
        assert gap <= TOLERANCE, f"decode {decode}: {gap}"
    batch = samples_batch(out)
    scored = hf_infer.compute_logprobs(worker, batch)
    torch.testing.assert_close(scored, forward_logprobs(peft_model, out), rtol=0, atol=TOLERANCE)


def test_synced_adapters_give_the_peft_models_logprobs_in_every_decode(
    worker, peft_model, monkeypatch
):
    from posttrain_hf_infer import engine as hf_infer
    from posttrain_hf_infer import static_decode
    from posttrain_hf_infer.adapters import AdaptedLinear

    # decode "compiled" with its step uncompiled (a compile costs seconds even without
    # Inductor): the step still runs on the model's view, with its own stacked projections.
    def step(*args):
        return static_decode.decode_forward(*args)

    monkeypatch.setattr(static_decode, "compiled_forward", lambda: step)
    shapes = hf_infer.weight_shapes(worker)
    attention = worker.model.model.layers[0].self_attn
    assert shapes["model.layers.0.self_attn.q_proj.lora_A.weight"] == (RANK, 64)
    assert shapes["lm_head.lora_B.weight"] == (worker.model.config.vocab_size, RANK)
    assert "model.layers.0.self_attn.k_proj.lora_A.weight" not in shapes
    assert type(attention.k_proj) is torch.nn.Linear
    # The state dict stays the base model's; the tied head still shares the embedding.
    assert "model.layers.0.self_attn.q_proj.weight" in worker.model.state_dict()
    assert worker.model.lm_head.weight is worker.model.model.embed_tokens.weight

    # Before any sync the adapters are zero: the base model's log-probs.
    with peft_model.disable_adapter():
        check_parity(worker, peft_model, ["dynamic"])

    hf_infer.import_weights(worker, [WeightBucket(randomize(peft_model, seed=1))])
    decodes = ["dynamic", "static", "compiled"]
    check_parity(worker, peft_model, decodes)
    # The fixed-shape decode stacked q/k/v and gate/up with their adapters: the buffers are
    # views of the stacked ones, which the second sync writes.
    q_proj = attention.q_proj
    assert isinstance(q_proj, AdaptedLinear)
    buffer, group = q_proj.lora_B, q_proj.posttrain_group
    assert group.lora_b is not None and group.lora_b.shape == (64 + 32 + 32, 2 * RANK)

    hf_infer.import_weights(worker, [WeightBucket(randomize(peft_model, seed=2))])
    assert attention.q_proj is q_proj and q_proj.lora_B is buffer
    assert torch.equal(group.lora_b[:64, :RANK], peft_model_b(peft_model, "q_proj"))
    check_parity(worker, peft_model, decodes)


def peft_model_b(peft_model, name: str) -> torch.Tensor:
    layer = getattr(peft_model.base_model.model.model.layers[0].self_attn, name)
    return layer.lora_B["default"].weight


def test_adapter_sync_refuses_what_it_cannot_take(worker):
    from tiny_models import tiny_qwen2

    from posttrain import UserError
    from posttrain_hf_infer import engine as hf_infer
    from posttrain_hf_infer.adapters import attach_adapters

    wrong = [("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(RANK + 1, 64))]
    with pytest.raises(ValueError, match=r"q_proj\.lora_A\.weight came with shape"):
        hf_infer.import_weights(worker, [WeightBucket(wrong)])
    unadapted = [("model.layers.0.self_attn.k_proj.lora_A.weight", torch.zeros(RANK, 64))]
    with pytest.raises(KeyError, match="not adapt"):
        hf_infer.import_weights(worker, [WeightBucket(unadapted)])
    with pytest.raises(UserError, match=r"model\.embed_tokens \(Embedding\)"):
        attach_adapters(tiny_qwen2(), ["q_proj", "embed_tokens"], RANK, 2.0)
    with pytest.raises(UserError, match="names no module"):
        attach_adapters(tiny_qwen2(), ["qkv"], RANK, 2.0)


def test_a_checkpoint_keeps_the_synced_adapters(worker, peft_model, tmp_path):
    """A rollout checkpoint holds the adapters under their wire names, and loads them back as a
    sync; an HF export is the policy with the adapters merged."""
    from transformers import AutoModelForCausalLM

    from posttrain import UserError
    from posttrain_hf_infer import engine as hf_infer
    from posttrain_hf_infer.adapters import adapter_buffers

    sent = dict(randomize(peft_model, seed=3))
    hf_infer.import_weights(worker, [WeightBucket(list(sent.items()))])
    hf_infer.save_checkpoint(worker, str(tmp_path / "checkpoint"))
    zeros = [(name, torch.zeros_like(tensor)) for name, tensor in sent.items()]
    hf_infer.import_weights(worker, [WeightBucket(zeros)])
    hf_infer.load_checkpoint(worker, str(tmp_path / "checkpoint"))
    buffers = adapter_buffers(worker.model)
    assert all(torch.equal(buffers[name], tensor) for name, tensor in sent.items())

    # The head is tied: an export of its merged weight would change the embedding too.
    with pytest.raises(UserError, match="lm_head shares its weight"):
        hf_infer.export_hf(worker, str(tmp_path / "export"))
    head = [(n, torch.zeros_like(t)) for n, t in sent.items() if n.startswith("lm_head.")]
    hf_infer.import_weights(worker, [WeightBucket(head)])
    with torch.no_grad():
        peft_model.base_model.model.lm_head.lora_B["default"].weight.zero_()
    hf_infer.export_hf(worker, str(tmp_path / "export"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(
            exported(ids).logits, peft_model(input_ids=ids).logits, rtol=0, atol=TOLERANCE
        )


def test_a_split_replica_refuses_adapter_syncs_before_anything_starts():
    from pathlib import Path

    from posttrain.host.plugin_host import create_plugin_host
    from posttrain.loading.workflow import load_workflow

    quickstart = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    config = "actor_infer.strategy_args.strategy_config"
    _, report = load_workflow(
        str(quickstart),
        create_plugin_host(),
        {f"{config}.tensor_parallel_size": 2, "actor_train.model_args.lora.rank": 4},
    )
    errors = {issue.path: issue.message for issue in report.errors}
    assert "adapters" in errors.get(f"{config}.tensor_parallel_size", ""), errors
