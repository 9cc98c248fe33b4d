"""The conformance kit against megatron_train (TP2, CP2) and megatron_infer (PP2), on
megatron-core.

TP2 loads the HF weights through mbridge; CP2 and PP2 through the plugin's own dense converter
(``use_mbridge: false``), so export, weight sync, checkpoints and log-prob parity run on both.
TP2 and PP2 score in chunks of 7 tokens (``logprob_chunk_tokens``), CP2 with the default (one
chunk per micro-batch of the kit's small batches).
The critic contract runs at TP2 (mbridge) and at PP2 (the dense converter; the value head on the
last stage only); a critic at CP2 runs the log-probs' gather, which the policy tests cover.
"""

import pytest

from posttrain.testing import StrategyContract

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


class TestMegatronTrainTP2Contract(StrategyContract):
    strategy = "megatron_train"
    # Log-probs from chunks of 7 tokens: several per micro-batch of the kit's batches.
    strategy_config = {"tensor_model_parallel_size": 2, "logprob_chunk_tokens": 7}
    world_size = 2


class TestMegatronTrainCP2Contract(StrategyContract):
    strategy = "megatron_train"
    strategy_config = {"context_parallel_size": 2, "use_mbridge": False}
    critic_strategy_config = {"pipeline_model_parallel_size": 2, "use_mbridge": False}
    world_size = 2


class TestMegatronInferPP2Contract(StrategyContract):
    strategy = "megatron_infer"
    # The last stage's copy of a tied output weight, in chunks of 7 tokens.
    strategy_config = {
        "pipeline_model_parallel_size": 2,
        "use_mbridge": False,
        "logprob_chunk_tokens": 7,
    }
    world_size = 2
