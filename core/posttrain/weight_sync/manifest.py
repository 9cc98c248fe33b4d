"""The names and shapes a weight sync may carry: those the receiving engine takes.

A trainer and a rollout engine of different versions can disagree on what a parameter is called
(an engine upgrade that renamed one) or on its shape. Before a verified bucket reaches the
engine, the receiving rank checks each tensor against what the engine says it takes
(``posttrain_weight_shapes``); a name it lacks or a shape that differs stops the run at that
sync (:func:`posttrain.weight_sync.verify.checked`), naming both versions: what was sent and the
engine's closest weight of that shape.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# A tied output head is saved once, as the embedding; a trainer may still send it by name.
TIED_HEAD = ("lm_head.weight", "model.embed_tokens.weight")


def name_problems(
    sent: Iterable[tuple[str, tuple[int, ...]]], expected: dict[str, tuple[int, ...]]
) -> list[str]:
    """What of ``sent`` (name, shape) ``expected`` lacks or shapes otherwise, a line each."""
    problems = []
    for name, shape in sent:
        known = expected.get(name)
        if known is None and name == TIED_HEAD[0]:
            known = expected.get(TIED_HEAD[1])
        if known is None:
            same_shape = [n for n, s in expected.items() if s == shape]
            closest = difflib.get_close_matches(name, same_shape, n=1, cutoff=0.0)
            hint = f" (the engine's closest weight of that shape: {closest[0]})" if closest else ""
            problems.append(f"sent {name} {list(shape)}, a name the engine lacks{hint}")
        elif known != shape:
            problems.append(f"{name}: sent {list(shape)}, the engine's is {list(known)}")
    return problems
