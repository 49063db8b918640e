"""The towers of the vision-language families whose images are a fixed size: Idefics3 (SmolVLM),
LLaVA 1.5 and Gemma 3, each mlx-vlm's modules cut into pieces (``pieces.py``): an image (or a
tile) at a time, its embeddings, each encoder layer, then the projector."""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .pieces import Piece, encoder_layer

__all__ = ["Gemma3", "Idefics3", "Llava"]


class Idefics3(nn.Module):
    """SigLIP tower and pixel-shuffle projector (Idefics3, SmolVLM): a layer of a tile at a time."""

    def __init__(self, arch: Any, config: Any) -> None:
        super().__init__()
        from mlx_vlm.models.idefics3.idefics3 import Idefics3Connector

        self.vision_model = arch.VisionModel(config.vision_config)
        self.connector = Idefics3Connector(config)
        self.patch = config.vision_config.patch_size

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return self.vision_model.sanitize(weights)

    def pieces(self, inputs: dict[str, Any]) -> list[Piece]:
        pixels = np.asarray(inputs["pixel_values"])[0]  # (tiles, C, H, W): every image's, in order
        masks = np.asarray(inputs["pixel_attention_mask"])[0]
        rows = [r for sample in inputs["rows"] for r in sample]
        cols = [c for sample in inputs["cols"] for c in sample]
        counts = [r * c + 1 if r or c else 1 for r, c in zip(rows, cols, strict=True)]  # the grid, the global view
        out, at = [], 0
        for image, tiles in enumerate(counts):
            for t in range(at, at + tiles):
                out += self._tile(image, pixels[t], masks[t])
            at += tiles
        return out

    def _tile(self, image: int, pixels: np.ndarray, mask: np.ndarray) -> list[Piece]:
        """A tile's pieces: its embeddings, each encoder layer, then the norm and projector (the
        tower's own call, cut at its layers)."""
        p, tower, hidden = self.patch, self.vision_model, {}
        h, w = mask.shape
        patches = mask[: h // p * p, : w // p * p].reshape(h // p, p, w // p, p).transpose(0, 2, 1, 3)
        patch_mask = mx.array(patches.sum(axis=(-1, -2)) > 0)[None]

        def embed() -> mx.array:
            x = mx.array(pixels, dtype=mx.float32).transpose(1, 2, 0)[None]
            hidden["x"] = tower.embeddings(x, patch_mask).astype(tower.embeddings.patch_embedding.weight.dtype)
            return hidden["x"]

        def project() -> mx.array:
            out = self.connector(tower.post_layernorm(hidden.pop("x")))
            return out.reshape(-1, out.shape[-1])

        tokens = (h // p) * (w // p)
        layers = [run for b in tower.encoder.layers
                  for run in encoder_layer(b, tokens, lambda: hidden["x"], partial(hidden.__setitem__, "x"))]  # fmt: skip
        return [Piece(image, embed, False), *(Piece(image, run, False) for run in layers), Piece(image, project)]


class Llava(nn.Module):
    """CLIP (or SigLIP) tower and two-layer projector (LLaVA 1.5): an image at a time, its chosen
    layer's patches (the class token dropped, by the ``default`` strategy)."""

    def __init__(self, arch: Any, config: Any) -> None:
        super().__init__()
        from mlx_vlm.models.llava.llava import LlavaMultiModalProjector

        self.vision_tower = arch.VisionModel(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.layer = config.vision_feature_layer
        self.default = config.vision_feature_select_strategy == "default"

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return self.vision_tower.sanitize(weights)

    def pieces(self, inputs: dict[str, Any]) -> list[Piece]:
        pixels = np.asarray(inputs["pixel_values"])  # (images, C, H, W)
        return [piece for i in range(len(pixels)) for piece in self._image(i, pixels[i])]

    def _image(self, image: int, pixels: np.ndarray) -> list[Piece]:
        """An image's pieces: its embeddings, each encoder layer up to the last one chosen (the
        layers after it never run), then the chosen layers' patches through the projector."""
        clip = self.vision_tower.vision_model
        blocks = clip.encoder.layers
        chosen = [k % (len(blocks) + 1) for k in ([self.layer] if isinstance(self.layer, int) else self.layer)]
        states: list[mx.array] = []  # the embeddings' output, then each layer's, as the tower's own call keeps them

        def embed() -> mx.array:
            x = clip.embeddings(mx.array(pixels, dtype=mx.float32).transpose(1, 2, 0)[None])
            states.append(clip.pre_layrnorm(x) if clip.config.model_type == "clip_vision_model" else x)
            return states[-1]

        def project() -> mx.array:
            picked = mx.concatenate([states[k][:, 1:] if self.default else states[k] for k in chosen], axis=-1)
            states.clear()
            out = self.multi_modal_projector(picked)
            return out.reshape(-1, out.shape[-1])

        tokens = clip.embeddings.num_positions  # the patches, and CLIP's class token
        layers = [run for b in blocks[:max(chosen)] for run in encoder_layer(b, tokens, lambda: states[-1], states.append)]
        return [Piece(image, embed, False), *(Piece(image, run, False) for run in layers), Piece(image, project)]


class Gemma3(nn.Module):
    """SigLIP tower, then the projector's average pool, norm and matrix (Gemma 3): an image at a
    time.  Its image tokens attend to each other both ways (``bidirectional``), and the language
    model reads them in place of ``<image_soft_token>``, which ``<start_of_image>`` expands to."""

    bidirectional = True

    @staticmethod
    def adapted(config: dict[str, Any]) -> dict[str, Any]:
        """transformers keeps the tokens an image becomes at the top, mlx-vlm in ``text_config``."""
        text = {"mm_tokens_per_image": config.get("mm_tokens_per_image", 256), **config["text_config"]}
        return {**config, "text_config": text}

    def __init__(self, arch: Any, config: Any) -> None:
        super().__init__()
        from mlx_vlm.models.gemma3.gemma3 import Gemma3MultiModalProjector

        self.vision_tower = arch.VisionModel(config.vision_config)
        vision = config.vision_config  # transformers' post-norm epsilon, not nn.LayerNorm's default
        self.vision_tower.vision_model.post_layernorm = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return self.vision_tower.sanitize(weights)

    @staticmethod
    def feature_token(processor: Any) -> tuple[str, int]:
        return str(processor.tokenizer.image_token), int(processor.tokenizer.image_token_id)

    def pieces(self, inputs: dict[str, Any]) -> list[Piece]:
        if any(np.asarray(inputs.get("num_crops", [0])).ravel()):
            raise ValueError("pan-and-scan crops are not read: the processor's do_pan_and_scan must be off")
        pixels = np.asarray(inputs["pixel_values"])  # (images, C, H, W)
        return [piece for i in range(len(pixels)) for piece in self._image(i, pixels[i])]

    def _image(self, image: int, pixels: np.ndarray) -> list[Piece]:
        siglip, hidden = self.vision_tower.vision_model, {}

        def embed() -> mx.array:
            hidden["x"] = siglip.embeddings(mx.array(pixels, dtype=mx.float32).transpose(1, 2, 0)[None])
            return hidden["x"]

        def project() -> mx.array:
            out = self.multi_modal_projector(siglip.post_layernorm(hidden.pop("x")))
            return out.reshape(-1, out.shape[-1])

        tokens = siglip.embeddings.num_positions
        layers = [run for b in siglip.encoder.layers
                  for run in encoder_layer(b, tokens, lambda: hidden["x"], partial(hidden.__setitem__, "x"))]  # fmt: skip
        return [Piece(image, embed, False), *(Piece(image, run, False) for run in layers), Piece(image, project)]
