"""``POST /tokenize``, ``/detokenize`` and ``/apply-template``: the chat model's tokenizer and
chat template as llama.cpp's server and vLLM serve them.

Off the model thread, as ``count_tokens`` is: no queue, no generation; the encoding runs in a
worker thread, so a long text never holds the event loop.  A chat is rendered and encoded with
the same ``render_prompt`` the model thread uses, so the ids are exactly what a generation
reads.  Shapes: llama.cpp's ``content`` -> ``{"tokens": [...]}`` (``with_pieces``: ``{"id",
"piece"}`` objects, a piece that is not UTF-8 as its bytes); vLLM's ``prompt`` or ``messages``
-> ``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` answers both
families at once (llama.cpp's ``content``, vLLM's ``prompt``); ``/apply-template`` takes a chat
completion body and answers ``{"prompt"}``, the rendered text.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import trio
from quart import Blueprint, Response

from ..errors import RequestInvalid
from ..messages import ChatPrompt
from ..model.tokenizer import Tokenizer
from ..threads.prompt import render_prompt
from ..turns.chat import apply_default_system
from ..turns.structured import function_tools, select_tools
from ..web.app import json_response, system
from ..web.bodies import read_body
from ..wire.codec import structure
from ..wire.openai import ChatCompletionRequest
from ..wire.tokenize import DetokenizeRequest, TokenizeRequest, check_ids, mixed_content
from .openai_chat import _messages, _template_kwargs

blueprint = Blueprint("tokenize", __name__)


def _chat(body: ChatCompletionRequest, default_system: str | None) -> ChatPrompt:
    """A chat request's prompt, as chat completions builds it."""
    messages, _ = _messages(body)
    tools, _ = select_tools(function_tools(body.tools), body.tool_choice)
    return ChatPrompt(tuple(apply_default_system(messages, default_system)), tools, _template_kwargs(body))


def _render(tok: Tokenizer, prompt: ChatPrompt, generation_prompt: bool, window: int, special: bool) -> list[int]:
    if generation_prompt:  # exactly what the model thread reads; as count_tokens, a prompt of
        # surely more than 4 windows is refused unless it is short enough to count in full
        return render_prompt(tok, prompt, 4 * window, window=window, special_tokens_in_content=special)[0]
    text = tok.render_chat(prompt.messages, tools=prompt.tools or None, add_generation_prompt=False,
                           template_kwargs=prompt.template_kwargs)
    return tok.encode(text) if special else tok.encode_rendered(text, [
        m["content"] for m in prompt.messages if isinstance(m.get("content"), str)])


def _llama_tokens(tok: Tokenizer, body: TokenizeRequest) -> list[Any]:
    ids: list[int] = []
    for i, part in enumerate(mixed_content(body.content)):
        if isinstance(part, int):
            check_ids([part], tok.vocab_size, "content")
            ids.append(part)
        else:  # only the first piece may begin with BOS, as llama.cpp's tokenize_mixed
            ids += tok.tokenize(part, add_special=body.add_special and i == 0, parse_special=body.parse_special)
    if not body.with_pieces:
        return ids
    out: list[Any] = []
    for token in ids:
        raw = tok.piece(token)
        try:
            piece: Any = raw.decode()
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": token, "piece": piece})
    return out


@blueprint.post("/tokenize")
async def tokenize() -> Response:
    sys_ = system()
    body = await read_body(TokenizeRequest)
    given = [name for name in ("content", "prompt", "messages") if getattr(body, name) is not None]
    if len(given) > 1:
        raise RequestInvalid(f"give one of content, prompt or messages, not {' and '.join(given)}", param=given[1])
    if body.continue_final_message:
        raise RequestInvalid("continue_final_message is not supported", param="continue_final_message")
    # a chat needs a chat template; text, any generative model
    entry = await sys_.resolve(body.model, "chat" if body.messages is not None else "completion")
    tok = entry.tokenizer
    if tok is None:
        raise RequestInvalid("this model has no tokenizer", param="model")
    if not given:
        return json_response({"tokens": []})  # llama.cpp's answer to no content
    if body.content is not None:
        return json_response({"tokens": await trio.to_thread.run_sync(_llama_tokens, tok, body)})
    if body.messages is not None:
        chat = structure({"messages": body.messages, "tools": body.tools,
                          "chat_template_kwargs": body.chat_template_kwargs}, ChatCompletionRequest)
        prompt = _chat(chat, sys_.settings.system_prompt)
        ids = await trio.to_thread.run_sync(partial(
            _render, tok, prompt, body.add_generation_prompt, entry.context_window,
            sys_.settings.special_tokens_in_content))
        if body.add_special_tokens and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids = [tok.bos_id, *ids]
    else:
        assert body.prompt is not None
        add = body.add_special_tokens is not False
        ids = await trio.to_thread.run_sync(partial(tok.tokenize, body.prompt, add_special=add))
    return json_response({
        "count": len(ids), "max_model_len": entry.context_window, "tokens": ids,
        "token_strs": [tok.token_name(i) for i in ids] if body.return_token_strs else None,
    })


@blueprint.post("/detokenize")
async def detokenize() -> Response:
    sys_ = system()
    body = await read_body(DetokenizeRequest)
    entry = await sys_.resolve(body.model, "completion")
    tok = entry.tokenizer
    if tok is None:
        raise RequestInvalid("this model has no tokenizer", param="model")
    check_ids(body.tokens, tok.vocab_size, "tokens")
    text = await trio.to_thread.run_sync(tok.detokenize, body.tokens)
    return json_response({"content": text, "prompt": text})


@blueprint.post("/apply-template")
async def apply_template() -> Response:
    sys_ = system()
    body = await read_body(ChatCompletionRequest)
    entry = await sys_.resolve(body.model, "chat")
    tok = entry.tokenizer
    if tok is None:
        raise RequestInvalid("this model has no tokenizer", param="model")
    prompt = _chat(body, sys_.settings.system_prompt)
    text = await trio.to_thread.run_sync(partial(
        tok.render_chat, prompt.messages, tools=prompt.tools or None, template_kwargs=prompt.template_kwargs))
    return json_response({"prompt": text})
