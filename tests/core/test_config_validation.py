"""Workflow validation: YAML problems, typos, types, ROLL compatibility and cross-field checks,
all reported at once with their YAML paths."""

from __future__ import annotations

import types
import typing
from typing import Literal

import attrs
import pytest

from posttrain import hookimpl
from posttrain.config.converter import structure_into
from posttrain.config.ranges import OutOfRange, at_least, between, range_of
from posttrain.config.report import ErrorReport
from posttrain.config.sections import ModelArgs, TrainingArgs
from posttrain.host.strategy import Capabilities, StrategySpec
from posttrain.loading.workflow import build_workflow, load_workflow

pytestmark = pytest.mark.quick  # README command 2: the quick subset, `pytest -m quick`

CONTRACT_FAKE_TRAIN = "contract_fake_train"  # declared by conftest's fake plugin


def _errors(report: ErrorReport) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for issue in report.errors:
        out.setdefault(issue.path, []).append(issue.render())
    return out


def _valid_raw(model: str, *, train: str = CONTRACT_FAKE_TRAIN) -> dict:
    """A minimal valid GRPO workflow (synthetic data, fake trainer, hf_infer rollout)."""
    return {
        "model_args": {"model_name_or_path": model},
        "data": {"synthetic": {"task": "single_digit_addition"}},
        "algorithm": {"name": "grpo", "group_size": 4, "rollout_batch_size": 8},
        "actor_train": {
            "strategy_args": {"strategy_name": train},
            "device_mapping": [0, 1],
            "training_args": {"learning_rate": 1.0e-6},
        },
        "actor_infer": {"strategy_args": {"strategy_name": "hf_infer"}, "device_mapping": [0, 1]},
        "trainer": {"max_steps": 2},
    }


def _build(raw, host, tmp_path):
    return build_workflow(raw, host, ErrorReport(), base_dir=str(tmp_path))


def test_minimal_workflow_is_valid(fake_train_host, model_dir, tmp_path):
    workflow, report = _build(_valid_raw(str(model_dir)), fake_train_host, tmp_path)
    assert report.errors == []
    assert workflow.actor_train.strategy_args.strategy_config.tensor_model_parallel_size == 1
    assert workflow.actor_infer.strategy_args.strategy_config.batch_size == 64
    assert workflow.algorithm.group_size == 4


# -- YAML-level problems ------------------------------------------------------------------------


def test_duplicate_keys_rejected_with_line_numbers(fake_train_host, write_workflow):
    path = write_workflow(
        """\
        trainer:
          max_steps: 3
          max_steps: 4
        algorithm: {name: grpo}
        algorithm: {name: grpo}
        """
    )
    _, report = load_workflow(path, fake_train_host)
    dups = [i.message for i in report.errors if "duplicate key" in i.message]
    assert dups == ["duplicate key 'max_steps' at line 3", "duplicate key 'algorithm' at line 5"]


def test_invalid_yaml_is_one_clean_error(fake_train_host, write_workflow):
    path = write_workflow("trainer: {max_steps: 3\n  oops: [\n")
    workflow, report = load_workflow(path, fake_train_host)
    assert workflow is None
    assert len(report.errors) == 1
    message = report.errors[0].message
    assert message.startswith("invalid YAML at line 2")
    assert "Traceback" not in message


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("", "the file is empty or holds only comments"),
        ("# model_args: {}\n\n", "the file is empty or holds only comments"),
        ("{}\n", "the file holds an empty mapping"),
        ("- a\n- b\n", "the file holds a list, not a mapping of sections"),
        ("just text\n", "the file holds the value 'just text', not a mapping of sections"),
    ],
)
def test_a_file_with_no_workflow_says_so(fake_train_host, write_workflow, text, found):
    workflow, report = load_workflow(write_workflow(text), fake_train_host)
    assert workflow is None
    (issue,) = report.errors
    assert issue.message == f"no workflow: {found}"
    assert "examples/quickstart.yaml" in issue.hint


def test_missing_workflow_file_is_a_user_error(fake_train_host, tmp_path):
    from posttrain.errors import UserError

    with pytest.raises(UserError, match="workflow file not found"):
        load_workflow(str(tmp_path / "nope.yaml"), fake_train_host)


def test_unknown_section_suggests_the_close_one(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["trainr"] = raw.pop("trainer")
    _, report = _build(raw, fake_train_host, tmp_path)
    assert _errors(report) == {"trainr": ["trainr: unknown section (did you mean 'trainer'?)"]}


def test_every_error_is_reported_at_once(fake_train_host, model_dir, write_workflow):
    path = write_workflow(
        f"""\
        model_args: {{model_name_or_path: {model_dir}, dtyp: bf16}}
        data: {{synthetic: {{task: single_digit_addition}}}}
        algorithm: {{name: grpo, group_size: 4, rollout_batch_size: 8, kl_estimator: k4}}
        actor_train:
          strategy_args:
            strategy_name: {CONTRACT_FAKE_TRAIN}
            strategy_config: {{micro_batch_sise: 2}}
          device_mapping: [0, 1]
          training_args: {{learning_rate: fast}}
        actor_infer:
          strategy_args: {{strategy_name: hf_infr}}
          device_mapping: [0, 0]
        trainer: {{max_steps: ten, save_step: 5}}
        clustr: {{launcher: local}}
        """
    )
    _, report = load_workflow(path, fake_train_host)
    errors = _errors(report)
    assert sorted(errors) == [
        "actor_infer.device_mapping",
        "actor_infer.strategy_args.strategy_name",
        "actor_train.strategy_args.strategy_config.micro_batch_sise",
        "actor_train.training_args.learning_rate",
        "algorithm.kl_estimator",
        "clustr",
        "model_args.dtyp",
        "trainer.max_steps",
        "trainer.save_step",
    ]
    assert len(report.errors) == 9  # each problem once: the top-level typo is not repeated per role
    text = "\n".join(i.render() for i in report.errors)
    assert "did you mean 'micro_batch_size'?" in text
    assert "did you mean 'hf_infer'?" in text
    assert "did you mean 'save_steps'?" in text
    assert "did you mean 'cluster'?" in text
    assert "did you mean 'dtype'?" in text
    assert "expected one of: k1, k3" in text
    assert "expected an integer, got str 'ten'" in text


def test_wrong_types_are_named(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["trainer"] = {"max_steps": "ten", "progress": "yes", "logger": "console"}
    raw["algorithm"]["clip_ratio"] = True
    raw["actor_train"] = "fsdp"
    _, report = _build(raw, fake_train_host, tmp_path)
    errors = _errors(report)
    assert errors["trainer.max_steps"] == ["trainer.max_steps: expected an integer, got str 'ten'"]
    assert errors["trainer.progress"] == ["trainer.progress: expected true or false, got str 'yes'"]
    assert "trainer.logger" in errors
    assert errors["algorithm.clip_ratio"] == [
        "algorithm.clip_ratio: expected a number, got bool True"
    ]
    assert errors["actor_train"] == ["actor_train: expected a mapping, got str 'fsdp'"]
    # The role that failed to structure is not reported a second time as missing.
    assert len(report.errors) == 5


def test_required_key_is_reported(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["actor_infer"]["strategy_args"] = {"strategy_config": {}}
    _, report = _build(raw, fake_train_host, tmp_path)
    assert _errors(report) == {
        "actor_infer.strategy_args.strategy_name": [
            "actor_infer.strategy_args.strategy_name: required key is missing"
        ]
    }


def test_unknown_strategy_names_the_provider(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir), train="megatron_train")
    _, report = _build(raw, fake_train_host, tmp_path)
    (issue,) = report.errors
    assert issue.path == "actor_train.strategy_args.strategy_name"
    assert issue.message == "unknown strategy 'megatron_train'"
    assert "posttrain-megatron" in issue.hint
    assert "hf_infer" in issue.hint and CONTRACT_FAKE_TRAIN in issue.hint


# -- ROLL compatibility -------------------------------------------------------------------------


def _installed_train_strategies():
    from posttrain.host.plugin_host import create_plugin_host

    try:
        return set(create_plugin_host().strategies())
    except Exception:  # a conflict among installed plugins is another test's business
        return set()


ROLL_WORKFLOW = """\
model_args:
  model_name_or_path: {model}
  dtype: bf16
  disable_gradient_checkpointing: true
data: {{synthetic: {{task: single_digit_addition}}}}
algorithm: {{name: grpo, group_size: 8, rollout_batch_size: 16}}
actor_train:
  model_args:
    disable_gradient_checkpointing: false
    dtype: fp32
    model_type: qwen2
  training_args:
    learning_rate: 1e-6
    weight_decay: 0
    per_device_train_batch_size: 1
    gradient_accumulation_steps: 32
    warmup_steps: 20
    num_train_epochs: 50
    max_steps: 500
  strategy_args:
    strategy_name: {train}
    strategy_config: {{}}
  device_mapping: list(range(0,8))
  infer_batch_size: 4
actor_infer:
  model_args:
    disable_gradient_checkpointing: true
  strategy_args:
    strategy_name: hf_infer
    strategy_config: {{batch_size: 16}}
  device_mapping: list(range(0,8))
  infer_batch_size: 16
trainer: {{max_steps: 500}}
"""


@pytest.mark.parametrize("train", [CONTRACT_FAKE_TRAIN, "fsdp2_train"])
def test_roll_role_block_validates(
    train, model_dir, write_workflow, monkeypatch, contract_fake_train_plugin
):
    from posttrain.host.plugin_host import create_plugin_host

    if train == CONTRACT_FAKE_TRAIN:
        monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
        host = create_plugin_host(extra_plugins=[contract_fake_train_plugin])
    else:
        if train not in _installed_train_strategies():
            pytest.skip(f"{train} is not installed")
        host = create_plugin_host()
    path = write_workflow(ROLL_WORKFLOW.format(model=model_dir, train=train))
    workflow, report = load_workflow(path, host)
    assert report.errors == []

    train_role, infer_role = workflow.actor_train, workflow.actor_infer
    assert train_role.training_args == TrainingArgs(
        learning_rate=1e-6,
        weight_decay=0.0,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=32,
        warmup_steps=20,
        num_train_epochs=50,
        max_steps=500,
    )
    assert isinstance(train_role.training_args.learning_rate, float)
    # Top-level model_args are defaults; the role's own values win.
    assert train_role.model_args == ModelArgs(
        model_name_or_path=str(model_dir),
        dtype="fp32",
        disable_gradient_checkpointing=False,
        model_type="qwen2",
    )
    assert infer_role.model_args == ModelArgs(
        model_name_or_path=str(model_dir), dtype="bf16", disable_gradient_checkpointing=True
    )
    assert workflow.model_args.dtype == "bf16"
    assert train_role.device_mapping == tuple(range(8))
    assert (train_role.infer_batch_size, infer_role.infer_batch_size) == (4, 16)
    assert infer_role.strategy_args.strategy_config.batch_size == 16


def test_role_without_model_args_inherits_all(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["model_args"].update(dtype="bf16", trust_remote_code=True)
    workflow, report = _build(raw, fake_train_host, tmp_path)
    assert report.errors == []
    for role in (workflow.actor_train, workflow.actor_infer):
        assert role.model_args == ModelArgs(
            model_name_or_path=str(model_dir), dtype="bf16", trust_remote_code=True
        )


# -- cross-field checks -------------------------------------------------------------------------


def test_grpo_needs_actor_infer(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    del raw["actor_infer"]
    _, report = _build(raw, fake_train_host, tmp_path)
    assert list(_errors(report)) == ["actor_infer"]
    assert "algorithm 'grpo' needs the 'actor_infer' role" in report.errors[0].message


def test_ppo_needs_critic(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["algorithm"]["name"] = "ppo"
    _, report = _build(raw, fake_train_host, tmp_path)
    assert list(_errors(report)) == ["critic"]
    raw["critic"] = {"strategy_args": {"strategy_name": CONTRACT_FAKE_TRAIN}, "device_mapping": [0]}
    _, report = _build(raw, fake_train_host, tmp_path)
    assert report.errors == []


def test_kl_needs_reference(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["algorithm"]["kl_coef"] = 0.01
    _, report = _build(raw, fake_train_host, tmp_path)
    assert list(_errors(report)) == ["reference"]
    assert "kl_coef" in report.errors[0].message
    raw["reference"] = {"strategy_args": {"strategy_name": "hf_infer"}, "device_mapping": [0]}
    _, report = _build(raw, fake_train_host, tmp_path)
    assert report.errors == []


def test_a_training_strategy_is_refused_as_reference_with_the_fix(
    fake_train_host, model_dir, tmp_path
):
    """A scoring role runs frozen: a trainer there (which would need training_args and an
    optimizer it never steps) is refused before any process starts, naming what fits."""
    raw = _valid_raw(str(model_dir))
    raw["algorithm"]["kl_coef"] = 0.01
    raw["reference"] = {
        "strategy_args": {"strategy_name": CONTRACT_FAKE_TRAIN},
        "device_mapping": [0],
    }
    _, report = _build(raw, fake_train_host, tmp_path)
    errors = _errors(report)
    assert list(errors) == ["reference.strategy_args.strategy_name"]
    text = errors["reference.strategy_args.strategy_name"][0]
    assert "is a train strategy; reference needs one of kind infer or rollout" in text
    assert "hf_infer" in text


@pytest.mark.parametrize(
    ("devices", "tp", "rollout_batch_size", "group_size", "bad_paths"),
    [
        (8, 2, 8, 4, []),  # dp 4; 32 samples
        (8, 2, 3, 2, ["algorithm.rollout_batch_size"]),  # 6 samples over dp 4
        (8, 8, 3, 2, []),  # dp 1
        (6, 4, 8, 4, ["actor_train.device_mapping"]),  # 6 devices, tp 4
        (4, 1, 2, 3, ["algorithm.rollout_batch_size"]),  # 6 samples over dp 4
    ],
)
def test_batch_and_parallel_sizes_must_divide(
    fake_train_host, model_dir, tmp_path, devices, tp, rollout_batch_size, group_size, bad_paths
):
    raw = _valid_raw(str(model_dir))
    raw["algorithm"].update(rollout_batch_size=rollout_batch_size, group_size=group_size)
    raw["actor_train"]["device_mapping"] = f"list(range(0, {devices}))"
    raw["actor_train"]["strategy_args"]["strategy_config"] = {"tensor_model_parallel_size": tp}
    raw["actor_infer"]["device_mapping"] = [0]
    _, report = _build(raw, fake_train_host, tmp_path)
    assert sorted(_errors(report)) == bad_paths
    if bad_paths == ["actor_train.device_mapping"]:
        assert "tensor_model_parallel_size=4" in report.errors[0].message


def test_every_infer_rank_needs_a_prompt(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["algorithm"].update(rollout_batch_size=3, group_size=4)
    raw["actor_train"]["device_mapping"] = [0, 1]
    raw["actor_infer"]["device_mapping"] = [0, 1, 2, 3]
    _, report = _build(raw, fake_train_host, tmp_path)
    (issue,) = report.errors
    assert issue.path == "algorithm.rollout_batch_size"
    assert "actor_infer's 4 data-parallel ranks without a prompt" in issue.message
    raw["algorithm"].update(rollout_batch_size=6)  # shares of 2, 2, 1, 1 prompts
    _, report = _build(raw, fake_train_host, tmp_path)
    assert report.errors == []


def test_stop_strings_are_typed_and_never_empty(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["actor_infer"]["generating_args"] = {"stop_strings": ["\n\n", "</answer>"]}
    workflow, report = _build(raw, fake_train_host, tmp_path)
    assert report.errors == []
    assert workflow.actor_infer.generating_args.stop_strings == ["\n\n", "</answer>"]
    raw["actor_infer"]["generating_args"] = {"stop_strings": ["</answer>", ""]}
    _, report = _build(raw, fake_train_host, tmp_path)
    (issue,) = report.errors
    assert issue.path == "actor_infer.generating_args.stop_strings"
    assert "empty string" in issue.message


class _NoStopStringsRollout:
    """A fake rollout strategy that does not declare stop-string support."""

    @hookimpl
    def posttrain_add_strategies(self):
        return [
            StrategySpec(
                name="no_stop_rollout",
                config_class=_EmptyConfig,
                capabilities=Capabilities(kind="rollout"),
            )
        ]


@attrs.frozen(kw_only=True)
class _EmptyConfig:
    pass


def test_stop_strings_need_a_strategy_that_supports_them(
    monkeypatch, contract_fake_train_plugin, model_dir, tmp_path
):
    from posttrain.host.plugin_host import create_plugin_host

    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    host = create_plugin_host(extra_plugins=[contract_fake_train_plugin, _NoStopStringsRollout()])
    raw = _valid_raw(str(model_dir))
    raw["actor_infer"]["strategy_args"] = {"strategy_name": "no_stop_rollout"}
    _, report = _build(raw, host, tmp_path)
    assert report.errors == []
    raw["actor_infer"]["generating_args"] = {"stop_strings": ["</answer>"]}
    _, report = _build(raw, host, tmp_path)
    (issue,) = report.errors
    assert issue.path == "actor_infer.generating_args.stop_strings"
    assert "'no_stop_rollout' does not support stop strings" in issue.message


def test_missing_local_model_dir(fake_train_host, tmp_path):
    raw = _valid_raw("./models/missing")
    _, report = _build(raw, fake_train_host, tmp_path)
    errors = _errors(report)
    assert sorted(errors) == [
        "actor_infer.model_args.model_name_or_path",
        "actor_train.model_args.model_name_or_path",
    ]
    assert "does not exist" in errors["actor_train.model_args.model_name_or_path"][0]


def test_dir_without_config_json(fake_train_host, tmp_path):
    (tmp_path / "empty_model").mkdir()
    _, report = _build(_valid_raw(str(tmp_path / "empty_model")), fake_train_host, tmp_path)
    assert all("has no config.json" in i.message for i in report.errors)
    assert len(report.errors) == 2


def test_hub_id_is_a_note_not_an_error(fake_train_host, tmp_path):
    _, report = _build(_valid_raw("Qwen/Qwen2.5-0.5B-Instruct"), fake_train_host, tmp_path)
    assert report.errors == []
    notes = [n for n in report.notes if n.path.endswith("model_name_or_path")]
    assert len(notes) == 2
    assert all("hub id" in n.message and "skipped" in n.message for n in notes)


def test_missing_data_file(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["data"] = {"path": "data/missing.jsonl"}
    _, report = _build(raw, fake_train_host, tmp_path)
    (issue,) = report.errors
    assert issue.path == "data.path"
    assert issue.message == f"file not found: {tmp_path / 'data/missing.jsonl'}"
    (tmp_path / "data").mkdir()
    (tmp_path / "data/missing.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    _, report = _build(raw, fake_train_host, tmp_path)
    assert report.errors == []


def test_section_with_errors_gets_no_follow_up_errors(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["data"] = {"path": "x.jsonl", "shufle": True}  # typo: data fails to structure
    _, report = _build(raw, fake_train_host, tmp_path)
    assert _errors(report) == {
        "data.shufle": ["data.shufle: unknown key (did you mean 'shuffle'?)"]
    }


# -- ranges of counts, sizes and rates ----------------------------------------------------------


def test_out_of_range_values_are_all_reported_with_paths(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["algorithm"].update(group_size=0, rollout_batch_size=-8, clip_ratio=0)
    raw["actor_train"]["training_args"].update(per_device_train_batch_size=0, learning_rate=-1e-6)
    raw["actor_infer"].update(
        infer_batch_size=0,
        generating_args={"top_p": 1.5, "temperature": -0.5, "max_new_tokens": 0},
        strategy_args={"strategy_name": "hf_infer", "strategy_config": {"batch_size": 0}},
    )
    raw["trainer"].update(max_steps=0, save_steps=-1, weight_sync_bucket_mb=0)
    raw["cluster"] = {"call_timeout_s": 0}
    _, report = _build(raw, fake_train_host, tmp_path)
    errors = _errors(report)
    assert sorted(errors) == [
        "actor_infer.generating_args.max_new_tokens",
        "actor_infer.generating_args.temperature",
        "actor_infer.generating_args.top_p",
        "actor_infer.infer_batch_size",
        "actor_infer.strategy_args.strategy_config.batch_size",
        "actor_train.training_args.learning_rate",
        "actor_train.training_args.per_device_train_batch_size",
        "algorithm.clip_ratio",
        "algorithm.group_size",
        "algorithm.rollout_batch_size",
        "cluster.call_timeout_s",
        "trainer.max_steps",
        "trainer.save_steps",
        "trainer.weight_sync_bucket_mb",
    ]
    # The value as written, what is allowed, and a value that surely is.
    assert errors["algorithm.group_size"] == [
        "algorithm.group_size: 0 is out of range; allowed: >= 1 (e.g. 8, the default)"
    ]
    assert errors["actor_infer.generating_args.top_p"] == [
        "actor_infer.generating_args.top_p: 1.5 is out of range; allowed: in (0, 1] "
        "(e.g. 1.0, the default)"
    ]
    assert errors["actor_infer.infer_batch_size"] == [
        "actor_infer.infer_batch_size: 0 is out of range; allowed: >= 1 (or null, the default)"
    ]
    assert "or 0 (only at the end" in errors["trainer.save_steps"][0]


def test_meaningful_zero_and_minus_one_stay_valid(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["actor_train"]["training_args"].update(max_steps=-1, max_grad_norm=0, warmup_steps=0)
    raw["actor_infer"]["generating_args"] = {"top_k": -1, "temperature": 0}
    raw["trainer"]["save_steps"] = 0
    workflow, report = _build(raw, fake_train_host, tmp_path)
    assert report.errors == []
    assert workflow.trainer.save_steps == 0
    raw["actor_infer"]["generating_args"] = {"top_k": 0}
    assert _build(raw, fake_train_host, tmp_path)[1].errors == []


@attrs.frozen(kw_only=True)
class _RangedPluginConfig:
    """A plugin's strategy_config using the core's range helpers."""

    tp_size: int = attrs.field(default=1, validator=at_least(1))
    fraction: float | None = attrs.field(default=None, validator=between(0, 1, low_open=True))
    mode: Literal["eager", "graph"] | None = None
    level: Literal[1, 2] = 1


def test_plugin_configs_get_ranges_and_choices_from_the_same_helpers():
    report = ErrorReport()
    raw = {"tp_size": 0, "fraction": 0, "mode": "eagre", "level": True}
    assert structure_into(raw, _RangedPluginConfig, "cfg", report) is None
    assert [i.render() for i in report.errors] == [
        "cfg.tp_size: 0 is out of range; allowed: >= 1 (e.g. 1, the default)",
        "cfg.fraction: 0 is out of range; allowed: in (0, 1] (or null, the default)",
        "cfg.mode: invalid value 'eagre'; expected one of: eager, graph, or null "
        "(did you mean 'eager'?)",
        "cfg.level: invalid value true; expected one of: 1, 2",  # true is not 1
    ]
    # Built in Python, the same range is the attrs validator.
    with pytest.raises(OutOfRange, match=r"tp_size: -1 is out of range; allowed: >= 1"):
        _RangedPluginConfig(tp_size=-1)


def _numeric(tp) -> bool:
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    options = typing.get_args(tp) if union else (tp,)
    return bool({int, float} & set(options))


def test_every_number_in_the_workflow_declares_its_range():
    """A new count or size gets its range by one annotation; this keeps anyone from forgetting
    it, in core sections and in the installed strategies' configs alike."""
    from posttrain.config_reference import _walk
    from posttrain.errors import PluginError
    from posttrain.host.plugin_host import create_plugin_host
    from posttrain_hf_infer.plugin import HFInferConfig

    classes = {*_walk(), HFInferConfig}
    try:
        classes |= {spec.config_class for spec in create_plugin_host().strategies().values()}
    except PluginError as exc:  # two installed plugins claim one strategy: not this test's case
        pytest.skip(str(exc))
    missing = [
        f"{cls.__module__}.{cls.__name__}.{field.name}"
        for cls in classes
        for field in attrs.fields(cls)
        if _numeric(typing.get_type_hints(cls)[field.name])
        and range_of(field) is None
        and not field.name.endswith("seed")  # any integer seeds a generator
    ]
    assert missing == [], "give these a validator from posttrain.config.ranges"


def test_async_rollout_needs_its_own_devices_and_a_correction(fake_train_host, model_dir, tmp_path):
    raw = _valid_raw(str(model_dir))
    raw["algorithm"]["max_staleness"] = 1
    raw["algorithm"]["old_logprobs"] = "recompute"
    _, report = _build(raw, fake_train_host, tmp_path)
    errors = _errors(report)
    (message,) = errors["actor_infer.device_mapping"]
    assert "shares devices [0, 1] with actor_train" in message
    assert "algorithm.max_staleness: 0" in message
    (message,) = errors["algorithm.tis_cap"]
    assert "set algorithm.tis_cap (e.g. 2.0)" in message

    # One update per batch: the ratio's old policy is the one that sampled; or a correction.
    del raw["algorithm"]["old_logprobs"]
    _, report = _build(raw, fake_train_host, tmp_path)
    assert "algorithm.tis_cap" not in _errors(report)
    raw["algorithm"]["old_logprobs"] = "recompute"
    raw["algorithm"]["tis_cap"] = 2.0

    raw["actor_train"]["device_mapping"] = [0]
    raw["actor_infer"]["device_mapping"] = [1]
    _, report = _build(raw, fake_train_host, tmp_path)
    assert report.errors == []
    assert raw["algorithm"]["max_staleness"] == 1


def test_logprob_chunk_tokens_zero_is_off_and_negative_is_an_error(
    fake_train_host, model_dir, tmp_path
):
    raw = _valid_raw(str(model_dir))
    infer = {"strategy_name": "hf_infer", "strategy_config": {"logprob_chunk_tokens": 0}}
    raw["actor_infer"]["strategy_args"] = infer
    workflow, report = _build(raw, fake_train_host, tmp_path)
    assert report.errors == []
    assert workflow.actor_infer.strategy_args.strategy_config.logprob_chunk_tokens == 0
    infer["strategy_config"] = {"logprob_chunk_tokens": -4}
    errors = _errors(_build(raw, fake_train_host, tmp_path)[1])
    assert errors == {
        "actor_infer.strategy_args.strategy_config.logprob_chunk_tokens": [
            "actor_infer.strategy_args.strategy_config.logprob_chunk_tokens: -4 is out of range; "
            "allowed: >= 1, or 0 (off: full logits) (e.g. 1024, the default)"
        ]
    }
