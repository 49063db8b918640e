"""Images read on the model thread between decode steps, then decoded in the same batch as text.

A request with images (a vision model's, ``vision/tower.py``) is seen in two places:

- ``VisionSide.see`` (when the job is prepared): each image is decoded and processed, which says
  what each image placeholder of the rendered prompt becomes (``Seen.expand``) and which bounded
  pieces encode it.  ``Seen.keyed`` then marks every image token of the prompt's ids with its
  image's content hash: that is the prompt as the prefix cache knows it, so two prompts that
  differ only in an image share no KV past it, and the same image again is a hit.
- ``VisionSide.advance`` (once a step, before the engine's): one piece of one waiting request's
  work, in arrival order: one layer of the tower over one tile (or a part of a wide one), or one
  chunk of its prompt (the token embeddings with the image features in place of the image tokens)
  through the language model into a KV cache of its own.  Gemma 3's image tokens attend to each
  other both ways (``_bidirectional``), so its chunks never cut an image's tokens apart; Qwen2-VL's
  chunks are read at their multimodal RoPE positions (``_rotated``, ``Seen._place``).  When all
  but the last token are in, the sequence joins the engine with that cache, as a prefix-cache
  hit does, and decodes beside the others.  A client that leaves is ``drop``-ped at the next
  crossing: its work stops within one piece.

The language model is the backend's own (one copy of the weights, its fused layers included).
A piece that raises fails its own sequence only (``StepOutput.failed``).
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..errors import RequestInvalid
from ..vision import pieces as _pieces
from ..vision.qwen import MRoPE, mrope_positions
from ..vision.tower import Prepared, Tower, digest
from .backend import PrefillProgress, SamplingParams
from .mlx_fused import Outside

__all__ = ["Expander", "Seen", "VisionSide", "vision_side"]

log = logging.getLogger(__name__)

#: The share of the streams' usual gap a piece of a tower may take while they decode.
PIECE_SHARE = 0.75
#: Requests' images processed ahead and not yet seen on the model thread, at most.
AHEAD = 4


def vision_side(path: Path, backend: Any) -> VisionSide | None:
    """The vision side of the model at ``path``, if it has a tower (``vision/``) and mlx-vlm is
    installed (``scripts/setup``); without mlx-vlm it serves text alone, and says so."""
    if not (path / "vision").is_dir():
        return None
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        log.warning("model %s: its vision tower needs mlx-vlm (scripts/setup installs it); "
                    "it reads text only", backend.model_id)
        backend.kernels += "; its vision tower: not loaded (mlx-vlm is not installed)"
        return None
    side = VisionSide(path, backend)
    backend.kernels += f"; its vision tower ({side.tower.family}): mlx-vlm's modules on MLX's own ops"
    return side


@attrs.define(eq=False)
class Expander:
    """Rewrites the template's own text: each image placeholder becomes what its image is read
    into (``replacements``, in order); ``used`` counts those placed."""

    token: str
    replacements: Sequence[str]
    used: int = 0

    def __call__(self, text: str) -> str:
        head, *rest = text.split(self.token)
        out = [head]
        for part in rest:
            if self.used >= len(self.replacements):
                raise RequestInvalid("the chat template wrote more image placeholders than the request has images",
                                     param="messages")
            out += [self.replacements[self.used], part]
            self.used += 1
        return "".join(out)


@attrs.define(eq=False)
class Seen:
    """A request's images, processed: what the prompt's placeholders become (``expand``), and
    (``keyed``) the prompt as the prefix cache knows it."""

    prepared: Prepared
    placeholder: str  # what the template writes for an image
    token: str  # what the features take the place of (the placeholder, or what it expands to)
    token_id: int
    key: list[int] = attrs.field(factory=list)
    at: np.ndarray = attrs.field(factory=lambda: np.zeros(0, dtype=np.int64))  # the image tokens' positions
    positions: np.ndarray | None = None  # each token's three RoPE positions (Qwen2-VL's), see ``keyed``
    expand: Expander = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.expand = Expander(self.placeholder, self.prepared.replacements)

    def keyed(self, ids: list[int]) -> None:
        """Check ``ids`` hold every image's tokens, and mark each with its image's hash."""
        counts = [r.count(self.token) for r in self.prepared.replacements]
        at = np.flatnonzero(np.asarray(ids) == self.token_id)
        if self.expand.used != len(counts) or len(at) != sum(counts):
            raise RequestInvalid(
                f"the chat template placed {self.expand.used} of the request's {len(counts)} images; "
                "images are read in user messages", param="messages")
        key, k = list(ids), 0
        for image, n in enumerate(counts):
            mark = -1 - int(self.prepared.hashes[image][:15], 16)  # never a token id
            for i in at[k:k + n]:
                key[i] = mark
            k += n
        self.key, self.at = key, at
        if self.prepared.grids:
            self._place(key)

    def _place(self, key: list[int]) -> None:
        """Qwen2-VL's positions, shifted so that the prompt's last is its length less one: the
        tokens that follow take the plain RoPE of their place in the sequence, as every decode
        step gives them.  The shift (how many positions the images save) is a part of every
        key's meaning, so it marks the key's first token: prompts read with another shift share
        no KV."""
        positions = mrope_positions(len(key), self.at, list(self.prepared.grids))
        shift = len(key) - 1 - int(positions[:, -1].max())
        self.positions = positions + shift
        if shift and key:
            key[0] = -(1 << 62) - (shift << 32) - key[0]  # below every image's mark

    def tokens_of(self, image: int) -> int:
        return self.prepared.replacements[image].count(self.token)

    def images_at(self, start: int, end: int) -> np.ndarray:
        """For each prompt position from ``start`` to ``end``, the image its token is of, or -1."""
        image = np.full(end - start, -1)
        bounds = np.cumsum([self.tokens_of(i) for i in range(len(self.prepared.replacements))])
        inside = (self.at >= start) & (self.at < end)
        image[self.at[inside] - start] = np.searchsorted(bounds, np.flatnonzero(inside), side="right")
        return image

    def past_image(self, end: int) -> int:
        """``end``, or past the last token of the image whose tokens it would cut apart."""
        i = int(np.searchsorted(self.at, end))  # image tokens before ``end``
        if not 0 < i < len(self.at):
            return end
        bounds = np.cumsum([self.tokens_of(k) for k in range(len(self.prepared.replacements))])
        image = int(np.searchsorted(bounds, i - 1, side="right"))  # the last one's image
        return end if bounds[image] == i else int(self.at[bounds[image] - 1]) + 1


def _bidirectional(model: Any, embeddings: mx.array, cache: list[Any], images: np.ndarray) -> None:
    """A Gemma 3 prompt chunk into ``cache``: mlx-lm's layers with its masks (causal; a sliding
    window on the local layers), and each image's tokens (``images``: each position's image, or
    -1) seeing each other both ways, as transformers' model reads them.  The text rows are scaled
    as mlx-lm scales embeddings; the image rows, the projector's features, are not."""
    inner = model.model
    n = embeddings.shape[1]
    text = mx.array(images < 0)[None, :, None]
    scale = mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(embeddings.dtype)
    h = mx.where(text, embeddings * scale, embeddings)
    same = mx.array((images[:, None] == images[None, :]) & (images[:, None] >= 0))

    def mask(c: Any, window: int | None) -> mx.array | None:
        causal = c.make_mask(n, window_size=window, return_array=True)
        if causal is None:  # one token, which sees every key
            return None
        return causal | mx.concatenate([mx.zeros((n, causal.shape[-1] - n), dtype=mx.bool_), same], axis=1)

    pattern = inner.sliding_window_pattern
    full = mask(cache[pattern - 1], None)
    local = mask(cache[0], inner.window_size) if pattern > 1 else full
    for i, (layer, c) in enumerate(zip(inner.layers, cache, strict=True)):
        h = layer(h, full if i % pattern == pattern - 1 else local, c)


def _decoded(images: Sequence[bytes]) -> list[Any]:
    """Each image's pixels, RGB (``RequestInvalid`` for one that does not decode)."""
    from PIL import Image, UnidentifiedImageError

    decoded = []
    for i, data in enumerate(images):
        try:
            with Image.open(io.BytesIO(data)) as image:
                decoded.append(image.convert("RGB"))
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise RequestInvalid(f"image {i + 1} of the request could not be decoded ({type(exc).__name__})",
                                 param="messages") from None
    return decoded


@attrs.define(eq=False)
class _Reading:
    """A request's vision work under way: its pieces, then its prompt's chunks."""

    seq: int
    prompt: list[int]
    params: SamplingParams
    seen: Seen
    cache: list[Any]
    at: int  # prompt tokens in ``cache``
    reused: int  # of which the prefix cache gave
    parts: dict[int, list[mx.array]] = attrs.field(factory=dict)  # image -> features, tile by tile
    next_piece: int = 0
    features: mx.array | None = None  # every image token's, in prompt order


class VisionSide:
    """A backend's tower and the requests whose images it is reading."""

    def __init__(self, path: Path, backend: Any) -> None:
        self.backend = backend
        with mx.stream(backend.stream):
            self.tower = Tower(path)
        backend.tokenizer.content_parts = True
        backend.tokenizer.count_images = self.counting
        backend.tokenizer.process_images = self.process_ahead
        self._ahead: dict[tuple[str, ...], Any] = {}  # images processed ahead, by their hashes
        self._ahead_lock = threading.Lock()
        self.seen_ahead = 0  # requests whose images were processed ahead (tests)
        self.reading: dict[int, _Reading] = {}
        self._chunk: Outside | None = None  # a prompt chunk left for the step's own pass
        self.pieces_run = 0  # pieces of towers run (tests, benchmarks)
        self._pace: deque[tuple[float, float]] = deque(maxlen=32)  # recent pieces' multiply-adds and seconds
        self.chunks_in_step = 0  # prompt chunks read in a decode step's pass (tests, benchmarks)

    def process_ahead(self, images: Sequence[bytes]) -> None:
        """Decode and process a request's images before it reaches the model thread (any thread:
        PIL and numpy; ``RequestInvalid`` for one that does not decode), so that ``see`` finds
        them done: the processor's tens of milliseconds an image are then no decode step's."""
        key = tuple(digest(d) for d in images)
        processed = self.tower.processed(_decoded(images))
        with self._ahead_lock:
            self._ahead[key] = processed
            while len(self._ahead) > AHEAD:
                self._ahead.pop(next(iter(self._ahead)))

    def see(self, images: Sequence[bytes]) -> Seen:
        """A request's images, processed (by ``process_ahead``, or now: ``RequestInvalid`` for one
        that does not decode), their layers cut into pieces of what ``_budget`` allows."""
        digests = [digest(d) for d in images]
        with self._ahead_lock:
            processed = self._ahead.pop(tuple(digests), None)
        self.seen_ahead += processed is not None
        if processed is None:
            processed = self.tower.processed(_decoded(images))
        with mx.stream(self.backend.stream):
            prepared = self.tower.prepare(processed, digests, self._budget())
        return Seen(prepared, self.tower.image_token, self.tower.feature_token, self.tower.feature_token_id)

    def _budget(self) -> float | None:
        """While streams decode: the multiply-adds a piece may do, ``PIECE_SHARE`` of their usual
        gap at the pace pieces have run (so a step with a piece takes at most about twice the
        gap, as the join pacer keeps a prompt chunk's); otherwise None (``PIECE_MACS``)."""
        gap = self.backend.pacer.gap
        if gap is None or not len(self.backend.engine._generation_batch) or not self._pace:
            return None
        rate = sum(m for m, _ in self._pace) / max(1e-6, sum(t for _, t in self._pace))
        return min(4 * _pieces.PIECE_MACS, max(_pieces.PIECE_MACS / 50, PIECE_SHARE * gap * rate))

    def counting(self, images: Sequence[bytes]) -> Expander:
        """What ``images`` add to a prompt, for counting it off the model thread (``count_tokens``):
        the processor alone (PIL and numpy), no tower, no MLX."""
        return Expander(self.tower.image_token, self.tower.replacements(_decoded(images)))

    def start(self, seq: int, prompt: list[int], params: SamplingParams, seen: Seen) -> int:
        """``seq`` begins reading: from the longest prefix the cache holds of its keyed prompt."""
        cache, cached = self.backend.prefix_cache.take(seen.key)
        cached = min(cached, len(prompt) - 1)
        if cache is None:
            cache, cached = make_prompt_cache(self.backend.model), 0
        self.reading[seq] = _Reading(seq, prompt, params, seen, cache, cached, cached)
        return cached

    def drop(self, seq: int) -> bool:
        return self.reading.pop(seq, None) is not None

    def advance(self, chunk: int, *, fuse: bool = False
                ) -> tuple[dict[int, PrefillProgress], dict[int, BaseException]]:
        """One bounded piece of the first waiting request's work; the progress of every one.
        With ``fuse``, a prompt chunk is left for the step's own pass (``take_chunk``): the
        weights are read once for it and the streams decoding; after the last, the sequence
        joins the engine at the next call."""
        failed: dict[int, BaseException] = {}
        if self.reading:
            run = next(iter(self.reading.values()))
            try:
                with mx.stream(self.backend.stream):
                    self._piece(run, chunk, fuse)
            except Exception as exc:
                del self.reading[run.seq]
                failed[run.seq] = exc
        progress = {r.seq: PrefillProgress(r.at, len(r.prompt), r.reused) for r in self.reading.values()}
        return progress, failed

    def take_chunk(self) -> Outside | None:
        """The prompt chunk ``advance`` left for this step's pass, if any (once)."""
        chunk, self._chunk = self._chunk, None
        self.chunks_in_step += chunk is not None
        return chunk

    def _piece(self, run: _Reading, chunk: int, fuse: bool) -> None:
        pieces = run.seen.prepared.pieces
        if run.features is None and run.next_piece < len(pieces):
            piece = pieces[run.next_piece]
            mx.synchronize(self.backend.stream)  # the step queued before, apart from this piece's time
            began = time.perf_counter()
            out = piece.run()
            mx.eval(out)  # this piece's work now, not a graph left for the next
            if macs := getattr(piece.run, "macs", 0):
                self._pace.append((macs, time.perf_counter() - began))
            if piece.final:
                run.parts.setdefault(piece.image, []).append(out)
            run.next_piece += 1
            self.pieces_run += 1
            return
        if run.features is None:
            run.features = self._features(run)
        end = min(run.at + chunk, len(run.prompt) - 1)
        if self.tower.bidirectional:  # an image's tokens attend to each other: never cut one apart
            end = run.seen.past_image(end)
        if end > run.at and fuse and not self.tower.bidirectional:  # in the step's pass: it joins at the next
            positions = run.seen.positions
            rope = None if positions is None else MRoPE(self.backend.model.model.layers[0].self_attn.rope,
                                                        self.tower.sections, positions[:, run.at:end])
            self._chunk = Outside(self._embeddings(run, run.at, end), run.cache, rope)
            run.at = end
            return
        if end > run.at:
            self._prefill(run, run.at, end)
            run.at = end
        if run.at >= len(run.prompt) - 1:  # the last token is the engine's: it samples the first
            del self.reading[run.seq]
            self.backend._insert(run.seq, run.prompt, run.params, run.cache, run.at,
                                  reused=run.reused, key=run.seen.key)

    def _features(self, run: _Reading) -> mx.array:
        prepared, tower = run.seen.prepared, self.tower
        images = []
        for image, digest_ in enumerate(prepared.hashes):
            if image in prepared.cached:
                images.append(prepared.cached[image])
                continue
            whole = mx.concatenate(run.parts.get(image, []), axis=0)
            if whole.shape[0] != run.seen.tokens_of(image):
                raise ValueError(f"image {image}: {whole.shape[0]} features for {run.seen.tokens_of(image)} tokens")
            tower.features.put(digest_, whole)
            images.append(whole)
        return mx.concatenate(images, axis=0)

    def _embeddings(self, run: _Reading, start: int, end: int) -> mx.array:
        """The prompt's token embeddings from ``start`` to ``end``, each image token's its feature."""
        embeddings = self.backend.model.model.embed_tokens(mx.array(run.prompt[start:end])[None])
        image_at = run.seen.at
        inside = image_at[(image_at >= start) & (image_at < end)]
        if len(inside):
            rows = np.searchsorted(image_at, inside)  # which image token of the prompt each is
            assert run.features is not None
            embeddings[0, mx.array(inside - start)] = run.features[mx.array(rows)].astype(embeddings.dtype)
        return embeddings

    def _prefill(self, run: _Reading, start: int, end: int) -> None:
        """The prompt from ``start`` to ``end`` into its own cache, in a pass of its own."""
        model = self.backend.model
        chunk = mx.array(run.prompt[start:end])[None]
        embeddings = self._embeddings(run, start, end)
        if self.tower.bidirectional:
            _bidirectional(model, embeddings, run.cache, run.seen.images_at(start, end))
        elif run.seen.positions is not None:
            _rotated(model, chunk, embeddings, run.cache, self.tower.sections, run.seen.positions[:, start:end])
        else:
            model(chunk, cache=run.cache, input_embeddings=embeddings)
        mx.eval([c.state for c in run.cache])


def _rotated(model: Any, chunk: mx.array, embeddings: mx.array, cache: list[Any], sections: list[int],
             positions: np.ndarray) -> None:
    """A Qwen2-VL prompt chunk into ``cache``: the model's own layers, each attention's RoPE
    (``rope``, called with the cache's offset) that of the chunk's ``positions`` for this call."""
    attentions = [layer.self_attn for layer in model.model.layers]
    ropes = [a.rope for a in attentions]
    turned = MRoPE(ropes[0], sections, positions)
    try:
        for a in attentions:
            a.rope = turned
        model(chunk, cache=cache, input_embeddings=embeddings)
    finally:
        for a, rope in zip(attentions, ropes, strict=True):
            a.rope = rope
