"""The names and shapes a weight sync may carry: those of the rollout model's own checkpoint.

A trainer and a rollout engine of different versions can disagree on what a parameter is called
(an engine upgrade that renamed one) or on its shape. Before a verified bucket reaches the
engine, the receiving rank checks each tensor against the safetensors headers of the checkpoint
it loaded (headers only: no tensor is read); a name the model lacks or a shape that differs
stops the run at that sync (:func:`posttrain.weight_sync.verify.checked`), naming both versions:
what was sent and the model's closest weight of that shape.
"""

from __future__ import annotations

import difflib
import json
import os
import struct
from collections.abc import Iterable

# A tied output head is saved once, as the embedding; a trainer may still send it by name.
TIED_HEAD = ("lm_head.weight", "model.embed_tokens.weight")


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """Every tensor's shape in ``model_dir``'s ``*.safetensors`` files, by name; None where the
    directory holds none (a hub id, another format): nothing to check against."""
    if not os.path.isdir(model_dir):
        return None
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with open(os.path.join(model_dir, name), "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for key, entry in header.items():
            if key != "__metadata__":
                shapes[key] = tuple(entry["shape"])
    return shapes


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
            hint = f" (the model's closest weight of that shape: {closest[0]})" if closest else ""
            problems.append(f"sent {name} {list(shape)}, a name the model lacks{hint}")
        elif known != shape:
            problems.append(f"{name}: sent {list(shape)}, the model's is {list(known)}")
    return problems
