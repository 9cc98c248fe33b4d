"""``hf_infer``'s decode of vision-language models (Qwen2-VL style): the dynamic cache, the
prefill fed each prompt's images (the driver's :class:`~posttrain.ImageInputs`, as they came)
and the multimodal rotary positions the model's own ``get_rope_index`` computes from them; each
decode step's positions go on from the last by one, in all three rotary sections, as text
tokens after the images do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from posttrain.backend import image_forward_inputs, image_tensors, shown_token
from posttrain_hf_infer.decode_loop import DynamicDecode, left_padded

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from posttrain import ImageInputs


class VisionDecode(DynamicDecode):
    """:class:`DynamicDecode` whose prefill carries the images of its prompts. ``images`` maps
    each prompt list (by identity: prompts with the same ids may show different images) to its
    images, or None for a prompt without."""

    def __init__(
        self,
        model: PreTrainedModel,
        pad_id: int,
        device: torch.device | str,
        images: dict[int, ImageInputs | None],
    ) -> None:
        super().__init__(model, pad_id, device)
        self.images = images

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        from transformers import DynamicCache

        input_ids, self.attention = left_padded(prompts, len(prompts), self.pad_id, self.device)
        self.cache = {self.cache_argument: DynamicCache(config=self.model.config)}
        shown = [self.images[id(p)] for p in prompts]
        extra: dict[str, torch.Tensor] = {}
        if any(image is not None for image in shown):
            padded = image_tensors(shown)
            extra = image_forward_inputs(
                input_ids.cpu(),
                padded["pixel_values"],
                padded["image_grid_thw"],
                self.model.config,
            )
            extra = {k: v.to(self.device) for k, v in extra.items()}
            input_ids = extra.pop("input_ids")
        token_types = extra.get("mm_token_type_ids", torch.zeros_like(input_ids).int())
        self.position, _ = self.model.model.get_rope_index(
            input_ids,
            mm_token_type_ids=token_types,
            image_grid_thw=extra.get("image_grid_thw"),
            attention_mask=self.attention,
        )
        return self._forward(input_ids, **extra)

    def step(self, token: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        # [3, rows, 1]: each rotary section's next position.
        self.position = self.position[..., -1:] + 1
        self.attention = torch.cat([self.attention, running.long().unsqueeze(-1)], dim=-1)
        config = self.model.config
        # A sampled image placeholder is fed as the trainer feeds it (it shows no image).
        fed = torch.where(
            token == config.image_token_id, shown_token(config.image_token_id, config), token
        )
        return self._forward(fed.unsqueeze(-1))
