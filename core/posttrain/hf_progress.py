"""transformers' own progress bars, off around the calls that would draw them.

``from_pretrained`` draws "Loading weights" and ``save_pretrained`` "Writing model shards" (tqdm,
on stderr). posttrain prints its own progress; in the driver's console those bars are noise at the
run's start, and in rank logs (files) a stream of carriage returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def no_hf_progress_bars() -> Iterator[None]:
    """transformers' switch, restored after (a user's own HF_HUB_DISABLE_PROGRESS_BARS stays)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
