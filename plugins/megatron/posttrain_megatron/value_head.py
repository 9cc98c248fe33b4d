"""The critic's model: a megatron ``GPTModel`` whose last stage ends in a value head.

The value head is ``Linear(hidden, 1, bias=False)`` in place of the vocabulary output layer
(mbridge's ``make_value_model`` callback, as verl builds its megatron critic). It keeps the name
``output_layer`` so that ``GPTModel`` calls it where it would compute logits: called without
labels, the model returns ``[b, s, 1]`` float32 values. Only the last pipeline stage (the last
virtual stage with VPP) has it; every tensor-parallel rank holds the whole head (the hidden
states it reads are replicated over TP; with sequence parallelism mbridge's layer gathers its
output over the sequence and marks the weight so that its gradient is summed over TP).

In HF terms the head is ``score.weight`` (``*ForTokenClassification`` with one label and no
bias): :class:`ValueHeadNames` maps ``output_layer.weight`` to it both ways, without the vocab
padding mbridge applies to an output layer, and loads zeros when the checkpoint has no head,
so a megatron critic starts where an HF one does (``posttrain.load_model_with_head``).
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING

import torch
from mbridge.core.safetensor_io import SafeTensorIO
from mbridge.utils.post_creation_callbacks import make_value_model

from posttrain.backend import HEAD_WEIGHT

if TYPE_CHECKING:
    from mbridge.core.bridge import Bridge
    from transformers import PretrainedConfig
else:
    # Mixed into the critic's mbridge bridge (make_bridge); to mypy a subclass of mbridge's
    # Bridge (untyped: Any), whose methods and attributes it uses.
    Bridge = object

log = logging.getLogger(__name__)

# The head's megatron name (global and local: it is outside the decoder layers).
OUTPUT_LAYER = "output_layer.weight"


def bridge_hf_config(hf_config: PretrainedConfig) -> PretrainedConfig:
    """The HF config the critic's bridge builds from: untied, since the head replaces the output
    layer that a tied model shares with the embedding (megatron would otherwise feed the
    embedding matrix to the head and all-reduce their gradients across pipeline stages)."""
    config = copy.deepcopy(hf_config)
    config.tie_word_embeddings = False
    return config


def export_config(hf_config: PretrainedConfig) -> PretrainedConfig:
    """The config of an exported critic: loadable by ``AutoModelForTokenClassification`` as the
    value model it is (one label, no bias, no dropout), as the HF backends save theirs."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    config = copy.deepcopy(hf_config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.token_classification_bias = False
    architecture = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    if architecture is not None:
        config.architectures = [architecture]
    return config


# mbridge ``get_model`` callbacks that put the value head on the last stage.
MODEL_CREATION_CALLBACKS = (make_value_model,)


class ValueHeadNames(Bridge):
    """Mixed into the critic's bridge (:func:`posttrain_megatron.bridge.make_bridge`)."""

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        if mcore_weights_name == OUTPUT_LAYER:
            return [HEAD_WEIGHT]
        return super()._weight_name_mapping_mcore_to_hf(mcore_weights_name)

    def _weight_to_hf_format(
        self, mcore_weights_name: str, mcore_weights: torch.Tensor
    ) -> tuple[list[str], list[torch.Tensor]]:
        if mcore_weights_name == OUTPUT_LAYER:  # [1, hidden]: no vocabulary padding to cut
            return [HEAD_WEIGHT], [mcore_weights]
        return super()._weight_to_hf_format(mcore_weights_name, mcore_weights)

    def _weight_to_mcore_format(
        self, mcore_weights_name: str, hf_weights: list[torch.Tensor]
    ) -> torch.Tensor:
        if mcore_weights_name == OUTPUT_LAYER:
            return hf_weights[0].to(self.dtype)
        return super()._weight_to_mcore_format(mcore_weights_name, hf_weights)

    def _get_safetensor_io(self, weights_path: str) -> SafeTensorIO:
        return _HeadOrZeros(self._get_actual_hf_path(weights_path), self.hf_config.hidden_size)


class _HeadOrZeros(SafeTensorIO):
    """HF weights where a missing ``score.weight`` reads as zeros (a policy checkpoint)."""

    def __init__(self, hf_dir: str, hidden_size: int):
        super().__init__(hf_dir)
        self.hidden_size = hidden_size
        self.has_head = HEAD_WEIGHT in self.load_hf_weight_names()

    def load_some_hf_weight(self, hf_weight_names: list[str]) -> dict[str, torch.Tensor]:
        if self.has_head or HEAD_WEIGHT not in hf_weight_names:
            return super().load_some_hf_weight(hf_weight_names)
        log.info("megatron: %s has no %s; the value head starts at zero", self.hf_dir, HEAD_WEIGHT)
        out = super().load_some_hf_weight([n for n in hf_weight_names if n != HEAD_WEIGHT])
        out[HEAD_WEIGHT] = torch.zeros(1, self.hidden_size)
        return out
