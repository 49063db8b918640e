"""An Anthropic Messages request translated for the generation core (sans-io).

The request is normalised as the reference does (a first ``system`` message promoted when there
is no top-level ``system``; any other role rewritten to ``user`` where it stands), then
translated block by block into the conversation the chat template renders (``tool_use`` → the
assistant's ``tool_calls``, ``tool_result`` → tool turns, ``thinking`` → ``reasoning_content``; the
MCP connector's ``mcp_tool_use`` and ``mcp_tool_result`` in an assistant's turn → its calls and,
after them, their tool turns),
its client tools into the chat shape, ``tool_choice`` and ``thinking``/``output_config.effort``
into the core's, and its sampling fields into ``SamplingParams``.  What is accepted but not
honoured is named as labels for the degradation header.  Plain functions: no Trio, no Quart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..errors import RequestInvalid
from ..messages import ChatPrompt
from ..model.backend import SamplingParams
from ..turns.chat import TemplateMessage, apply_default_system
from ..turns.sampling import sampling
from ..turns.images import image_parts, with_images
from ..turns.structured import check_images, function_tools, grammar_for, select_tools
from ..wire.anthropic import CountTokensRequest, MessagesRequest

__all__ = [
    "Plan", "default_max_tokens", "normalise", "plan", "sampling_params", "unhonoured",
]

# output_config.effort as the template's reasoning_effort
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "xhigh"}
_USER_BLOCKS = {"text", "image", "tool_result", "document"}
_ASSISTANT_BLOCKS = {"text", "tool_use", "thinking", "redacted_thinking", "mcp_tool_use", "mcp_tool_result"}


@attrs.define
class Plan:
    """A request translated: the conversation, tools and what is not honoured."""

    messages: list[TemplateMessage]
    tools: tuple[dict[str, Any], ...]
    call_required: bool
    parallel: bool
    template_kwargs: dict[str, Any]
    images: int = 0
    labels: list[str] = attrs.field(factory=list)
    cache_marked: bool = False

    @property
    def prompt(self) -> ChatPrompt:
        return ChatPrompt(tuple(self.messages), self.tools, self.template_kwargs)


def normalise(raw: Any) -> Any:
    """The reference's normalisation, on the raw body: a leading ``system`` message becomes the
    top-level ``system`` when there is none (and more messages follow); any role other than
    ``user`` and ``assistant`` is rewritten to ``user`` where it stands."""
    if not isinstance(raw, dict) or not isinstance(raw.get("messages"), list):
        return raw
    messages = [dict(m) if isinstance(m, dict) else m for m in raw["messages"]]
    first = messages[0] if messages else None
    if (
        isinstance(first, dict) and str(first.get("role", "")).lower() == "system"
        and raw.get("system") is None and len(messages) > 1
    ):
        raw = {**raw, "system": first.get("content")}
        messages = messages[1:]
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"].lower() not in ("user", "assistant"):
            m["role"] = "user"
    return {**raw, "messages": messages}


def plan(body: CountTokensRequest, default_system: str | None, vision: bool = False, remote: bool = False,
         mcp_tools: Sequence[dict[str, Any]] = ()) -> Plan:
    """What makes up the prompt (``count_tokens`` takes no more than this).  A ``vision``
    model's user messages keep their images (``turns.images``); ``Plan.images`` counts those
    dropped (every image for other models, a tool result's for a vision model).  ``mcp_tools``:
    the tools of the MCP servers ``mcp_servers`` names, as function tools (``turns.mcp_uses``)."""
    labels: list[str] = []
    messages, urls = _conversation(body, labels, vision)
    messages = apply_default_system(messages, default_system)
    images = check_images(urls, remote and vision) - image_parts(messages)
    choice, parallel = _tool_choice(body.tool_choice)
    tools, required = select_tools((*_tools(body), *mcp_tools), choice)
    if body.context_management:
        labels.append("context_management")
    return Plan(messages, tools, required, parallel, _effort(body), images, labels, _marked(attrs.asdict(body)))


def unhonoured(body: MessagesRequest) -> list[str]:
    """The generation fields accepted but not honoured (the prompt's own are in ``Plan.labels``)."""
    labels = ["service_tier"] if body.service_tier not in (None, "auto", "standard_only") else []
    return labels + [name for name in ("speed", "diagnostics", "inference_geo") if getattr(body, name) is not None]


def default_max_tokens(context_window: int) -> int:
    """The budget of a request that names none: half the context, at most 4096."""
    return max(1, min(context_window // 2, 4096))


def sampling_params(body: MessagesRequest, p: Plan, *, defaults: Mapping[str, float], max_tokens: int) -> SamplingParams:
    """Each sampling field from the request, else the model's default; the tools' grammar (one
    call at most: the guardrails keep the first when parallel calls are refused)."""
    thinking = body.thinking or {}
    budget = thinking.get("budget_tokens") if thinking.get("type") == "enabled" else None
    return sampling(
        defaults, {name: getattr(body, name) for name in ("temperature", "top_p", "top_k")},
        max_tokens=max_tokens, stop=tuple(s for s in body.stop_sequences or () if s),
        grammar=grammar_for(tools=p.tools, call_required=p.call_required, parallel=False),
        reasoning_budget=budget,  # a hard cap, and an effort for the template (``_effort``)
    )


# --- the conversation ------------------------------------------------------------------------


def _marked(value: Any) -> bool:
    """Whether ``cache_control`` appears anywhere in a block structure."""
    if isinstance(value, Mapping):
        return value.get("cache_control") is not None or any(_marked(v) for v in value.values())
    if isinstance(value, list):
        return any(_marked(v) for v in value)
    return False


def _text_blocks(blocks: Sequence[Mapping[str, Any]], where: str) -> str:
    texts = []
    for b in blocks:
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise RequestInvalid(f"{where}: expected text blocks")
        texts.append(b["text"])
    return "\n".join(texts)


def _image_url(block: Mapping[str, Any], where: str) -> str:
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise RequestInvalid(f"{where}.source must be an object")
    if source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise RequestInvalid(f"{where}.source.type {source.get('type')!r} is not supported (base64 or url)")


def _tool_result(block: Mapping[str, Any], where: str, urls: list[str]) -> TemplateMessage:
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise RequestInvalid(f"{where}.content[{i}] must be a content block")
            if part.get("type") == "image":
                urls.append(_image_url(part, f"{where}.content[{i}]"))
            elif part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise RequestInvalid(f"{where}.content[{i}]: a tool result holds text and image blocks")
        content = "\n".join(texts)
    if not isinstance(content, str) or not isinstance(block.get("tool_use_id"), str):
        raise RequestInvalid(f"{where}: a tool_result needs a tool_use_id and text content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _conversation(
    body: CountTokensRequest, labels: list[str], vision: bool = False
) -> tuple[list[TemplateMessage], list[str]]:
    out: list[TemplateMessage] = []
    urls: list[str] = []
    if body.system is not None:
        system_text = body.system if isinstance(body.system, str) else _text_blocks(body.system, "system")
        out.append({"role": "system", "content": system_text})
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        allowed = _USER_BLOCKS if m.role == "user" else _ASSISTANT_BLOCKS
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        results: list[TemplateMessage] = []
        parts: list[tuple[str, Any]] = []  # text and images in order (a vision model's)
        for j, block in enumerate(m.content):
            kind, at = block["type"], f"{where}.content[{j}]"
            if kind not in allowed:
                raise RequestInvalid(f"{at}: a {kind!r} block is not supported in a {m.role} message")
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise RequestInvalid(f"{at}.text must be a string")
                texts.append(block["text"])
                parts.append(("text", block["text"]))
            elif kind == "image":
                urls.append(_image_url(block, at))
                parts.append(("image", urls[-1]))
            elif kind == "tool_result":
                results.append(_tool_result(block, at, urls))
            elif kind == "document":
                if "document_blocks" not in labels:
                    labels.append("document_blocks")
            elif kind in ("tool_use", "mcp_tool_use"):
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise RequestInvalid(f"{at}: a {kind} block needs an id and a name")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input") or {}}})
            elif kind == "mcp_tool_result":  # the server ran a call this turn made: its result, then the turn goes on
                if texts or calls:
                    out.append(_said(m.role, texts, calls, reasoning))
                    texts, calls, reasoning = [], [], []
                out.append(_tool_result(block, at, urls))
            elif kind == "thinking" and isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        out.extend(results)
        seen = vision and any(kind == "image" for kind, _ in parts)
        if texts or calls or seen:
            msg = _said(m.role, texts, calls, reasoning)
            if seen:
                msg["content"] = with_images(parts, where)
            out.append(msg)
    return out, urls


def _said(role: str, texts: list[str], calls: list[dict[str, Any]], reasoning: list[str]) -> TemplateMessage:
    msg: TemplateMessage = {"role": role, "content": "\n".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    return msg


# --- tools and reasoning ---------------------------------------------------------------------


def _tools(body: CountTokensRequest) -> tuple[dict[str, Any], ...]:
    """Client tools in the chat shape; server tools (run by Anthropic's own servers) refused."""
    nested = []
    server = []
    for i, tool in enumerate(body.tools or ()):
        kind = tool.get("type", "custom")
        if kind == "mcp_toolset":
            continue  # narrows an MCP server of mcp_servers (turns.mcp_uses)
        if kind != "custom":
            server.append(f"{tool.get('name', '?')} ({kind})")
            continue
        if "input_schema" in tool and not isinstance(tool["input_schema"], dict):
            raise RequestInvalid(f"tools[{i}].input_schema must be a JSON Schema object")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        nested.append({"type": "function", "function": function})
    if server:
        raise RequestInvalid(
            "this server cannot run server tools: " + ", ".join(server)
            + "; offer them as client tools (with an input_schema) instead"
        )
    return function_tools(nested)


def _tool_choice(choice: Mapping[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool]:
    """The chat ``tool_choice`` and whether parallel calls are allowed."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise RequestInvalid('tool_choice.type must be "auto", "any", "tool" (with a name) or "none"')


def _effort(body: CountTokensRequest) -> dict[str, Any]:
    """``thinking`` and ``output_config.effort`` as the template's reasoning switches."""
    effort = None
    thinking = body.thinking or {}
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise RequestInvalid("thinking.budget_tokens must be a positive integer")
        effort = "low" if budget < 4000 else "medium" if budget < 16000 else "high"
    elif kind == "adaptive":
        effort = "medium"
    elif kind == "disabled":
        effort = "none"
    elif kind is not None:
        raise RequestInvalid('thinking.type must be "enabled", "adaptive" or "disabled"')
    wanted = (body.output_config or {}).get("effort")
    if wanted is not None:
        if not isinstance(wanted, str) or wanted not in _EFFORTS:
            raise RequestInvalid('output_config.effort must be "low", "medium", "high" or "max"')
        effort = _EFFORTS[wanted] if effort != "none" else effort
    if effort is None:
        return {}
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"}
