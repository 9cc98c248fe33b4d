"""A reward for evaluation tests that tells responses apart: a fingerprint of the text, so
that two evaluations score alike only when they sampled the same responses."""

from __future__ import annotations

import zlib


def fingerprint(response: str, answer: str, prompt: str, **kwargs) -> float:
    return zlib.crc32(f"{prompt}|{response}".encode()) / 2**32
