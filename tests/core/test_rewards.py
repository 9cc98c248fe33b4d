"""Rule-based rewards and the resolution of ``reward.function``."""

from __future__ import annotations

import textwrap

import pytest

from posttrain.errors import UserError
from posttrain.rewards.functions import exact_match, numeric_match, resolve_reward_function

pytestmark = pytest.mark.quick  # README command 2: the quick subset, `pytest -m quick`


@pytest.fixture(scope="module")
def hook():
    from posttrain.host.plugin_host import create_plugin_host

    return create_plugin_host().hook


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("3", "3", 1.0),
        ("  3\n", "3 ", 1.0),
        ("3", 3, 1.0),
        ("03", "3", 0.0),
        ("3.0", "3", 0.0),
        ("the answer is 3", "3", 0.0),
        ("", "3", 0.0),
    ],
)
def test_exact_match(completion, answer, expected):
    assert exact_match(completion, answer) == expected
    assert exact_match(completion, answer, "1+2=", unused=1) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("7", "7", 1.0),
        ("so 3+4 = 7", "7", 1.0),  # the last number counts
        ("7 or maybe 8", "7", 0.0),
        ("the total is 1,234,567", "1234567", 1.0),
        ("1234567", "1,234,567", 1.0),
        ("it drops to -5", "-5", 1.0),
        ("it drops to -5", "5", 0.0),
        ("pi is 3.14", "3.140", 1.0),
        ("pi is 3.14", "3.15", 0.0),
        ("2.5", "2.50000001", 1.0),  # within the default tolerance
        ("2.5", "2.5001", 0.0),
        ("no number here", "3", 0.0),
        ("3", "three", 0.0),
        ("", "", 0.0),
    ],
)
def test_numeric_match(completion, answer, expected):
    assert numeric_match(completion, answer) == expected


def test_numeric_match_tolerance():
    assert numeric_match("2.5", "2.6") == 0.0
    assert numeric_match("2.5", "2.6", tolerance=0.2) == 1.0


def test_registered_names(hook):
    assert resolve_reward_function("exact_match", hook) is exact_match
    assert resolve_reward_function("numeric_match", hook) is numeric_match


def test_module_function_spec(tmp_path, monkeypatch, hook):
    (tmp_path / "my_reward_mod_xyz.py").write_text(
        textwrap.dedent(
            """
            def length_reward(completion, answer, prompt="", scale=1.0, **kwargs):
                return scale * len(completion)

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward_function("my_reward_mod_xyz:length_reward", hook)
    assert fn("abcd", "4", "p", scale=0.5) == 2.0
    with pytest.raises(UserError, match="'my_reward_mod_xyz:NOT_CALLABLE' is not a function"):
        resolve_reward_function("my_reward_mod_xyz:NOT_CALLABLE", hook)


def test_builtin_module_path_works(hook):
    assert (
        resolve_reward_function("posttrain.rewards.functions:numeric_match", hook) is numeric_match
    )


def test_missing_module(hook):
    with pytest.raises(UserError) as err:
        resolve_reward_function("no_such_module_abc123:fn", hook)
    assert "cannot import module 'no_such_module_abc123'" in str(err.value)
    assert "PYTHONPATH" in str(err.value)


def test_missing_function(hook):
    with pytest.raises(UserError, match=r"module 'posttrain\.rewards\.functions' has no 'nope'"):
        resolve_reward_function("posttrain.rewards.functions:nope", hook)


@pytest.mark.parametrize("spec", ["exact", "unknown_reward", ":fn", "module:", ""])
def test_malformed_spec(hook, spec):
    with pytest.raises(UserError) as err:
        resolve_reward_function(spec, hook)
    message = str(err.value)
    assert "module:function" in message
    assert "exact_match" in message and "numeric_match" in message  # lists registered names


def test_registered_plugin_reward(tmp_path, monkeypatch):
    from posttrain import hookimpl
    from posttrain.host.plugin_host import create_plugin_host

    (tmp_path / "plugin_reward_mod_xyz.py").write_text(
        "def always_half(completion, answer, prompt='', **kw):\n    return 0.5\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    class RewardPlugin:
        @hookimpl
        def posttrain_add_reward_functions(self):
            return {"always_half": "plugin_reward_mod_xyz:always_half"}

    host = create_plugin_host(extra_plugins=[RewardPlugin()])
    assert resolve_reward_function("always_half", host.hook)("x", "y") == 0.5
    assert resolve_reward_function("exact_match", host.hook) is exact_match


def test_duplicate_registered_name_is_error():
    from posttrain import hookimpl
    from posttrain.host.plugin_host import create_plugin_host

    class Duplicate:
        @hookimpl
        def posttrain_add_reward_functions(self):
            return {"exact_match": "posttrain.rewards.functions:numeric_match"}

    host = create_plugin_host(extra_plugins=[Duplicate()])
    with pytest.raises(UserError, match="declared by two plugins"):
        resolve_reward_function("exact_match", host.hook)
