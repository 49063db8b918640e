"""What a job's prompt becomes on the model thread: token ids, checked before it may run.

``render_prompt`` renders a chat with the model's template (or takes raw text) and encodes it;
the model thread and ``count_tokens`` both count with it, so they agree exactly.
``encode_prompt`` adds the context-window check (a refusal names the prompt's size in tokens,
exact up to ``EXACT_UP_TO`` characters, a lower bound past that), ``prepare`` every other check
a job must pass before it waits for room (a grammar llguidance cannot enforce, ``logit_bias``
ids, ``n`` against the batch and the KV budget).  Whatever they raise is that job's answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..errors import ContextOverflow, RequestInvalid
from ..messages import ChatPrompt, GenerationJob, TextPrompt
from ._admission import Admission
from ..model.backend import Backend
from ..model.tokenizer import Tokenizer

__all__ = ["EXACT_UP_TO", "Prepared", "count_prompt", "encode_prompt", "prepare", "render_prompt", "texts_of"]

#: Characters of prompt text encoded in full even when it is surely too long, so that its
#: refusal gives its exact size.  256 KiB (about 100,000 tokens) held the model thread 0.36 s
#: on a slow 2-core x86 machine (80 KB, Claude Code's own prompt, 0.1 s); a longer text is
#: refused from its length or a few slices (``Tokenizer.tokens_past``), with a lower bound.
EXACT_UP_TO = 1 << 18
_THINK_END = "</think>"  # where the templates that keep reasoning out of the history cut


def render_prompt(
    tok: Tokenizer,
    prompt: ChatPrompt | TextPrompt,
    limit: int | None = None,
    *,
    window: int | None = None,
    special_tokens_in_content: bool = False,
    expand: Callable[[str], str] = str,
) -> tuple[list[int], bool]:
    """A prompt's token ids, and whether it leaves the model inside a reasoning span.  The
    model thread and ``count_tokens`` both count with this, so they agree exactly.  Special-token
    text in a message's content stays plain text unless ``special_tokens_in_content``.

    With ``limit``, a prompt of more than ``EXACT_UP_TO`` characters and surely more tokens is
    refused (``ContextOverflow``, naming a lower bound on its tokens and the model's context
    ``window``, which is ``limit`` unless given) without being encoded in full (see
    ``Tokenizer.tokens_past``): a 25 MiB prompt would otherwise hold the model thread, and every
    stream it runs, for seconds.  A shorter one is encoded, and the caller sees its exact size.

    ``expand`` rewrites the template's own text before it is encoded: a vision model's image
    placeholders become the tokens its images are read into (``mlx_vision.Seen.expand``)."""
    if isinstance(prompt, ChatPrompt):
        # the messages' texts, or the tools, alone can be too long to render at all (the template
        # copies them: 24 MiB of tools or of history held the model thread, and its streams,
        # 90-140 ms)
        if limit is not None and (said := _written(tok, prompt, limit)) > EXACT_UP_TO \
                and tok.surely_more_than(said, limit):
            raise _too_long(window or limit, tok.fewest_tokens(said))
        text = tok.render_chat(
            prompt.messages, tools=prompt.tools or None, template_kwargs=prompt.template_kwargs
        )
        _within(tok, text, limit, window)
        if special_tokens_in_content:
            return tok.encode(expand(text)), tok.opens_reasoning(text)
        contents = [t for m in prompt.messages for t in texts_of(m.get("content"))]
        return tok.encode_rendered(text, contents, expand), tok.opens_reasoning(text)
    assert isinstance(prompt, TextPrompt)
    _within(tok, prompt.text, limit, window)
    return tok.encode(prompt.text, add_bos=tok.add_bos_token), False


def count_prompt(
    tok: Tokenizer, prompt: ChatPrompt | TextPrompt, limit: int | None = None, *, window: int | None = None,
    special_tokens_in_content: bool = False,
) -> list[int]:
    """A prompt's ids as ``render_prompt`` gives them, off the model thread (``count_tokens``):
    a vision model's images count as the tokens they are read into."""
    expand: Callable[[str], str] = str
    if isinstance(prompt, ChatPrompt) and prompt.images and tok.count_images is not None:
        expand = tok.count_images(prompt.images)
    return render_prompt(tok, prompt, limit, window=window, special_tokens_in_content=special_tokens_in_content,
                         expand=expand)[0]


def _within(tok: Tokenizer, text: str, limit: int | None, window: int | None) -> None:
    """Refuse a text too long to be worth encoding that surely has more than ``limit`` tokens."""
    if limit is None or len(text) <= EXACT_UP_TO:
        return
    if (least := tok.tokens_past(text, limit)) is not None:
        raise _too_long(window or limit, least)


def _too_long(window: int, least: int) -> ContextOverflow:
    return ContextOverflow.prompt_too_long(window, least, exact=False)


def _written(tok: Tokenizer, prompt: ChatPrompt, limit: int) -> int:
    """Characters that every rendering of ``prompt`` writes out whole: the messages' texts (an
    assistant's after its reasoning, ``_kept``), then the tools' (their names, descriptions and
    schemas' strings, as a template lists them as JSON or the tool preamble does); counted a
    tool at a time until surely past ``limit``."""
    said = sum(_kept(m, t) for m in prompt.messages for t in texts_of(m.get("content")))
    for tool in prompt.tools:
        if tok.surely_more_than(said, limit):
            break
        said += _strings_in(tool.get("function", tool))  # what the tool preamble lists
    return said


def _kept(message: dict[str, Any], text: str) -> int:
    """How much of a message's text any template writes out: all of it, but of an assistant's
    only what follows its last ``</think>`` (the templates that keep reasoning out of the
    history, Qwen 3's and DeepSeek-R1's, cut there)."""
    if message.get("role") == "assistant" and (cut := text.rfind(_THINK_END)) != -1:
        return len(text) - cut - len(_THINK_END)
    return len(text)


def _strings_in(value: Any) -> int:
    """The characters of every string in a JSON value, its keys included (iterative: a deep one
    costs no stack)."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            count += len(item)
        elif isinstance(item, dict):
            count += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return count


def texts_of(content: Any) -> list[str]:
    """A message's texts: its content, or the text parts of a list of parts (a vision model's)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return []


def encode_prompt(
    backend: Backend, job: GenerationJob, *, special_tokens_in_content: bool = False,
    expand: Callable[[str], str] = str,
) -> tuple[list[int], bool]:
    """The prompt's token ids, and whether it leaves the model inside a reasoning span; for a
    ``truncate`` job, a budget past what the prompt leaves is cut to it, and a prompt that does
    not fit at all is cut to its newest part that does (``_truncated``)."""
    try:
        return _encoded(backend, job, special_tokens_in_content, expand)
    except ContextOverflow as exc:
        if not job.truncate:
            raise
        if exc.param == "max_tokens":  # the prompt fits: only its budget is cut
            return _encoded(backend, attrs.evolve(job, clamp=True), special_tokens_in_content, expand)
        if (cut := _truncated(backend, job, special_tokens_in_content, expand)) is None:
            raise
        return cut


def _truncated(backend: Backend, job: GenerationJob, special: bool,
               expand: Callable[[str], str]) -> tuple[list[int], bool] | None:
    """A truncating job's prompt cut to fit with room for its budget (at most half the window):
    a chat's oldest messages dropped, its system messages and its last kept (Ollama's truncate;
    the fewest that fit, found by halving, each try one rendering); a text prompt's start dropped
    (its BOS kept).  None where even the shortest does not fit, or the prompt has images (which
    image each message holds is the vision side's)."""
    window, tok = backend.context_window, backend.tokenizer
    room = max(1, min(job.params.max_tokens, window // 2))
    if isinstance(job.prompt, TextPrompt):
        text = job.prompt.text[-window * 8:]  # no token is shorter than a character: enough to fill it
        ids, in_reasoning = render_prompt(tok, attrs.evolve(job.prompt, text=text),
                                          special_tokens_in_content=special, expand=expand)
        bos = ids[:1] if ids and ids[0] == tok.bos_id else []
        return bos + ids[len(bos):][-(window - room - len(bos)):], in_reasoning
    if job.prompt.images:
        return None
    messages = list(job.prompt.messages)
    kept = [m for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]

    def without(n: int) -> tuple[list[int], bool] | None:  # the prompt less its n oldest other messages
        shorter = attrs.evolve(job, prompt=attrs.evolve(job.prompt, messages=(*kept, *rest[n:])),
                               params=attrs.evolve(job.params, max_tokens=room), truncate=False)
        try:
            return _encoded(backend, shorter, special, expand)
        except ContextOverflow:
            return None

    fits = {len(rest) - 1: without(len(rest) - 1)} if rest else {}
    if not fits or fits[len(rest) - 1] is None:
        return None
    low, high = 0, len(rest) - 1  # without(low) does not fit; without(high) does
    while high - low > 1:
        mid = (low + high) // 2
        fits[mid] = without(mid)
        low, high = (low, mid) if fits[mid] is not None else (mid, high)
    return fits[high]


def _encoded(backend: Backend, job: GenerationJob, special_tokens_in_content: bool,
             expand: Callable[[str], str]) -> tuple[list[int], bool]:
    ids, in_reasoning = render_prompt(
        backend.tokenizer, job.prompt, backend.context_window,
        special_tokens_in_content=special_tokens_in_content, expand=expand,
    )
    if not ids:
        raise RequestInvalid("the prompt is empty", param="messages")
    window = backend.context_window
    if len(ids) >= window:  # no room for a single token: only a shorter prompt can run
        raise ContextOverflow.prompt_too_long(window, len(ids), exact=True)
    budget = job.params.max_tokens
    if job.clamp:
        budget = min(budget, window - len(ids))
    if len(ids) + budget > window:
        raise ContextOverflow(
            f"This model's context window is {window} tokens; the prompt has "
            f"{len(ids)} tokens and max_tokens asks for {budget} more. Shorten the prompt or "
            "lower max_tokens.",
            param="max_tokens", context_window=window, prompt_tokens=len(ids),
        )
    return ids, in_reasoning


@attrs.frozen
class Prepared:
    """A job that passed every check: its budget cut to what the context leaves (a clamping
    job), its prompt's ids, and what each of its choices may grow to."""

    job: GenerationJob
    ids: list[int]
    in_reasoning: bool  # the prompt opened a reasoning span
    grow: int  # prompt and budget, in tokens
    images: Any = None  # what the backend's vision side made of its images


def prepare(
    backend: Backend, job: GenerationJob, admission: Admission, *, special_tokens_in_content: bool = False
) -> Prepared:
    """Tokenise ``job`` and check it can ever run here; raises what its client is answered."""
    images = None
    if isinstance(job.prompt, ChatPrompt) and job.prompt.images:
        if (vision := getattr(backend, "vision", None)) is None:
            raise RequestInvalid(f"the model {backend.model_id} reads no images", param="messages")
        images = vision.see(job.prompt.images)  # decoded and processed: what each becomes
    ids, in_reasoning = encode_prompt(backend, job, special_tokens_in_content=special_tokens_in_content,
                                      expand=images.expand if images is not None else str)
    if images is not None:
        images.keyed(ids)
    room = backend.context_window - len(ids)
    if job.params.max_tokens > room:  # a clamping job: its budget is what the context leaves
        job = attrs.evolve(job, params=attrs.evolve(job.params, max_tokens=room))
    grow = len(ids) + job.params.max_tokens
    if job.params.grammar is not None:  # compiled now: a schema it cannot enforce, or a budget
        # too small for its shortest finished output, is a 400
        backend.tokenizer.grammars.compile(job.params.grammar, budget=job.params.max_tokens)
    if chosen := job.params.adapters or getattr(backend, "carried", ()):  # a derived model's carried one too
        check_adapters(getattr(backend, "adapters", ()), chosen, images is not None)
    vocab = backend.tokenizer.vocab_size
    if any(not 0 <= i < vocab for i, _ in job.params.logit_bias):
        raise RequestInvalid(
            f"logit_bias names a token id outside this model's vocabulary (0-{vocab - 1})",
            param="logit_bias")
    if job.n > admission.max_batch:
        raise RequestInvalid(
            f"n is {job.n}, but this model runs at most {admission.max_batch} "
            "sequences at once", param="n")
    if job.n > 1 and admission.cost([grow] * job.n) > admission.kv_budget:
        raise RequestInvalid(
            f"{job.n} choices of {len(ids)} prompt tokens and up to "
            f"{job.params.max_tokens} new tokens each need more KV-cache memory than "
            "this model may use; lower n or max_tokens", param="n")
    return Prepared(job, ids, in_reasoning, grow, images)


def check_adapters(adapters: Sequence[Any], chosen: Sequence[tuple[int, float]], images: bool) -> None:
    """The LoRA adapters a request chose (index, scale) are among the model's ``adapters``, and
    it can run with them; raises its client's 400."""
    if bad := [i for i, _ in chosen if not 0 <= i < len(adapters)]:
        have = f"0-{len(adapters) - 1} ({', '.join(a.name for a in adapters)})" if adapters else "none"
        raise RequestInvalid(f"lora names adapter id {bad[0]}; this model's adapters are {have}", param="lora")
    if images:
        raise RequestInvalid("a LoRA adapter does not apply to a request with images: ask the model without one",
                             param="model")
    doras = [(adapters[i].name, s) for i, s in chosen if adapters[i].kind == "dora" and s]
    if doras and (len([s for _, s in chosen if s]) > 1 or doras[0][1] != 1.0):
        raise RequestInvalid(f"the DoRA adapter {doras[0][0]} applies alone, at scale 1 (or 0)", param="lora")
