"""The LoRA pieces trainers share (``posttrain.backend.wrap_lora`` and its neighbours) that need no
process group: wrapping (and what it refuses), the merge that weight sync and export send, and
the checkpoint's record of the base."""

from __future__ import annotations

import json
import types

import attrs
import pytest
import torch

from posttrain import CheckpointError, UserError
from posttrain.backend import (
    LORA_ADAPTER,
    LORA_RECORD,
    check_lora_record,
    is_lora_adapter_entry,
    lora_adapter_keys,
    lora_args,
    lora_layers,
    lora_plain_name,
    lora_record,
    merge_lora_weight,
    wrap_lora,
)
from posttrain.config.sections import LoraArgs, ModelArgs


def worker(preset: str = "preset:tiny-qwen3", **lora_kwargs):
    args = ModelArgs(model_name_or_path=preset, lora=LoraArgs(**lora_kwargs))
    return types.SimpleNamespace(
        role="actor_train",
        strategy_name="fsdp2_train",
        head="lm",
        model_args=args,
        world_size=1,
        seed=7,
    )


def check(w, path: str) -> None:
    check_lora_record(w, path, lora_args(w, "fsdp2_train"))


def hf_model(preset: str):
    from transformers import AutoModelForCausalLM

    from posttrain.tasks.presets import preset_path

    return AutoModelForCausalLM.from_pretrained(preset_path(preset))


def test_merge_equals_peft_merge_and_names_are_the_base_names():
    w = worker(rank=4, alpha=8.0, target_modules=["q_proj", "up_proj", "lm_head"])
    base_names = set(hf_model("preset:tiny-qwen3").state_dict())
    model = wrap_lora(w, hf_model("preset:tiny-qwen3"))
    layers = lora_layers(model)
    state = model.state_dict()
    torch.manual_seed(0)
    for layer in layers.values():  # trained adapters: B is no longer zero
        torch.nn.init.normal_(layer.lora_B[LORA_ADAPTER].weight)
    renamed = {lora_plain_name(n) for n in state if not is_lora_adapter_entry(n)}
    assert renamed == base_names
    for prefix, layer in layers.items():
        a_key, b_key = lora_adapter_keys(prefix)
        base = state[f"{prefix}.base_layer.weight"]
        got = merge_lora_weight(base, state[a_key], state[b_key], layer)
        want = base + layer.get_delta_weight(LORA_ADAPTER)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert not torch.equal(got, base)


def test_tied_output_layer_and_unknown_modules_are_refused():
    with pytest.raises(UserError, match="tied embeddings"):
        wrap_lora(
            worker("preset:tiny-qwen2", target_modules=["lm_head"]), hf_model("preset:tiny-qwen2")
        )
    with pytest.raises(UserError, match=r"linear modules: .*q_proj"):
        wrap_lora(worker(target_modules=["qproj"]), hf_model("preset:tiny-qwen3"))


def test_checkpoint_record_refuses_another_base_or_shape(tmp_path):
    saved = worker(rank=4)
    (tmp_path / LORA_RECORD).write_text(json.dumps(lora_record(saved)))
    check(saved, str(tmp_path))  # the same: accepted
    with pytest.raises(CheckpointError, match="base_model"):
        check(worker("preset:tiny-qwen2", rank=4), str(tmp_path))
    with pytest.raises(CheckpointError, match="lora"):
        check(worker(rank=8), str(tmp_path))
    full = attrs.evolve(saved.model_args, lora=None)
    with pytest.raises(CheckpointError, match=r"model_args\.lora is not set"):
        check(types.SimpleNamespace(**{**vars(saved), "model_args": full}), str(tmp_path))
    with pytest.raises(CheckpointError, match="full weights"):
        check(saved, str(tmp_path / "elsewhere"))


def test_an_exported_adapter_names_a_base_peft_can_load(tmp_path):
    from peft import AutoPeftModelForCausalLM

    from posttrain.backend import write_lora_adapter
    from posttrain.tasks.presets import preset_path

    w = types.SimpleNamespace(**vars(worker(rank=4, target_modules=["q_proj"])), base_dir=".")
    model = wrap_lora(w, hf_model("preset:tiny-qwen3"))
    torch.manual_seed(0)
    for layer in lora_layers(model).values():  # trained adapters: they change the logits
        torch.nn.init.normal_(layer.lora_B[LORA_ADAPTER].weight)
    adapters = {n: t for n, t in model.state_dict().items() if is_lora_adapter_entry(n)}
    write_lora_adapter(w, adapters, str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    # Not "preset:tiny-qwen3", which peft would look up on the hub.
    assert config["base_model_name_or_path"] == preset_path("preset:tiny-qwen3")
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, want)
        assert not torch.allclose(hf_model("preset:tiny-qwen3")(input_ids=ids).logits, want)
