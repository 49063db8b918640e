"""Qwen2-VL's and Qwen2.5-VL's towers, their processor, and where their image tokens sit in RoPE.

The tower reads an image of any size as a grid of patches (two frames of each: an image is
repeated in time), each layer's attention rotated by the patch's row and column; Qwen2.5-VL's
layers attend within windows of the image but for a few over all of it.  The merger joins each
2x2 of patches into one token.  Pieces: the patches' embeddings, each layer (in parts of rows,
``PIECE_MACS``), the merger.

The language model's RoPE is multimodal (``mrope_positions``): a text token's position is one
number, an image token's three (the image's start, then its row and column beside it), and the
text after an image goes on from the image's start plus its longest side, so a prompt's last
position is below its length.  Its frequencies are split in three sections, each rotated by one
of the three numbers; for text, all three are the same, and that is plain RoPE.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .pieces import Piece, layer_in_rows

__all__ = ["MRoPE", "QwenProcessor", "QwenVL", "mrope_positions", "mrope_sections", "windows"]


class QwenProcessor:
    """transformers' Qwen2-VL image processor (its PIL class) and the directory's tokenizer.  The
    processor classes of transformers want a video processor, whose class needs torchvision."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        self.images = Qwen2VLImageProcessorPil.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.image_token = str(getattr(self.tokenizer, "image_token", None) or "<|image_pad|>")
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.image_token))

    def process(self, images: list[Any]) -> tuple[dict[str, Any], list[str]]:
        """The images' patches and grids, and what each image's placeholder becomes."""
        inputs = dict(self.images(images, return_tensors="np"))
        merge = self.images.merge_size**2
        return inputs, [self.image_token * int(np.prod(g) // merge) for g in inputs["image_grid_thw"]]


def windows(rows: int, cols: int, size: int) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5-VL's windows over an image of ``rows`` x ``cols`` tokens (2x2 patches each), of
    ``size`` x ``size`` tokens: the tokens in window order, and each window's token count."""
    index = np.arange(rows * cols).reshape(rows, cols)
    ph, pw = -rows % size, -cols % size
    padded = np.pad(index, ((0, ph), (0, pw)), constant_values=-1)
    tiles = padded.reshape((rows + ph) // size, size, (cols + pw) // size, size).transpose(0, 2, 1, 3)
    tiles = tiles.reshape(-1, size * size)
    order = tiles[tiles >= 0]
    counts = [int(n) for n in (tiles >= 0).sum(axis=1) if n]
    return order, counts


def mrope_positions(length: int, at: np.ndarray, grids: list[tuple[int, int]]) -> np.ndarray:
    """Each prompt position's three RoPE positions (3, ``length``): ``at`` holds the image tokens'
    positions, the images' in turn, each image ``grids[i]`` tokens (rows, columns) in row order."""
    out = np.zeros((3, length), dtype=np.int64)
    start = pos = k = 0
    for rows, cols in grids:
        first = int(at[k])
        out[:, start:first] = np.arange(first - start) + pos  # the text before it
        pos += first - start
        r, c = np.divmod(np.arange(rows * cols), cols)
        out[0, first:first + rows * cols] = pos
        out[1, first:first + rows * cols] = pos + r
        out[2, first:first + rows * cols] = pos + c
        pos += max(rows, cols)
        start, k = first + rows * cols, k + rows * cols
    out[:, start:] = np.arange(length - start) + pos
    return out


def mrope_sections(config: dict[str, Any]) -> list[int]:
    """How the language model's RoPE frequencies split among time, row and column, from the
    model's config (transformers 5's ``rope_parameters``, or ``rope_scaling``; at the top, or in
    ``text_config``)."""
    for where in (config.get("text_config") or {}, config):
        for key in ("rope_parameters", "rope_scaling"):
            if isinstance(rope := where.get(key), dict) and "mrope_section" in rope:
                return [int(s) for s in rope["mrope_section"]]
    raise ValueError(f"{config.get('model_type')} config.json says nothing of mrope_section")


class MRoPE(nn.Module):
    """The language model's RoPE for a prompt chunk whose positions are ``positions`` (3, n), in
    place of ``rope`` (an ``nn.RoPE``, not traditional) for that chunk: frequencies split by
    ``sections``, each section rotated by its position's row."""

    def __init__(self, rope: Any, sections: list[int], positions: np.ndarray) -> None:
        super().__init__()
        dims, base = rope.dims, rope.base
        inv = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims) * rope.scale
        which = np.repeat(np.arange(len(sections)) % 3, sections)[: dims // 2]
        angles = positions[which].T * inv  # (n, dims / 2)
        self._cos = mx.array(np.cos(np.concatenate([angles, angles], axis=-1)), dtype=mx.float32)
        self._sin = mx.array(np.sin(np.concatenate([angles, angles], axis=-1)), dtype=mx.float32)

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        half = x.shape[-1] // 2
        turned = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return (x * self._cos + turned * self._sin).astype(x.dtype)


class QwenVL(nn.Module):
    """Qwen2-VL's (or Qwen2.5-VL's) vision tower and merger, mlx-vlm's: an image at a time."""

    @staticmethod
    def adapted(config: dict[str, Any]) -> dict[str, Any]:
        """The tower's config as mlx-vlm reads it (its vision model checks the family's name; the
        language model's is not read)."""
        return {**config, "vision_config": {**config["vision_config"], "model_type": config["model_type"]},
                "text_config": None}

    processor = QwenProcessor

    def __init__(self, arch: Any, config: Any) -> None:
        super().__init__()
        self.vision_tower = arch.VisionModel(config.vision_config)
        vision = config.vision_config
        self.merge = vision.spatial_merge_size
        # Qwen2.5-VL: windows of this many tokens a side, but in the layers listed
        self.window = vision.window_size // vision.patch_size // self.merge if hasattr(vision, "window_size") else 0
        self.full = set(getattr(vision, "fullatt_block_indexes", ()))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return self.vision_tower.sanitize(weights)

    def grids(self, inputs: dict[str, Any]) -> list[tuple[int, int]]:
        return [(int(h) // self.merge, int(w) // self.merge) for _t, h, w in np.asarray(inputs["image_grid_thw"])]

    def pieces(self, inputs: dict[str, Any]) -> list[Piece]:
        pixels, out, at = np.asarray(inputs["pixel_values"]), [], 0
        for image, (t, h, w) in enumerate(np.asarray(inputs["image_grid_thw"]).tolist()):
            out += self._image(image, pixels[at:at + t * h * w], (t, h, w))
            at += t * h * w
        return out

    def _image(self, image: int, pixels: np.ndarray, grid: tuple[int, int, int]) -> list[Piece]:
        tower, unit, hidden = self.vision_tower, self.merge**2, {}
        t, h, w = grid
        n = t * h * w
        if self.window:
            order, counts = windows(h // self.merge, w // self.merge, self.window)
            rows = (order[:, None] * unit + np.arange(unit)).ravel()  # the patches in window order
            spans = [c * unit for c in counts]
        else:
            rows, spans = np.arange(n), [n]

        def embed() -> mx.array:
            x = tower.patch_embed(mx.array(pixels).astype(tower.patch_embed.proj.weight.dtype))
            index = mx.array(rows)
            hidden["rope"] = tower.rot_pos_emb(mx.array([list(grid)]))[index]
            hidden["x"] = x[index]
            return hidden["x"]

        def merged() -> mx.array:
            out = tower.merger(hidden.pop("x"))
            hidden.clear()
            return out[mx.array(np.argsort(rows[::unit] // unit))] if self.window else out

        layers = []
        for i, block in enumerate(tower.blocks):
            segments = [n] if not self.window or i in self.full else spans
            layers += _layer(block, segments, hidden)
        return [Piece(image, embed, False), *(Piece(image, run, False) for run in layers), Piece(image, merged)]


def _layer(block: Any, segments: list[int], hidden: dict[str, Any]) -> list[Any]:
    """A Qwen vision layer over ``hidden["x"]``, its rows attending within ``segments``, whole or
    in parts (``layer_in_rows``)."""
    from mlx_vlm.models.qwen2_vl.vision import apply_rotary_pos_emb_vision

    attn = block.attn
    width = attn.proj.weight.shape[0]
    mlp = sum(p.size for k, p in tree_flatten(block.mlp.parameters()) if k.endswith("weight"))  # its MACs a row

    def whole() -> mx.array:
        hidden["x"] = block(hidden["x"], cu_seqlens=mx.array(np.cumsum([0, *segments])), rotary_pos_emb=hidden["rope"])
        return hidden["x"]

    def project(x: mx.array, a: int, b: int) -> mx.array:
        q, k, v = attn.qkv(block.norm1(x)).reshape(b - a, 3, attn.num_heads, -1).transpose(1, 0, 2, 3)
        rope = hidden["rope"][a:b]
        return mx.stack([apply_rotary_pos_emb_vision(q[None], rope)[0], apply_rotary_pos_emb_vision(k[None], rope)[0], v])

    def finish(x: mx.array, o: mx.array) -> mx.array:
        x = x + attn.proj(o)
        return x + block.mlp(block.norm2(x))

    return layer_in_rows(hidden, segments, whole=whole, project=project, finish=finish, scale=attn.scale,
                         project_macs=3 * width * width, row_macs=width * width + 2 * max(segments) * width + mlp)
