"""Mistral 3's vision: the Pixtral tower, the patch merger and projector, and its processor.

The Pixtral tower reads an image at its own size (at most ``image_size`` a side) in patches, each
layer's attention rotated by the patch's row and column; the projector's RMSNorm, then each 2x2 of
patches merged into one token, then two matrices.  In the prompt an image is its rows of
``[IMG]`` tokens, each row ended by ``[IMG_BREAK]`` and the last by ``[IMG_END]``; the features
take the ``[IMG]`` tokens' places.  Pieces: the patches' embeddings, each layer (in parts of rows,
``PIECE_MACS``), the projector.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .pieces import Piece, layer_in_rows

__all__ = ["Mistral3", "PixtralProcessor"]


class PixtralProcessor:
    """transformers' Pixtral image processor (its PIL class), the directory's tokenizer, and what
    ``PixtralProcessor.replace_image_token`` writes for an image (that class needs torchvision)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer, PixtralImageProcessorPil

        settings = json.loads((path / "processor_config.json").read_text())
        self.images = PixtralImageProcessorPil.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.step = int(settings.get("patch_size", 16)) * int(settings.get("spatial_merge_size", 1))
        self.image_token = str(settings.get("image_token", "[IMG]"))
        self.row_end = str(settings.get("image_break_token", "[IMG_BREAK]"))
        self.end = str(settings.get("image_end_token", "[IMG_END]"))
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.image_token))

    def process(self, images: list[Any]) -> tuple[dict[str, Any], list[str]]:
        inputs = dict(self.images(images, patch_size=self.step, return_tensors="np"))
        replacements = []
        for height, width in np.asarray(inputs["image_sizes"]).tolist():
            tokens = ([self.image_token] * (width // self.step) + [self.row_end]) * (height // self.step)
            replacements.append("".join(tokens[:-1] + [self.end]))
        return inputs, replacements


class Mistral3(nn.Module):
    """The Pixtral tower and Mistral 3's projector (mlx-vlm's): an image at a time, every layer
    (Mistral 3 reads the last one's output)."""

    @staticmethod
    def adapted(config: dict[str, Any]) -> dict[str, Any]:
        """transformers 5 writes the tower's RoPE base in ``rope_parameters``, mlx-vlm reads
        ``rope_theta``."""
        vision = dict(config["vision_config"])
        if vision.get("hidden_act", "silu") != "silu":  # mlx-vlm's MLP is silu's, as Mistral's checkpoints are
            raise ValueError(f"a Pixtral tower whose MLP is {vision['hidden_act']!r} is not supported (silu only)")
        vision.setdefault("rope_theta", (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return {**config, "vision_config": vision}

    processor = PixtralProcessor

    def __init__(self, arch: Any, config: Any) -> None:
        super().__init__()
        from mlx_vlm.models.mistral3.mistral3 import Mistral3MultiModalProjector

        if config.vision_feature_layer not in (-1, config.vision_config.num_hidden_layers):
            raise ValueError(f"Mistral 3 reading layer {config.vision_feature_layer} of its tower is not supported")
        self.vision_tower = arch.VisionModel(config.vision_config)
        self.multi_modal_projector = Mistral3MultiModalProjector(config)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return self.vision_tower.sanitize(weights)

    def pieces(self, inputs: dict[str, Any]) -> list[Piece]:
        pixels = np.asarray(inputs["pixel_values"])  # (images, C, H, W), padded to the largest
        sizes = np.asarray(inputs["image_sizes"]).tolist()
        return [piece for i, size in enumerate(sizes) for piece in self._image(i, pixels[i], size)]

    def _image(self, image: int, pixels: np.ndarray, size: list[int]) -> list[Piece]:
        from mlx_vlm.models.pixtral.vision import rotate_half

        tower, hidden = self.vision_tower.vision_model, {}
        patch = tower.patch_size
        rows, cols = size[0] // patch, size[1] // patch
        across = tower.config.image_size // patch  # the RoPE table's width

        def embed() -> mx.array:
            x = mx.array(pixels[:, : rows * patch, : cols * patch]).transpose(1, 2, 0)[None]
            x = tower.patch_conv(x.astype(tower.patch_conv.weight.dtype))
            hidden["x"] = tower.ln_pre(x.reshape(rows * cols, -1))
            at = mx.array((np.arange(rows)[:, None] * across + np.arange(cols)[None, :]).ravel())
            hidden["rope"] = tower.patch_positional_embedding(hidden["x"], at)  # (cos, sin), each (patches, dim)
            return hidden["x"]

        def project() -> mx.array:
            out = self.multi_modal_projector(hidden.pop("x"), [size])
            hidden.clear()
            return out

        def layer(block: Any) -> list[Any]:
            attn = block.attention
            width = attn.o_proj.weight.shape[0]

            def whole() -> mx.array:
                hidden["x"] = block(hidden["x"][None], position_embeddings=hidden["rope"])[0]
                return hidden["x"]

            def qkv(x: mx.array, a: int, b: int) -> mx.array:
                y = block.attention_norm(x)
                cos, sin = (c[a:b, None] for c in hidden["rope"])
                q, k, v = (p(y).reshape(b - a, attn.num_heads, -1) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
                return mx.stack([q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v])

            def finish(x: mx.array, o: mx.array) -> mx.array:
                x = x + attn.o_proj(o)
                return x + block.feed_forward(block.ffn_norm(x))

            ffn = block.feed_forward.gate_proj.weight.shape[0]
            return layer_in_rows(hidden, [rows * cols], whole=whole, project=qkv, finish=finish, scale=attn.scale,
                                 project_macs=3 * width * width,
                                 row_macs=width * width + 2 * rows * cols * width + 3 * width * ffn)  # fmt: skip

        layers = [run for block in tower.transformer.layers for run in layer(block)]
        return [Piece(image, embed, False), *(Piece(image, run, False) for run in layers), Piece(image, project)]
