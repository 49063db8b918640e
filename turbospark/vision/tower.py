"""A model's vision tower: mlx-vlm's modules, transformers' image processor, on the model thread.

``Tower(path)`` reads ``vision/`` (``store/vision_import.py``): the source's config, and the
tower's and projector's weights, which it builds with mlx-vlm's classes for the family (mlx-vlm
is pinned by ``scripts/setup``; ``families.py``, ``qwen.py``).  The processor is transformers'
own class for the directory, with its PIL image processor (no torch, no torchvision): it sizes,
splits and normalises the images and says what each becomes in the prompt
(``replace_image_token``).  Where that class wants a video processor (torch and torchvision:
Qwen's, SmolVLM2's) or torchvision itself (Mistral 3's), the family brings its own
(``processor``): the PIL image processor, the tokenizer and the class's expansion.

An image is encoded in pieces (``pieces.Piece``: one layer of the tower for one tile, for the
Idefics3 family, or for one image, for the others; a wide layer in parts of at most
``PIECE_MACS``), so that the model thread can run one between two decode steps, and a client that
leaves stops the work within one piece.  The last piece of a tile (or image) gives the projected
features of its image tokens, in prompt order; the features of a whole image are kept by its
content's hash (``FeatureCache``), so an image sent again (the next turn of a conversation) is
not encoded again.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from .families import Gemma3, Idefics3, Llava
from .pieces import Piece, budget
from .pixtral import Mistral3
from .qwen import QwenVL, mrope_sections
from .smolvlm import SmolVLM

__all__ = ["FeatureCache", "Piece", "Prepared", "Tower", "digest"]


@attrs.frozen(eq=False)
class Prepared:
    """A request's images, processed: what each image token placeholder becomes in the prompt's
    text, each image's content hash, and the pieces that encode those not cached."""

    replacements: tuple[str, ...]
    hashes: tuple[str, ...]
    pieces: tuple[Piece, ...]
    cached: dict[int, mx.array]  # image -> its features, from the cache
    grids: tuple[tuple[int, int], ...] = ()  # each image's tokens as rows and columns (Qwen2-VL's RoPE)


class FeatureCache:
    """Images' features by content hash, the most recently used kept (a few images' worth)."""

    def __init__(self, entries: int = 8) -> None:
        self.entries = entries
        self._items: OrderedDict[str, mx.array] = OrderedDict()

    def get(self, key: str) -> mx.array | None:
        if (found := self._items.get(key)) is not None:
            self._items.move_to_end(key)
        return found

    def put(self, key: str, features: mx.array) -> None:
        self._items[key] = features
        self._items.move_to_end(key)
        while len(self._items) > self.entries:
            self._items.popitem(last=False)


_FAMILIES: dict[str, Any] = {"idefics3": Idefics3, "smolvlm": SmolVLM, "llava": Llava, "gemma3": Gemma3,
                             "qwen2_vl": QwenVL, "qwen2_5_vl": QwenVL, "mistral3": Mistral3}


class Tower:
    """The vision side of a model in the store (its ``vision/`` directory)."""

    def __init__(self, path: Path, *, features: int = 8) -> None:
        from mlx_vlm.utils import update_module_configs

        source = json.loads((path / "vision" / "config.json").read_text())
        self.family = str(source["model_type"])
        config = getattr(_FAMILIES[self.family], "adapted", dict)(source)
        arch = importlib.import_module(f"mlx_vlm.models.{self.family}")
        model_config = arch.ModelConfig.from_dict(dict(config))
        model_config = update_module_configs(model_config, arch, config, ["text", "vision", "perceiver", "projector"])
        self.module = _FAMILIES[self.family](arch, model_config)
        weights = self.module.sanitize(dict(mx.load(str(path / "vision" / "weights.safetensors"))))
        if any(k.endswith(".scales") for k in weights):  # a quantized tower (mlx-community)
            q = config.get("quantization") or {}
            nn.quantize(self.module, group_size=q.get("group_size", 64), bits=q.get("bits", 4),
                        class_predicate=lambda p, _m: f"{p}.scales" in weights)
        on_cpu = mx.default_device().type == mx.cpu  # MLX's CPU is slow in half precision
        weights = {k: v.astype(mx.float32) if on_cpu and mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in weights.items()}
        self.module.load_weights(list(weights.items()), strict=True)
        mx.eval(self.module.parameters())
        self.processor = getattr(self.module, "processor", _processor)(path)
        self.image_token = str(self.processor.image_token)  # what the chat template writes for an image
        # the tokens the features take the place of: the same, or (Gemma 3) what it expands to
        self.feature_token, self.feature_token_id = getattr(self.module, "feature_token", _placeholder)(self.processor)
        self.bidirectional = bool(getattr(self.module, "bidirectional", False))
        # the language model's RoPE sections for time, row and column (Qwen2-VL), or None
        self.sections = mrope_sections(source) if hasattr(self.module, "grids") else None
        self.features = FeatureCache(features)

    def _processed(self, images: Sequence[Any]) -> tuple[dict[str, Any], list[str]]:
        if hasattr(self.processor, "process"):
            return self.processor.process(list(images))
        # the processor's own defaults for its images (Idefics3: the tiles' grid is returned)
        kwargs = self.processor._merge_kwargs(tokenizer_init_kwargs=self.processor.tokenizer.init_kwargs)["images_kwargs"]
        return self.processor._process_images([list(images)], **kwargs)

    def replacements(self, images: Sequence[Any]) -> list[str]:
        """What each image placeholder becomes in the prompt's text (no MLX: any thread)."""
        return self._processed(images)[1]

    def processed(self, images: Sequence[Any]) -> tuple[dict[str, Any], list[str]]:
        """What the processor makes of ``images`` (PIL images, RGB) and what each image's
        placeholder becomes (no MLX: any thread)."""
        return self._processed(images)

    def prepare(self, processed: tuple[dict[str, Any], list[str]], digests: Sequence[str],
                macs: float | None = None) -> Prepared:
        """The pieces that encode the ``processed`` images whose content hashes are ``digests``
        (those not cached), of at most ``macs`` multiply-adds each (``PIECE_MACS`` without)."""
        inputs, replacements = processed
        cached = {i: f for i, d in enumerate(digests) if (f := self.features.get(d)) is not None}
        with budget(macs) if macs else nullcontext():
            pieces = tuple(p for p in self.module.pieces(inputs) if p.image not in cached)
        grids = tuple(self.module.grids(inputs)) if hasattr(self.module, "grids") else ()
        return Prepared(tuple(replacements), tuple(digests), pieces, cached, grids)


def _processor(path: Path) -> Any:
    """transformers' processor class that the directory names (its own PIL image processor)."""
    import transformers

    name = json.loads((path / "processor_config.json").read_text()).get("processor_class", "")
    processor_class = getattr(transformers, name, None)
    if processor_class is None:
        raise ValueError(f"the processor {name!r} of {path.name} is not one of transformers'")
    return processor_class.from_pretrained(path)


def _placeholder(processor: Any) -> tuple[str, int]:
    return str(processor.image_token), int(processor.image_token_id)


def digest(data: bytes) -> str:
    """An image's content hash (of its encoded bytes)."""
    return hashlib.sha256(data).hexdigest()
