"""The conformance kit against the reference strategy, hf_infer."""

import pytest

from posttrain.testing import StrategyContract

pytestmark = pytest.mark.quick  # README command 2: the quick subset, `pytest -m quick`


class TestHFInferContract(StrategyContract):
    strategy = "hf_infer"
    supports_checkpoint = True
