"""Every preset's tokenizer encodes alike however it is loaded: through posttrain's
``load_tokenizer`` (what training uses), through transformers' ``AutoTokenizer`` (what a user of
an exported model uses, and what transformers 5 turns into a Qwen2Tokenizer for a qwen2 config),
from the preset's directory and from a directory written by ``save_pretrained`` as exports do."""

from __future__ import annotations

import shutil

import attrs
import pytest

from posttrain.backends.models import load_tokenizer
from posttrain.config.sections import ModelArgs
from posttrain.tasks import presets
from posttrain.tasks.warm_start import TOOL_TAGS

TEXTS = [" 3 + 4 =", "3+4=7", "12 * 34 = 408", "  7  ", "9-8 =1\n"]
TOOL_TEXT = f"{TOOL_TAGS[0]}12 * 3{TOOL_TAGS[1]}{TOOL_TAGS[2]}36{TOOL_TAGS[3]} 36"


def _loaded_both_ways(path):
    from transformers import AutoTokenizer

    return load_tokenizer(ModelArgs(model_name_or_path=str(path))), AutoTokenizer.from_pretrained(
        str(path)
    )


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_preset_and_exported_tokenizers_encode_as_training_does(name, tmp_path):
    # The warm start changes weights only: the tokenizer and config are built without it.
    preset = attrs.evolve(presets.PRESETS[name], warm_start=None)
    built = tmp_path / "preset"
    presets.build_preset(preset, str(built))
    training, _ = _loaded_both_ways(built)
    exported = tmp_path / "exported"
    exported.mkdir()
    shutil.copy(built / "config.json", exported / "config.json")
    training.save_pretrained(str(exported))  # as every backend's export-hf writes it
    texts = TEXTS + ([TOOL_TEXT] if preset.added_tokens else [])
    expected = [training(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert [len(ids) for ids in expected[:4]] == [len(t.replace("\n", "")) for t in texts[:4]]
    for directory in (built, exported):
        for tokenizer in _loaded_both_ways(directory):
            got = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            assert got == expected, (directory.name, type(tokenizer).__name__)
            assert [tokenizer.decode(ids) for ids in got] == [
                training.decode(ids) for ids in expected
            ]
