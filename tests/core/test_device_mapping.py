"""`device_mapping`: lists and `list(range(...))` text parse; anything else is refused, unrun."""

from __future__ import annotations

import builtins

import pytest

from posttrain.config.device_mapping import (
    MAX_DEVICE_INDEX,
    DeviceMappingError,
    parse_device_mapping,
)
from posttrain.config.report import ErrorReport
from posttrain.loading.workflow import build_workflow

pytestmark = pytest.mark.quick  # README command 2: the quick subset, `pytest -m quick`


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([0, 1, 2, 3], (0, 1, 2, 3)),
        ((3, 1), (3, 1)),
        ([5], (5,)),
        ("list(range(0, 8))", (0, 1, 2, 3, 4, 5, 6, 7)),
        ("list(range(0,8))", (0, 1, 2, 3, 4, 5, 6, 7)),
        ("list(range(4))", (0, 1, 2, 3)),
        ("list(range(0, 8, 2))", (0, 2, 4, 6)),
        ("  list( range( 2 , 5 ) )  ", (2, 3, 4)),
        ("list(range(8, 16))", tuple(range(8, 16))),
    ],
)
def test_accepted_forms(value, expected):
    assert parse_device_mapping(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "__import__('os').system('echo hi')",
        "[i for i in range(3)]",
        "list(range(0, 10**9))",
        "list(range(0, 1000000000))",
        "list(range(-1, 3))",
        "list(range(0, 8, 0))",
        "list(range(0, 8, -1))",
        "list(range(3, 1))",  # empty
        "range(0, 8)",
        "list(range(0, 8)); print(1)",
        "list(range(0x0, 8))",
        "[0, 1]",  # a list written as text is not a list
        "",
        [],
        [-1, 0],
        [0, 1, 1],
        [True, False],
        [0, True],
        [0, 1.0],
        ["0", "1"],
        [MAX_DEVICE_INDEX + 1],
        None,
        3,
        {"a": 1},
    ],
)
def test_rejected_forms(value):
    with pytest.raises(DeviceMappingError):
        parse_device_mapping(value)


def test_messages_say_what_is_wrong():
    with pytest.raises(DeviceMappingError, match="repeat"):
        parse_device_mapping([0, 1, 0])
    with pytest.raises(DeviceMappingError, match="not a non-negative integer"):
        parse_device_mapping([0, -2])
    with pytest.raises(DeviceMappingError, match="True is not"):
        parse_device_mapping([True])
    with pytest.raises(DeviceMappingError, match="not of the form"):
        parse_device_mapping("[i for i in range(3)]")


def test_code_in_the_text_is_never_executed(tmp_path, monkeypatch):
    marker = tmp_path / "PWNED"
    payloads = [
        f"__import__('os').system('touch {marker}')",
        f"list(range(0, 8)) if open('{marker}', 'w') else 0",
        f"list(range(0, __import__('pathlib').Path('{marker}').touch() or 8))",
    ]

    # Any call of eval/exec/compile while parsing would fail the test.
    def forbidden(*args, **kwargs):
        raise AssertionError("device_mapping must be parsed without eval/exec/compile")

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, forbidden)
    for payload in payloads:
        with pytest.raises(DeviceMappingError):
            parse_device_mapping(payload)
    # The accepted form still parses with eval/exec/compile unavailable.
    assert parse_device_mapping("list(range(0, 4))") == (0, 1, 2, 3)
    monkeypatch.undo()
    assert not marker.exists()


def test_workflow_reports_bad_mapping_with_its_path(fake_train_host, tmp_path):
    marker = tmp_path / "PWNED"
    raw = {
        "actor_infer": {
            "strategy_args": {"strategy_name": "hf_infer"},
            "device_mapping": f"__import__('os').system('touch {marker}')",
        },
        "reference": {
            "strategy_args": {"strategy_name": "hf_infer"},
            "device_mapping": [0, 0],
        },
    }
    report = ErrorReport()
    build_workflow(raw, fake_train_host, report, base_dir=str(tmp_path))
    paths = {issue.path: issue for issue in report.errors}
    assert "actor_infer.device_mapping" in paths
    assert "reference.device_mapping" in paths
    assert "list(range(0, 8))" in paths["actor_infer.device_mapping"].hint
    assert "repeat" in paths["reference.device_mapping"].hint
    assert not marker.exists()


def test_parsed_mapping_sets_rank_count(fake_train_host, tmp_path):
    raw = {
        "actor_infer": {
            "strategy_args": {"strategy_name": "hf_infer"},
            "device_mapping": "list(range(0, 8, 2))",
        }
    }
    workflow, _ = build_workflow(raw, fake_train_host, ErrorReport(), base_dir=str(tmp_path))
    assert workflow.actor_infer.device_mapping == (0, 2, 4, 6)
    assert workflow.actor_infer.num_ranks == 4
