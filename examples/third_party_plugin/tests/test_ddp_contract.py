"""The conformance kit on ``ddp_train``: run with the plugin installed (``pip install
./examples/third_party_plugin``), ``pytest examples/third_party_plugin/tests``. Two ranks, so that
DDP's all-reduce, the replicas' exports and per-rank checkpoints are exercised."""

from posttrain.testing import StrategyContract


class TestDDPTrainContract(StrategyContract):
    strategy = "ddp_train"
    world_size = 2
