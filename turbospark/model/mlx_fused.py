"""One forward pass for the decoding streams and a newcomer's prompt chunk together.

Runs on the model thread, in place of ``BatchGenerator.next`` for a step that both decodes and
reads a prompt.  mlx-lm's engine runs such a step as two forward passes, the generation batch's
(one token a row) and then the prompt batch's (a chunk of one row).  Most of a pass's cost on a
CPU is fixed (per op, per weight read), so a mixed step costs about two decode steps however small
the chunk.  Then the newcomer's last prompt token gets a forward pass of its own, and its cache
is merged into the batch's in one copy of every row's KV.

Here the decode rows and the chunk are packed into one sequence of ``rows + chunk`` positions:
the embedding, every projection, the MLP, the norms and the output head run once over all of
them (the weights are read once; a layer the CPU kernels fused runs its joined products, as its
own step does: ``mlx_blocks``); only attention runs apart, the decode rows against the
batch's KV cache and the chunk against the newcomer's.  The chunk that ends the prompt takes its
last token too, and the newcomer's first token is sampled from that same pass, so it enters the
decode batch without a pass of its own; its KV joins the batch's layer by layer over the next
steps (``mlx_joining``), while this pass reads each layer's parts apart.  Everything else is the
engine's own code: the generation batch's ``next`` (its processors, samplers, stop rules,
pipelining) runs on the logits this pass gave it, and so does the newcomer's first
``GenerationBatch`` step.

An image request's prompt, read outside the engine (``mlx_vision``), takes the same pass: its
chunk comes as embeddings (the image features in place), with a KV cache of its own and, for
Qwen2-VL, the RoPE of its positions (``Outside``, ``fused_outside``); nothing is sampled for it.

Only models whose layer stack is mlx-lm's llama layout (``fusable``: its llama and qwen2 modules,
Mistral and Qwen2.5 among them), plain ``BatchKVCache``
layers, and one prompt being read at a time; anything else takes the engine's own step.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache

from .mlx_kv import kv_update
from .mlx_joining import JoiningKVCache, join, joining, merge_some

__all__ = ["Outside", "can_fuse", "can_fuse_outside", "forward", "fusable", "fused_next", "fused_outside"]

_LAYOUTS = {"mlx_lm.models.llama", "mlx_lm.models.qwen2"}  # the same blocks (qwen2: biased q/k/v)


def fusable(model: Any) -> bool:
    """Whether ``model`` has the layer stack this pass knows (full attention everywhere)."""
    inner = getattr(model, "model", None)
    return (type(model).__module__ in _LAYOUTS and inner is not None
            and all(not getattr(layer, "use_sliding", False) for layer in inner.layers))


def can_fuse(engine: Any) -> bool:
    """Whether the engine's next step is one this pass runs: streams decode and one prompt at
    most is read, or newcomers' layers are still being merged (``mlx_joining``)."""
    gen, prompts, waiting = engine._generation_batch, engine._prompt_batch, engine._unprocessed_sequences
    if not len(gen) or not all(type(p) is BatchKVCache for c in gen.prompt_cache for p in _parts(c)):
        return False
    reading = len(prompts) + len(waiting)
    if not reading:
        return joining(gen)
    if reading != 1 or len(gen) >= engine.completion_batch_size:
        return False
    cache = prompts.prompt_cache if len(prompts) else waiting[0][3]
    return all(type(c) in (BatchKVCache, KVCache) for c in cache)


def can_fuse_outside(engine: Any) -> bool:
    """Whether the engine's next step can take a chunk read outside it (``Outside``): streams
    decode and the engine reads no prompt of its own."""
    gen = engine._generation_batch
    return (bool(len(gen)) and not len(engine._prompt_batch) and not engine._unprocessed_sequences
            and all(type(p) is BatchKVCache for c in gen.prompt_cache for p in _parts(c)))


@attrs.frozen(eq=False)
class Outside:
    """A prompt chunk read outside the engine (a vision request's, ``mlx_vision``), in the decode
    step's pass: its embeddings ``(1, C, hidden)``, the KV cache of its own it is written into,
    and the RoPE its attention takes where it is not the layer's own (Qwen2-VL's positions)."""

    embeddings: mx.array
    cache: list[Any]
    rope: Any = None


def _parts(cache: Any) -> list[Any]:
    return cache.parts if isinstance(cache, JoiningKVCache) else [cache]


class _Given:
    """Stands in for the model in the engine's own step: the logits are already computed."""

    def __init__(self, logits: mx.array) -> None:
        self.logits = logits

    def __call__(self, inputs: mx.array, cache: Any = None, **_: Any) -> mx.array:
        return self.logits


def _attend(attn: Any, q: mx.array, k: mx.array, v: mx.array, cache: Any, mask: Any, fused: bool,
            rope: Any = None) -> mx.array:
    """The attention of mlx-lm's llama ``Attention`` for ``(B, L, heads * dim)`` projections
    (a ``fused`` layer's cache written as the layer itself writes it; ``rope`` in place of the
    layer's own)."""
    B, L, _ = q.shape
    q = q.reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = k.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = v.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    rope = attn.rope if rope is None else rope
    q = rope(q, offset=cache.offset)
    k = rope(k, offset=cache.offset)
    k, v = kv_update(cache, k, v) if fused else cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(B, L, -1)


def forward(model: Any, rows: mx.array, rows_cache: list[Any], chunk: mx.array | None = None,
            chunk_cache: list[Any] | None = None, last: bool = False,
            outside: Outside | None = None) -> tuple[mx.array, mx.array | None]:
    """Logits ``(B, 1, vocab)`` for the decode rows' tokens ``rows`` (``(B,)``) and, when
    ``last``, ``(1, 1, vocab)`` for ``chunk``'s last position; the caches are written.  A chunk
    read ``outside`` the engine comes as its embeddings, its cache and its RoPE."""
    inner = model.model
    if outside is not None:
        chunk_cache = outside.cache
    B = rows.shape[0]
    C = outside.embeddings.shape[1] if outside is not None else 0 if chunk is None else chunk.shape[0]
    h = inner.embed_tokens(rows).reshape(1, B, -1)
    if C:
        h_chunk = outside.embeddings if outside is not None else inner.embed_tokens(chunk[None])
        chunk_mask = create_attention_mask(h_chunk, chunk_cache[0])
        h = mx.concatenate([h, h_chunk], axis=1)
    masks: dict[tuple[int, int], Any] = {}  # by (parts, part): the same for every such layer
    # (without a chunk, ``cc`` is the rows' own cache again, unread)
    for layer, c, cc in zip(inner.layers, rows_cache, chunk_cache or rows_cache, strict=True):
        attn = layer.self_attn
        fused = getattr(layer, "_turbospark_parts", None)  # a layer the CPU kernels fused (mlx_blocks)
        if fused is not None:  # its joined products: the norm and one product for q, k and v
            q, k, v = mx.split(fused.qkv(h, norm=layer.input_layernorm), fused.qkv_splits, axis=-1)
        else:
            x = layer.input_layernorm(h)
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        outs, start, parts = [], 0, _parts(c)
        for i, part in enumerate(parts):
            n = part.offset.shape[0]
            mask = masks.get((len(parts), i))
            if mask is None:
                mask = masks[len(parts), i] = part.make_mask(1)
            if n == B and not C:  # the whole pass: a reshape, not three slices
                qs, ks, vs = q.reshape(B, 1, -1), k.reshape(B, 1, -1), v.reshape(B, 1, -1)
            else:
                rows_ = slice(start, start + n)
                qs, ks, vs = q[0, rows_, None], k[0, rows_, None], v[0, rows_, None]
            outs.append(_attend(attn, qs, ks, vs, part, mask, fused is not None).reshape(1, n, -1))
            start += n
        if C:
            outs.append(_attend(attn, q[:, B:], k[:, B:], v[:, B:], cc, chunk_mask, fused is not None,
                                outside.rope if outside is not None else None))  # fmt: skip
        attended = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
        if fused is not None:  # and one for gate and up, the residuals and SwiGLU in the products
            h = fused.o(attended, residual=h)
            h = fused.down(fused.gate_up(h, swiglu_halves=True, norm=layer.post_attention_layernorm), residual=h)
        else:
            h = h + attn.o_proj(attended)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
    wanted = mx.concatenate([h[:, :B], h[:, -1:]], axis=1) if last else h[:, :B]
    out = inner.norm(wanted)
    logits = inner.embed_tokens.as_linear(out) if model.args.tie_word_embeddings else model.lm_head(out)
    logits = logits.reshape(-1, 1, logits.shape[-1])
    return (logits[:B], logits[B:]) if last else (logits, None)


def fused_outside(engine: Any, outside: Outside) -> list[Any]:
    """The engine's decode step (``can_fuse_outside``) with a chunk read ``outside`` it in the
    same pass: the generation batch's responses; the chunk's KV is in its cache after."""
    gen = engine._generation_batch
    rows_logits, _ = forward(engine.model, gen._next_tokens, gen.prompt_cache, outside=outside)
    gen.model = _Given(rows_logits)
    try:
        generation_responses = gen.next()
    finally:
        gen.model = engine.model
    engine._counters.generation_tokens += len(generation_responses)
    engine._counters.generation_steps += 1
    mx.async_eval([c.state for c in outside.cache])
    merge_some(gen)
    return generation_responses


def fused_next(engine: Any) -> tuple[list[Any], list[Any]]:
    """``BatchGenerator._next`` for a step that ``can_fuse``: the same responses, one pass."""
    gen = engine._generation_batch
    if engine._unprocessed_sequences:  # the newcomer enters the prompt batch, as ``_next`` does
        engine._prompt_batch.extend(engine._make_batch(1))
    prompts = engine._prompt_batch
    chunk, last = None, False
    if len(prompts):
        seq = engine._currently_processing[0]
        segments = seq[0]  # the last segment is the prompt's last token alone
        last = sum(len(s) for s in segments) <= engine.prefill_step_size
        tokens = [t for s in segments for t in s] if last else segments[0][: engine.prefill_step_size]
        chunk = mx.array(tokens)
    rows_logits, new_logits = forward(engine.model, gen._next_tokens, gen.prompt_cache, chunk,
                                      prompts.prompt_cache if len(prompts) else None, last)
    gen.model = _Given(rows_logits)
    try:
        generation_responses = gen.next()
    finally:
        gen.model = engine.model
    engine._counters.generation_tokens += len(generation_responses)
    engine._counters.generation_steps += 1
    if chunk is None:
        merge_some(gen)
        return [], generation_responses
    engine._counters.prompt_tokens += len(tokens)
    seq[1] += len(tokens)
    (uid,) = prompts.uids
    if not last:
        segments[0] = segments[0][len(tokens):]
        ended = not segments[0]
        if ended:
            segments.pop(0)
        prompts.tokens[0] += tokens
        mx.async_eval([c.state for c in prompts.prompt_cache])
        merge_some(gen)
        return [PromptProcessingBatch.Response(uid, (seq[1], seq[2]), ended, False)], generation_responses
    # The prompt is read: its first token is sampled from this pass, by the engine's own step.
    engine._currently_processing = []
    engine._prompt_batch = PromptProcessingBatch.empty(  # the pieces its own ``prompt`` reads in, kept
        engine.model, engine.sampler, prefill_step_size=prompts.prefill_step_size)
    prompts.tokens[0] += tokens[:-1]
    newcomer = GenerationBatch(
        _Given(new_logits), prompts.uids, mx.array(tokens[-1:]), prompts.prompt_cache, prompts.tokens,
        prompts.samplers, prompts.fallback_sampler, prompts.logits_processors, prompts.stop_sequences,
        prompts.max_tokens,
    )
    newcomer.model = engine.model
    merge_some(gen)
    join(gen, newcomer)
    return [PromptProcessingBatch.Response(uid, (seq[2], seq[2]), True, True)], generation_responses
