"""Megatron plugin tests: real megatron-core over gloo on the CPU (mbridge for HF weights)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytest.importorskip("posttrain_megatron")
