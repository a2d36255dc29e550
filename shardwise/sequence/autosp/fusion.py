"""Fusion adapters: the vision-language boundary of a multimodal model under sequence parallelism.

The vision encoder leaves each rank with a slice of the visual tokens; the language model wants a
slice of the fused (text + visual) sequence. An adapter wraps the vision projection: it projects this
rank's visual tokens, gathers all of them (in rank order, slices of any lengths), splices them into
the text embeddings at the placeholder tokens of ``input_ids``, zero-pads the fused sequence to a
multiple of the group size ``N`` and returns this rank's ``1/N`` of it (rank ``r``: rows
``[r·L/N, (r+1)·L/N)`` of the padded length ``L``). Text embeddings and ``input_ids`` are whole on
every rank. Every step is differentiable: the projection and the visual tokens get the gradients of
every rank's fused slice, and each rank's text embeddings those of its own slice (summed over the
group, the whole sequence's).

How placeholders become visual tokens is the model's (``splice``):

* LLaVA: each image placeholder token is replaced by that image's visual tokens (the visual tokens
  are split evenly over the sample's placeholders), so the sequence grows;
* InternVL: each ``IMG_CONTEXT`` token is replaced by one visual token (same length);
* Qwen2-VL: the tokens between each vision-start / vision-end pair are replaced one for one.

Subclass ``ModalityFusionSPAdapter`` and define ``splice`` for another model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise import comm
from shardwise.sequence.autosp._gather import gather_sequence

LLAVA_IMAGE_TOKEN_ID = -200  # LLaVA's image placeholder


class ModalityFusionSPAdapter(torch.nn.Module):
    """``forward(visual_features [batch, local_visual, vit_hidden], text_embeds [batch, text_len, hidden],
    input_ids [batch, text_len])`` returns this rank's slice of the fused embeddings."""

    def __init__(self, projection: torch.nn.Module, process_group,
                 image_token_id: int = LLAVA_IMAGE_TOKEN_ID) -> None:
        super().__init__()
        self.projection = projection
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)
        self.image_token_id = image_token_id

    def forward(self, visual_features: torch.Tensor, text_embeds: torch.Tensor,
                input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape != text_embeds.shape[:2]:
            raise ValueError(f"{type(self).__name__}: input_ids {tuple(input_ids.shape)} do not match text_embeds "
                             f"{tuple(text_embeds.shape)} (expected [batch, text_len] and [batch, text_len, hidden])")
        visual, _ = gather_sequence(self.projection(visual_features), self.process_group, dim=1)
        fused = self.splice(text_embeds, visual, input_ids)
        n = self.world_size
        fused = F.pad(fused, (0, 0, 0, -fused.shape[1] % n))
        per_rank = fused.shape[1] // n
        rank = comm.get_rank(self.process_group)
        return fused[:, rank * per_rank:(rank + 1) * per_rank].contiguous()

    def splice(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
               input_ids: torch.Tensor) -> torch.Tensor:
        """The whole fused sequence ``[batch, fused_len, hidden]`` from the whole text and visual tokens."""
        raise NotImplementedError(f"{type(self).__name__} does not say where the visual tokens go: subclass "
                                  "ModalityFusionSPAdapter and define splice(text_embeds, visual_embeds, input_ids), "
                                  "or use LlavaFusionAdapter, InternVLFusionAdapter or Qwen2VLFusionAdapter")


def _replace_rows(name: str, text_embeds, visual_embeds, positions: list[torch.Tensor]) -> torch.Tensor:
    """Text embeddings with sample ``i``'s rows ``positions[i]`` replaced by its first visual tokens."""
    out = text_embeds.clone()
    for i, pos in enumerate(positions):
        if pos.numel() > visual_embeds.shape[1]:
            raise ValueError(f"{name}: sample {i} has {pos.numel()} visual placeholder tokens but only "
                             f"{visual_embeds.shape[1]} visual tokens arrived (from all ranks together)")
        if pos.numel():
            out[i, pos] = visual_embeds[i, :pos.numel()]
    return out


class LlavaFusionAdapter(ModalityFusionSPAdapter):
    """LLaVA: every ``image_token_id`` placeholder is replaced by its share of the sample's visual tokens.
    Samples of different fused lengths are zero-padded at the end to the longest."""

    def splice(self, text_embeds, visual_embeds, input_ids):
        samples = []
        for i in range(text_embeds.shape[0]):
            places = (input_ids[i] == self.image_token_id).nonzero().flatten().tolist()
            if not places:
                samples.append(text_embeds[i])
                continue
            if visual_embeds.shape[1] % len(places):
                raise ValueError(f"LlavaFusionAdapter: sample {i} has {len(places)} image placeholders "
                                 f"(token {self.image_token_id}) but {visual_embeds.shape[1]} visual tokens, "
                                 "which do not split evenly over them")
            images = visual_embeds[i].chunk(len(places))
            pieces, prev = [], 0
            for place, image in zip(places, images):
                pieces += [text_embeds[i, prev:place], image]
                prev = place + 1
            pieces.append(text_embeds[i, prev:])
            samples.append(torch.cat(pieces))
        longest = max(s.shape[0] for s in samples)
        return torch.stack([F.pad(s, (0, 0, 0, longest - s.shape[0])) for s in samples])


class InternVLFusionAdapter(ModalityFusionSPAdapter):
    """InternVL: each ``image_token_id`` (``IMG_CONTEXT``) token is replaced, in order, by one visual token;
    the sequence keeps its length. Extra visual tokens (a batch padded to its longest sample) are unused."""

    def splice(self, text_embeds, visual_embeds, input_ids):
        positions = [(ids == self.image_token_id).nonzero().flatten() for ids in input_ids]
        return _replace_rows("InternVLFusionAdapter", text_embeds, visual_embeds, positions)


class Qwen2VLFusionAdapter(ModalityFusionSPAdapter):
    """Qwen2-VL: the tokens strictly between each ``vision_start_token_id`` / ``vision_end_token_id`` pair
    are replaced, in order, by the visual tokens; the boundary tokens stay. The sequence keeps its length."""

    def __init__(self, projection: torch.nn.Module, process_group, vision_start_token_id: int,
                 vision_end_token_id: int) -> None:
        super().__init__(projection, process_group)
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id

    def splice(self, text_embeds, visual_embeds, input_ids):
        positions = []
        for i, ids in enumerate(input_ids):
            starts = (ids == self.vision_start_token_id).nonzero().flatten().tolist()
            ends = (ids == self.vision_end_token_id).nonzero().flatten().tolist()
            pairs = list(zip(starts, ends))
            if len(starts) != len(ends) or any(s >= e for s, e in pairs) \
                    or any(pairs[j][1] > pairs[j + 1][0] for j in range(len(pairs) - 1)):
                raise ValueError(f"Qwen2VLFusionAdapter: sample {i}'s vision start tokens {starts} and end tokens "
                                 f"{ends} (ids {self.vision_start_token_id}, {self.vision_end_token_id}) do not "
                                 "form ordered start/end pairs")
            inner = [p for s, e in pairs for p in range(s + 1, e)]
            positions.append(torch.tensor(inner, dtype=torch.long, device=text_embeds.device))
        return _replace_rows("Qwen2VLFusionAdapter", text_embeds, visual_embeds, positions)
