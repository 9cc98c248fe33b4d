"""The fault kit's language (posttrain.testing.faults): what a user writes in POSTTRAIN_FAULTS
is read as written, and a typo is an error naming the entry and the kinds."""

from __future__ import annotations

import pytest

from posttrain.testing.faults import Fault, parse_faults


def test_faults_are_read_with_their_options():
    faults = parse_faults("kill_rank:5/rank=1, delay_train:2/seconds=0.5,flip_saved_byte:3")
    assert faults == [
        Fault("kill_rank", 5, {"rank": "1"}),
        Fault("delay_train", 2, {"seconds": "0.5"}),
        Fault("flip_saved_byte", 3, {}),
    ]
    assert faults[0].rank() == 1 and faults[1].rank() == 0
    assert parse_faults("") == []


@pytest.mark.parametrize("entry", ["kill_rnak:5", "kill_rank", "kill_rank:0", "kill_rank:x"])
def test_a_malformed_fault_names_the_entry_and_the_kinds(entry):
    with pytest.raises(ValueError, match=f"entry '{entry}': expected KIND:N .* kill_rank"):
        parse_faults(entry)


def test_a_kill_names_its_phase_and_a_wrong_phase_is_an_error():
    (fault,) = parse_faults("kill_rank:2/rank=1/phase=sync/role=actor_infer/after_s=0.1")
    assert fault.options == {"rank": "1", "phase": "sync", "role": "actor_infer", "after_s": "0.1"}
    with pytest.raises(ValueError, match="phase 'gen' is not one of train, generate, sync, save"):
        parse_faults("kill_rank:2/phase=gen")
