"""The memory plan (posttrain.memory): geometry and parameter counts as transformers has them,
the activation formulas against what autograd really saves, the plan's refusal, and ``auto``
checkpointing resolved from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
import transformers
from torch.autograd.graph import saved_tensors_hooks

from posttrain.host.plugin_host import create_plugin_host
from posttrain.loading.workflow import load_workflow
from posttrain.memory.estimate import GIB, layer_activation_bytes, training_activation_bytes
from posttrain.memory.geometry import geometry_from_config, preset_geometry, read_geometry
from posttrain.memory.plan import (
    RECOMPUTE_SHARE,
    USABLE_SHARE,
    plan_memory,
    refusal,
    resolve_recompute,
    resolve_release,
    with_release,
)

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
WIDTHS = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, vocab_size=96)


@pytest.mark.parametrize(
    ("config_class", "model_class", "extra"),
    [
        ("Qwen2Config", "Qwen2ForCausalLM", {}),
        ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": False}),
        ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
        (
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        ),
        ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
        (
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
        ),
        (  # a dense layer among the MoE ones
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            {"num_experts": 4, "moe_intermediate_size": 32, "mlp_only_layers": [1]},
        ),
    ],
)
def test_parameters_are_counted_as_transformers_counts_them(config_class, model_class, extra):
    config = getattr(transformers, config_class)(
        **WIDTHS, num_attention_heads=8, num_key_value_heads=2, **extra
    )
    model = getattr(transformers, model_class)(config)
    geometry = geometry_from_config(config.to_dict())
    assert geometry is not None
    assert geometry.params == sum(p.numel() for p in model.parameters())


def test_a_presets_geometry_needs_no_build_and_equals_its_config(posttrain_cache):
    built = read_geometry(str(Path(posttrain_cache) / "missing"))
    assert built is None  # neither a directory with a config nor a preset nor a cached hub id
    from posttrain.tasks.presets import preset_path

    for name in ("preset:tiny-qwen2", "preset:tiny-qwen3", "preset:tiny-qwen3-moe"):
        config = transformers.AutoConfig.from_pretrained(preset_path(name))
        assert preset_geometry(name) == geometry_from_config(config.to_dict())


def saved_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward pass of one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, WIDTHS["vocab_size"], (1, tokens))
    with saved_tensors_hooks(pack, lambda tensor: tensor):
        model.model(input_ids=ids)  # the decoder layers, without the output layer
    return sum(kept.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [2, 8])
def test_activation_estimate_is_what_autograd_saves(dtype, kv_heads):
    config = transformers.Qwen2Config(
        **WIDTHS, num_attention_heads=8, num_key_value_heads=kv_heads, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(dtype)
    geometry = geometry_from_config(config.to_dict())
    tokens = 256
    element = torch.finfo(dtype).bits // 8
    estimate = training_activation_bytes(geometry, tokens, element, recompute=False)
    estimate -= layer_activation_bytes(geometry, tokens, element)  # the gradients' layer
    measured = saved_bytes(model, tokens)
    assert abs(estimate - measured) <= 0.15 * measured, (estimate, measured)

    # Checkpointed, each layer keeps its input, and the final norm its input and output: the
    # plan's activations are those, plus one layer recomputed and its gradients.
    model.gradient_checkpointing_enable()
    model.train()
    kept = saved_bytes(model, tokens)
    layer = layer_activation_bytes(geometry, tokens, element)
    inputs = training_activation_bytes(geometry, tokens, element, recompute=True) - 2 * layer
    assert abs(inputs - kept) <= 0.15 * kept, (inputs, kept)


@pytest.fixture(scope="module")
def quickstart():
    host = create_plugin_host()
    workflow, report = load_workflow(str(QUICKSTART), host, {})
    assert not report.errors
    return workflow, host


def test_auto_checkpointing_turns_on_only_where_a_gpu_would_fill(quickstart):
    workflow, host = quickstart
    assert workflow.actor_train.model_args.disable_gradient_checkpointing == "auto"
    without = resolve_recompute(workflow, host, capacity=None)  # the CPU: off
    assert without.actor_train.model_args.disable_gradient_checkpointing is True
    worst = plan_memory(without, host).worst().total
    roomy = resolve_recompute(workflow, host, capacity=int(worst / RECOMPUTE_SHARE) + 2**20)
    assert roomy.actor_train.model_args.disable_gradient_checkpointing is True
    tight = resolve_recompute(workflow, host, capacity=int(worst / RECOMPUTE_SHARE) - 2**20)
    assert tight.actor_train.model_args.disable_gradient_checkpointing is False
    on = plan_memory(tight, host).worst().total
    assert on < worst  # recomputing keeps less
    # A setting the user wrote is theirs.
    mine = attrs.evolve(workflow.actor_train.model_args, disable_gradient_checkpointing=True)
    kept = attrs.evolve(workflow, actor_train=attrs.evolve(workflow.actor_train, model_args=mine))
    assert resolve_recompute(kept, host, capacity=1).actor_train is kept.actor_train


def release_settings(workflow) -> dict[str, dict[str, object]]:
    fields = ("param_offload", "optimizer_offload", "grad_offload", "release_when_idle")
    return {
        name: {
            f: getattr(role.strategy_args.strategy_config, f)
            for f in fields
            if hasattr(role.strategy_args.strategy_config, f)
        }
        for name, role in workflow.roles().items()
    }


def test_auto_release_knobs_turn_on_largest_first_only_until_the_plan_fits(quickstart):
    workflow, host = quickstart
    workflow = resolve_recompute(workflow, host, capacity=None)
    settings = release_settings(workflow)
    assert settings["actor_infer"]["param_offload"] == "auto"
    assert resolve_release(workflow, host, capacity=None) is workflow  # the CPU: left auto
    kept = plan_memory(workflow, host)
    worst = kept.worst().total
    roomy = resolve_release(workflow, host, capacity=int(worst / USABLE_SHARE) + 2**20)
    assert all(v is False for role in release_settings(roomy).values() for v in role.values())
    everything = {name: set(e.auto_release) for name, e in kept.roles.items()}
    least = plan_memory(with_release(workflow, kept.roles, everything), host).worst().total
    assert least < worst
    capacity = int(least / USABLE_SHARE) + 2**20
    tight = resolve_release(workflow, host, capacity=capacity)
    on = {(n, f) for n, role in release_settings(tight).items() for f, v in role.items() if v}
    assert on and not plan_memory(tight, host, capacity).over()
    assert all(
        v in (True, False) for role in release_settings(tight).values() for v in role.values()
    )
    # The rollout's replica frees the most: the first knob turned on.
    assert ("actor_infer", "param_offload") in on


def test_a_rollout_alone_on_its_gpus_is_never_released(quickstart):
    from posttrain.cli import _parse_overrides

    _, host = quickstart
    overrides = _parse_overrides(
        [
            "actor_train.device_mapping=[0]",
            "reference.device_mapping=[0]",
            "actor_infer.device_mapping=[1]",
        ]
    )
    workflow, report = load_workflow(str(QUICKSTART), host, overrides)
    assert not report.errors
    workflow = resolve_recompute(workflow, host, capacity=None)
    trainer_gpu = max(p.total for p in plan_memory(workflow, host).peaks if p.device == 0)
    tight = resolve_release(workflow, host, capacity=int(trainer_gpu / USABLE_SHARE) - 2**20)
    settings = release_settings(tight)
    # The trainer's GPU is over: its roles release; a host round trip of the rollout's weights
    # would free nothing there.
    on_trainer_gpu = {**settings["actor_train"], **settings["reference"]}
    assert any(v is True for v in on_trainer_gpu.values()), settings
    assert settings["actor_infer"]["param_offload"] is False


def test_a_plan_over_the_card_is_refused_with_its_numbers_and_knobs(quickstart):
    workflow, host = quickstart
    plan = plan_memory(workflow, host, capacity=GIB // 1024)
    why = refusal(plan)
    assert why is not None
    assert "does not fit the GPUs (0.0 GiB each" in why
    assert "GPU 0, train:" in why and "actor_train activations" in why
    assert "what would shrink it:" in why
    assert "actor_train.model_args.disable_gradient_checkpointing: false" in why
    assert refusal(plan_memory(workflow, host, capacity=80 * GIB)) is None


def plan_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "plan", str(QUICKSTART), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_posttrain_plan_prints_the_plan_and_exits_2_when_it_does_not_fit():
    fits = plan_command("--gpu-memory-gib", "80")
    assert fits.returncode == 0, fits.stderr
    assert "estimated peak per GPU and phase" in fits.stdout
    assert "fits: peak" in fits.stdout
    tight = plan_command("--gpu-memory-gib", "0.05")
    assert tight.returncode == 2, tight.stderr
    assert "does not fit" in tight.stdout and "what would shrink it" in tight.stdout
    zero = plan_command("--gpu-memory-gib", "0")
    assert zero.returncode == 2
    assert "a GPU's memory is above 0 GiB" in zero.stderr
    assert "Traceback" not in zero.stderr


def test_auto_resolved_in_a_reward_model_keeps_its_section(quickstart):
    from posttrain.cli import _parse_overrides
    from posttrain.config.sections import RewardConfig

    _, host = quickstart
    overrides = _parse_overrides(
        [
            "reward.strategy_args.strategy_name=hf_infer",
            "reward.model_args.model_name_or_path=preset:tiny-qwen2-reward",
        ]
    )
    workflow, report = load_workflow(str(QUICKSTART), host, overrides)
    assert not report.errors
    resolved = resolve_recompute(workflow, host, capacity=None)
    assert isinstance(resolved.reward, RewardConfig)
    assert resolved.reward.model_args.disable_gradient_checkpointing is True
    assert resolved.roles()["reward"].strategy_args.strategy_name == "hf_infer"
