"""A model's vision tower: mlx-vlm's modules, transformers' image processor, on the model thread.

``Tower(path)`` reads ``vision/`` (``store/vision_import.py``): the source's config, and the
tower's and projector's weights, which it builds with mlx-vlm's classes for the family (mlx-vlm
is pinned by ``scripts/setup``).  The processor is transformers' own class for the directory,
with its PIL image processor (no torch, no torchvision): it sizes, splits and normalises the
images and says what each becomes in the prompt (``replace_image_token``).

An image is encoded in pieces (``Piece``: one layer of the tower for one tile, for the Idefics3
family, or for one image, for LLaVA; a wide layer in parts of at most ``PIECE_MACS``), so that the model thread can run one between two decode
steps, and a client that leaves stops the work within one piece.  The last piece of a tile (or
image) gives the projected features of its image tokens, in prompt order; the features of a
whole image are kept by its content's hash (``FeatureCache``), so an image sent again (the next
turn of a conversation) is not encoded again.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np

__all__ = ["FeatureCache", "Piece", "Prepared", "Tower", "digest"]


@attrs.frozen
class Piece:
    """One bounded piece of an image's encoding: ``run()`` gives what the model thread evaluates
    (a tile's hidden state after one more layer, or a part of one), and for a ``final`` piece the features of some
    of its image's tokens."""

    image: int  # which image of the request
    run: Callable[[], mx.array]
    final: bool = True


@attrs.frozen(eq=False)
class Prepared:
    """A request's images, processed: what each image token placeholder becomes in the prompt's
    text, each image's content hash, and the pieces that encode those not cached."""

    replacements: tuple[str, ...]
    hashes: tuple[str, ...]
    pieces: tuple[Piece, ...]
    cached: dict[int, mx.array]  # image -> its features, from the cache


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


#: The most work a piece of an encoder layer does, in multiply-adds (some 30 to 60 ms on two
#: cores): a layer that does more runs as the keys and values of all its tokens, then its tokens
#: in groups (their attention over every key, then the MLP). SigLIP's at 512 pixels (1,024 tokens,
#: width 768) is 7.6 billion: 9 pieces.
PIECE_MACS = 1e9


def _layer(block: Any, tokens: int, read: Callable[[], mx.array], write: Callable[[mx.array], None]) -> list[Callable[[], Any]]:
    """A pre-norm encoder layer (``layer_norm1``, ``self_attn``, ``layer_norm2``, ``mlp``: SigLIP's
    and CLIP's, as mlx-vlm builds them) over the ``tokens`` rows of the hidden state ``read()``
    gives, in parts of at most ``PIECE_MACS``; the last ``write``s the layer's output."""
    attn = block.self_attn
    ffn, width = block.mlp.fc1.weight.shape[:2]
    group = max(1, int(PIECE_MACS // (2 * width * width + 2 * tokens * width + 2 * width * ffn)))

    def whole() -> mx.array:
        out = block(read(), mask=None)
        write(out)
        return out

    if group >= tokens:
        return [whole]

    def heads(y: mx.array) -> mx.array:
        return y.reshape(*y.shape[:2], attn.num_heads, -1).transpose(0, 2, 1, 3)

    kv: list[mx.array] = []
    done: list[mx.array] = []

    def keys_values() -> list[mx.array]:
        y = block.layer_norm1(read())
        kv[:] = [heads(attn.k_proj(y)), heads(attn.v_proj(y))]
        return kv

    def rows(start: int, end: int) -> mx.array:
        x = read()[:, start:end]
        o = mx.fast.scaled_dot_product_attention(heads(attn.q_proj(block.layer_norm1(x))), kv[0], kv[1],
                                                 scale=attn.scale)  # fmt: skip
        h = x + attn.out_proj(o.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1))
        done.append(h + block.mlp(block.layer_norm2(h)))
        if end < tokens:
            return done[-1]
        out = mx.concatenate(done, axis=1)
        kv.clear()
        done.clear()
        write(out)
        return out

    return [keys_values, *(partial(rows, a, min(a + group, tokens)) for a in range(0, tokens, group))]


class _Idefics3(nn.Module):
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
                  for run in _layer(b, tokens, lambda: hidden["x"], partial(hidden.__setitem__, "x"))]  # fmt: skip
        return [Piece(image, embed, False), *(Piece(image, run, False) for run in layers), Piece(image, project)]


class _Llava(nn.Module):
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
        layers = [run for b in blocks[:max(chosen)] for run in _layer(b, tokens, lambda: states[-1], states.append)]
        return [Piece(image, embed, False), *(Piece(image, run, False) for run in layers), Piece(image, project)]


class _Gemma3(nn.Module):
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
                  for run in _layer(b, tokens, lambda: hidden["x"], partial(hidden.__setitem__, "x"))]  # fmt: skip
        return [Piece(image, embed, False), *(Piece(image, run, False) for run in layers), Piece(image, project)]


_FAMILIES: dict[str, Any] = {"idefics3": _Idefics3, "smolvlm": _Idefics3, "llava": _Llava, "gemma3": _Gemma3}


class Tower:
    """The vision side of a model in the store (its ``vision/`` directory)."""

    def __init__(self, path: Path, *, features: int = 8) -> None:
        from mlx_vlm.utils import update_module_configs
        import transformers

        config = json.loads((path / "vision" / "config.json").read_text())
        self.family = str(config["model_type"])
        config = getattr(_FAMILIES[self.family], "adapted", dict)(config)
        arch = importlib.import_module(f"mlx_vlm.models.{self.family}")
        model_config = arch.ModelConfig.from_dict(config)
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
        name = json.loads((path / "processor_config.json").read_text()).get("processor_class", "")
        processor_class = getattr(transformers, name, None)
        if processor_class is None:
            raise ValueError(f"the processor {name!r} of {path.name} is not one of transformers'")
        self.processor = processor_class.from_pretrained(path)
        self.image_token = str(self.processor.image_token)  # what the chat template writes for an image
        # the tokens the features take the place of: the same, or (Gemma 3) what it expands to
        self.feature_token, self.feature_token_id = getattr(self.module, "feature_token", _placeholder)(self.processor)
        self.bidirectional = bool(getattr(self.module, "bidirectional", False))
        self.features = FeatureCache(features)

    def _processed(self, images: Sequence[Any]) -> tuple[dict[str, Any], list[str]]:
        # the processor's own defaults for its images (Idefics3: the tiles' grid is returned)
        kwargs = self.processor._merge_kwargs(tokenizer_init_kwargs=self.processor.tokenizer.init_kwargs)["images_kwargs"]
        return self.processor._process_images([list(images)], **kwargs)

    def replacements(self, images: Sequence[Any]) -> list[str]:
        """What each image placeholder becomes in the prompt's text (no MLX: any thread)."""
        return self._processed(images)[1]

    def prepare(self, images: Sequence[Any], digests: Sequence[str]) -> Prepared:
        """Process ``images`` (PIL images, RGB) whose content hashes are ``digests``."""
        inputs, replacements = self._processed(images)
        cached = {i: f for i, d in enumerate(digests) if (f := self.features.get(d)) is not None}
        pieces = tuple(p for p in self.module.pieces(inputs) if p.image not in cached)
        return Prepared(tuple(replacements), tuple(digests), pieces, cached)


def _placeholder(processor: Any) -> tuple[str, int]:
    return str(processor.image_token), int(processor.image_token_id)


def digest(data: bytes) -> str:
    """An image's content hash (of its encoded bytes)."""
    return hashlib.sha256(data).hexdigest()
