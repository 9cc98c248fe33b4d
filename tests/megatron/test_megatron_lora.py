"""LoRA on megatron_train at TP2 (2 CPU ranks over gloo): frozen base, adapters-only
checkpoints resumed bitwise, the peft export loading in peft with the trainer's logits, and an
adapter-only sync sending what the peft export holds."""

from __future__ import annotations

import os

import pytest
import torch

from posttrain.config.sections import LoraArgs
from posttrain.testing import StrategyContract

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_workers import build_hf_model

    from posttrain.testing.spawn import run_ranks

    root = tmp_path_factory.mktemp("megatron-lora")
    model = build_hf_model(str(root / "model"), "qwen2")
    out = str(root / "out")
    os.makedirs(out)
    run_ranks("lora_workers:scenario_lora", 2, out, timeout=400, model=model)
    return model, out, [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_a_step_trains_the_adapters_alone(run):
    for result in run[2]:
        assert result["base_frozen"] and result["base_unchanged"]
        assert result["b_changed"]
        # 4 adapted linears x 4 layers x (A, B), and nothing else in the optimizer
        assert result["adapter_count"] == result["optimized"] == 32


def test_memory_estimate_counts_the_adapters_alone_as_trained(run):
    from lora_workers import LORA

    from posttrain.testing.memory import role_estimate
    from posttrain_megatron.config import MegatronTrainConfig
    from posttrain_megatron.plugin import plugin

    model, _, results = run
    resident = role_estimate(
        plugin,
        "megatron_train",
        MegatronTrainConfig(tensor_model_parallel_size=2),
        model=model,
        ranks=2,
        rows=8,
        prompt_tokens=6,
        response_tokens=11,
        model_args={"dtype": "fp32", "lora": LoraArgs(**LORA)},
    ).resident
    for result in results:
        held = result["held"]
        # fp32: the adapters' gradient buffer and Adam moments (FP32Optimizer: no master copy)
        assert held["grads"] == pytest.approx(resident["grads"], rel=0.05)
        assert held["optimizer"] == pytest.approx(resident["optimizer"], rel=0.01)
        assert held["weights"] == pytest.approx(resident["weights"], rel=0.01)


def test_replicated_halves_stay_equal_over_tp(run):
    # column-parallel A and row-parallel B are replicated: their TP ranks' gradients agree
    mine, other = (result["adapters"] for result in run[2])
    replicated = [
        name
        for name in mine
        if (name.endswith("lora_A") and ("linear_qkv" in name or "linear_fc1" in name))
        or (name.endswith("lora_B") and ("linear_proj" in name or "linear_fc2" in name))
    ]
    assert len(replicated) == 16
    for name in replicated:
        assert torch.equal(mine[name], other[name]), name
    # and the sharded halves are each rank's own
    assert not torch.equal(
        mine["decoder.layers.0.self_attention.linear_qkv.adapter.lora_B"],
        other["decoder.layers.0.self_attention.linear_qkv.adapter.lora_B"],
    )


def test_resume_from_adapters_is_bitwise(run):
    for result in run[2]:
        # synchronous: no background completion marker for the driver to wait on
        assert result["background"] is False
        assert result["loaded_equal"] and result["resumed_equal"]
    assert os.path.exists(f"{run[1]}/ckpt/lora.json")
    assert os.path.exists(f"{run[1]}/ckpt/lora_stage0.pt")
    assert not os.path.exists(f"{run[1]}/ckpt/megatron")  # no base weights


@pytest.mark.extended
@pytest.mark.parametrize(
    ("tag", "layout", "ranks"),
    [
        ("tp1", {}, 1),
        ("pp2", {"pipeline_model_parallel_size": 2}, 2),
        # the step under sequence parallelism: its gathers and reduce-scatters of the adapters
        ("tp2_sp", {"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2),
    ],
)
def test_adapters_saved_at_tp2_resume_under_other_layouts(run, tag, layout, ranks):
    from safetensors.torch import load_file

    from posttrain.testing.spawn import run_ranks

    model, out, _ = run
    run_ranks(
        "lora_workers:scenario_lora_resume",
        ranks,
        out,
        timeout=300,
        model=model,
        tag=tag,
        layout=layout,
    )
    uninterrupted = load_file(f"{out}/peft/adapter_model.safetensors")
    resumed = load_file(f"{out}/peft_{tag}/adapter_model.safetensors")
    assert uninterrupted.keys() == resumed.keys()
    # the second step under another layout: its sums in another order, no more
    assert max((uninterrupted[k] - resumed[k]).abs().max() for k in resumed) < 1e-6


def test_peft_export_gives_the_trainers_logits(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, out, results = run
    ids, logits = results[0]["ids"], results[0]["logits"]
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, f"{out}/peft").eval()
    with torch.no_grad():
        assert torch.allclose(peft(ids).logits, logits, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(f"{out}/merged", dtype=torch.float32)
        assert torch.allclose(merged(ids).logits, logits, atol=1e-5)
    assert os.path.exists(f"{out}/merged/adapter/adapter_model.safetensors")
    # the adapters moved the model (a comparison of untouched models proves nothing)
    plain = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        assert (plain(ids).logits - logits).abs().max() > 1e-3


def test_adapter_sync_sends_the_peft_adapters(run):
    from safetensors.torch import load_file

    _, out, results = run
    exported = {
        name.removeprefix("base_model.model."): t
        for name, t in load_file(f"{out}/peft/adapter_model.safetensors").items()
    }
    synced = results[0]["synced"]
    assert synced.keys() == exported.keys() and len(synced) == 4 * 7 * 2
    for name, tensor in synced.items():
        assert torch.equal(tensor, exported[name]), name


class TestMegatronTrainLoraContract(StrategyContract):
    """The kit's adapter tests at TP2: a sync holds the HF projections' adapters alone, and
    after a step hf_infer applying them over its own base gives the trainer's log-probs. The
    rest of the kit is TestMegatronTrainTP2Contract's, unchanged by adapters."""

    strategy = "megatron_train"
    strategy_config = {"tensor_model_parallel_size": 2}
    world_size = 2
    lora = LoraArgs(
        rank=4,
        alpha=8.0,
        target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
        sync="adapter",
    )

    test_declared_capabilities_match_implemented_hooks = None
    test_setup_reports_data_parallel_coordinates = None
    test_logprobs_match_transformers_forward = None
    test_generate_logprobs_match_transformers_forward = None
    test_import_weights_then_logprobs_match = None
    test_export_weights_equal_loaded_checkpoint = None
    test_train_then_in_process_sync_logprob_parity = None
    test_checkpoint_round_trip_is_exact = None
    test_critic_values_match_transformers_forward = None
    test_critic_checkpoint_round_trip_is_exact = None
    test_critic_value_step_reduces_value_loss = None


@pytest.mark.parametrize(
    ("lora", "config", "path"),
    [
        (
            {"target_modules": ["q_proj", "v_proj"]},
            {},
            "actor_train.model_args.lora.target_modules",
        ),
        ({"target_modules": ["lm_head"]}, {}, "actor_train.model_args.lora.target_modules"),
        ({"dropout": 0.1}, {}, "actor_train.model_args.lora.dropout"),
        (
            {},
            {"attention_backend": "transformer_engine"},
            "actor_train.strategy_args.strategy_config.attention_backend",
        ),
        (
            {},
            {"use_distributed_optimizer": True},
            "actor_train.strategy_args.strategy_config.use_distributed_optimizer",
        ),
    ],
)
def test_validation_refuses_what_the_adapters_do_not_cover(lora, config, path):
    from posttrain import ErrorReport
    from posttrain_megatron.checks import check_lora
    from posttrain_megatron.config import MegatronTrainConfig

    report = ErrorReport()
    check_lora("actor_train", LoraArgs(**lora), MegatronTrainConfig(**config), report)
    assert [issue.path for issue in report.errors] == [path]
    report = ErrorReport()
    check_lora("actor_train", LoraArgs(), MegatronTrainConfig(), report)
    assert not report.errors
