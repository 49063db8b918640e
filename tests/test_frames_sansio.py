"""The route families' sans-io translation and framers, without a server: an Anthropic
Messages stream, a Responses stream, an OpenAI chat stream and an Ollama stream fed a turn's
events (a text turn, a tool-use turn with its argument deltas, a reasoning turn, text and call
interleaved), the same turns whole, and the requests translated into the core's prompt."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

from turbospark.messages import Started
from turbospark.model.output import ToolCall
from turbospark.turns.turn_events import (
    ArgumentsDelta, CallEnd, CallStart, Collected, Finish, Reasoning, Text, Usage, split_arguments,
)
from turbospark.routes.anthropic_events import MessageStream
from turbospark.routes.anthropic_request import normalise, plan, sampling_params
from turbospark.routes.openai_responses_events import ResponseStream
from turbospark.routes.openai_responses_request import plan as responses_plan
from turbospark.routes.openai_responses_request import said
from turbospark.wire.anthropic import MessagesRequest
from turbospark.wire.codec import structure
from turbospark.wire.openai import ResponsesRequest


def _frames(raw: list[bytes]) -> list[tuple[str, dict]]:
    """(event name, payload) for each SSE frame; a comment frame is ("", {})."""
    out = []
    for frame in raw:
        text = frame.decode()
        assert text.endswith("\n\n")
        if text.startswith(":"):
            out.append(("", {}))
            continue
        name, data = text.strip().split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == name.removeprefix("event: ")
        out.append((payload["type"], payload))
    return out


def _fin(reason: str = "stop", stop_reason: str = "EndOfSequence", completion: int = 3, called: bool = False) -> list:
    """A choice's finish and the turn's usage."""
    return [Finish(reason, stop_reason, None, called, completion), Usage(10, completion, 4)]  # type: ignore[arg-type]


CALL = ToolCall(0, "call_abc", "get_weather", '{"city": "Oslo"}')


def _call(call: ToolCall = CALL) -> list:
    """A call as the turn stream sends it: start, argument pieces, end."""
    pieces = [ArgumentsDelta(call.index, p) for p in split_arguments(call.arguments)]
    return [CallStart(call.index, call.id, call.name), *pieces, CallEnd(call)]


def _feed(framer, events: list) -> list[bytes]:
    return [frame for event in events for frame in (framer.tick() if event is None else framer.feed(event))]


def test_the_modules_import_neither_trio_nor_quart() -> None:
    for name in ("anthropic_events", "anthropic_request", "openai_responses_events", "openai_responses_request",
                 "openai_chat_events", "ollama_events"):
        tree = ast.parse(Path(importlib.import_module(f"turbospark.routes.{name}").__file__).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {m for m in imported if m.split(".")[0] in ("trio", "quart", "quart_trio")}, name
        assert not imported & {"_generation", "_openai", "web.app"}, name  # (relative: no dots)


# --- Anthropic ---------------------------------------------------------------------------------


def test_anthropic_streamed_text_turn() -> None:
    m = MessageStream("msg_1", "m", cache_marked=False, began=Started(10, 4))
    frames = m.opening() + _feed(m, [Text("Hel"), None, Text("lo"), *_fin()])  # None: a quiet interval, a ping
    events = _frames(frames)
    assert [e for e, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "ping",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["usage"] == {"input_tokens": 6, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 4, "output_tokens": 0}
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(p["delta"]["text"] for e, p in events if e == "content_block_delta") == "Hello"
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 3 and end["usage"]["input_tokens"] == 6


def test_anthropic_tool_use_turn_text_call_text() -> None:
    m = MessageStream("msg_2", "m", cache_marked=True)
    turn = [Text("Checking."), *_call(), Text("Done."), *_fin(called=True)]
    events = _frames(m.opening() + _feed(m, turn))
    assert [e for e, _ in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_stop",  # text, index 0
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
        "content_block_stop",  # tool_use, index 1, its input in pieces
        "content_block_start", "content_block_delta", "content_block_stop",  # text, index 2
        "message_delta", "message_stop",
    ]
    block = events[5][1]
    assert block["index"] == 1
    assert block["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}
    pieces = [events[i][1]["delta"] for i in (6, 7, 8)]
    assert {p["type"] for p in pieces} == {"input_json_delta"}
    assert "".join(p["partial_json"] for p in pieces) == '{"city": "Oslo"}'
    assert events[10][1]["index"] == 2
    end = events[-2][1]
    assert end["delta"]["stop_reason"] == "tool_use"
    # cache_control marked: the prompt not read from cache was written to it
    assert end["usage"] == {"input_tokens": 0, "cache_creation_input_tokens": 6,
                            "cache_read_input_tokens": 4, "output_tokens": 3}
    whole = MessageStream("msg_2", "m", cache_marked=True).whole(Collected.of(turn))
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use", "text"]
    assert whole["content"][1]["input"] == {"city": "Oslo"} and whole["stop_reason"] == "tool_use"


def test_anthropic_reasoning_turn_and_the_same_turn_whole() -> None:
    m = MessageStream("msg_3", "m", cache_marked=False, began=Started(10))
    turn = [Reasoning("Think"), Reasoning("ing."), Text("Answer."), *_fin("length", "Length")]
    events = _frames(m.opening() + _feed(m, turn))
    assert [e for e, _ in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_delta", "content_block_stop",  # thinking: its deltas, then its signature
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    assert events[2][1]["content_block"]["type"] == "thinking"
    assert [events[i][1]["delta"]["type"] for i in (3, 4, 5)] == ["thinking_delta", "thinking_delta", "signature_delta"]
    assert events[7][1]["index"] == 1 and events[7][1]["content_block"]["type"] == "text"
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    whole = MessageStream("msg_4", "m", cache_marked=False).whole(Collected.of(turn))
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0]["thinking"] == "Thinking." and whole["stop_reason"] == "max_tokens"


def test_anthropic_a_retried_turn_says_so() -> None:
    turn = [Text("x"), Finish("stop", "EndOfTurn", None, False, 9), Usage(30, 9, 20, retries=1)]
    whole = MessageStream("msg_5", "m", cache_marked=False).whole(Collected.of(turn))
    assert whole["usage"]["retries"] == 1 and whole["usage"]["output_tokens"] == 9


def test_anthropic_request_translation() -> None:
    raw = normalise({
        "model": "m", "max_tokens": 50, "stop_sequences": ["END", ""],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "use the tool"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        ],
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 5000},
    })
    body = structure(raw, MessagesRequest)
    p = plan(body, default_system="ignored: the request has its own")
    assert [m["role"] for m in p.messages] == ["system", "user", "assistant", "tool"]
    assert p.messages[0]["content"] == "Be brief."
    assert p.messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert p.messages[2]["reasoning_content"] == "use the tool"
    assert p.messages[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert p.call_required and not p.parallel and p.cache_marked
    assert p.template_kwargs == {"reasoning_effort": "medium", "enable_thinking": True}
    assert p.labels == []  # the budget is enforced (``SamplingParams.reasoning_budget``)
    assert p.prompt.tools == p.tools and len(p.tools) == 1
    params = sampling_params(body, p, defaults={"temperature": 0.6}, max_tokens=50)
    assert params.stop == ("END",) and params.max_tokens == 50 and params.temperature == 0.6
    assert params.reasoning_budget == 5000
    assert params.grammar is not None  # a call is required


# --- Responses ---------------------------------------------------------------------------------


def _body(**fields) -> ResponsesRequest:
    return structure({"model": "m", "input": "hi", **fields}, ResponsesRequest)


def test_responses_streamed_text_turn() -> None:
    kept = []
    r = ResponseStream("resp_1", "m", _body(), keep=kept.append)
    frames = r.opening() + _feed(r, [Text("Hel"), None, Text("lo"), *_fin()])  # None: a comment frame
    events = _frames(frames)
    assert [e for e, _ in events] == [
        "response.created", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    numbered = [p["sequence_number"] for e, p in events if e]
    assert numbered == list(range(len(numbered)))
    assert events[6][1]["text"] == "Hello"
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["usage"]["input_tokens"] == 10
    assert [i["type"] for i in final["output"]] == ["message"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert kept == [final]


def test_responses_tool_use_turn() -> None:
    r = ResponseStream("resp_2", "m", _body())
    events = _frames(r.opening() + _feed(r, [*_call(), *_fin(called=True)]))
    assert [e for e, _ in events] == [
        "response.created", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]
    assert events[1][1]["item"]["status"] == "in_progress" and events[1][1]["item"]["arguments"] == ""
    assert "".join(events[i][1]["delta"] for i in (2, 3, 4)) == '{"city": "Oslo"}'
    assert {events[i][1]["item_id"] for i in (2, 3, 4, 5)} == {"fc_call_abc"}
    item = events[6][1]["item"]
    assert item == {"id": "fc_call_abc", "type": "function_call", "call_id": "call_abc",
                    "name": "get_weather", "arguments": '{"city": "Oslo"}', "status": "completed"}
    # the output as the assistant's turn, for a conversation that continues it
    assert said(r.output) == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
    ]}]


def test_responses_reasoning_turn_one_output_index_per_item() -> None:
    r = ResponseStream("resp_3", "m", _body())
    turn = [Reasoning("Think"), Reasoning("ing."), Text("Answer."), *_call(), *_fin("length", "Length")]
    events = _frames(r.opening() + _feed(r, turn))
    assert [e for e, _ in events][:13] == [
        "response.created",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",  # the reasoning item, index 0
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",  # index 1
        "response.output_item.added",  # the call, index 2
    ]
    assert {p["output_index"] for e, p in events[1:6]} == {0}
    assert {p["output_index"] for e, p in events[6:12]} == {1}
    assert {p["output_index"] for e, p in events[12:-1]} == {2}
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Thinking."}]

    # the same turn whole: the same items, in the same order, no events
    whole = ResponseStream("resp_4", "m", _body()).whole(Collected.of(turn))
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message", "function_call"]


def test_responses_failed_event() -> None:
    r = ResponseStream("resp_5", "m", _body())
    error = {"message": "boom", "type": "server_error", "param": None, "code": None}
    (name, payload), = _frames(r.error({"error": error}))
    assert name == "response.failed"
    assert payload["response"]["status"] == "failed" and payload["response"]["error"] == error


def test_responses_request_translation() -> None:
    body = _body(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "name": "get_weather", "call_id": "c1", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call", "name": "get_weather", "call_id": "c2", "arguments": "not json"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "summary": []},
        ],
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        tool_choice="required",
        reasoning={"effort": "low"},
    )
    history = ({"role": "user", "content": "earlier"}, {"role": "assistant", "content": "yes"})
    p = responses_plan(body, history, default_system="unused")
    assert [m["role"] for m in p.conversation] == ["user", "assistant", "user", "assistant", "tool"]
    assert [m["role"] for m in p.prompt.messages] == ["system", *[m["role"] for m in p.conversation]]
    calls = p.conversation[3]["tool_calls"]  # parallel calls: one assistant turn
    assert [c["function"]["arguments"] for c in calls] == [{"city": "Oslo"}, "not json"]
    assert p.call_required and p.grammar is not None
    assert p.prompt.template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}


# --- OpenAI chat -------------------------------------------------------------------------------


def test_chat_stream_a_call_as_argument_deltas_at_one_index() -> None:
    from turbospark.routes.openai_chat_events import ChatStream, Envelope, chat_whole

    env = Envelope("chatcmpl-1", 1, "m", "fp")
    turn = [Text("Sure. "), *_call(), Text(" Then."), Finish("stop", "EndOfTurn", None, True, 3),
            Usage(10, 3, 4, retries=1)]
    chat = ChatStream(env, include_usage=True)
    frames = chat.opening() + _feed(chat, turn)
    assert frames[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(f.decode().removeprefix("data: ")) for f in frames[:-1]]
    deltas = [c["choices"][0]["delta"] if c["choices"] else None for c in chunks]
    assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "Sure. "}]
    assert deltas[2] == {"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                                         "function": {"name": "get_weather", "arguments": ""}}]}
    pieces = [d["tool_calls"][0] for d in deltas[3:6]]
    assert all(p.keys() == {"index", "function"} and p["index"] == 0 for p in pieces)
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"city": "Oslo"}'
    assert deltas[6] == {"content": " Then."}
    assert chunks[7]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[8]["usage"]["completion_tokens"] == 3 and chunks[8]["usage"]["retries"] == 1
    whole = chat_whole(env, Collected.of(turn), None)
    message = whole["choices"][0]["message"]
    assert message["content"] == "Sure.  Then." and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert whole["usage"]["retries"] == 1 and whole["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_a_call_cut_by_the_budget_is_length() -> None:
    from turbospark.routes.openai_chat_events import finish_reason

    assert finish_reason(Finish("length", "MaxTokens", None, True, 3)) == "length"
    assert finish_reason(Finish("stop", "EndOfTurn", None, True, 3)) == "tool_calls"
    assert finish_reason(Finish("stop", "EndOfTurn", None, False, 3)) == "stop"


# --- Ollama ------------------------------------------------------------------------------------


def test_ollama_stream_pieces_a_whole_call_and_the_counters() -> None:
    from turbospark.routes.ollama_events import OllamaStream

    now = iter(range(100))
    out = OllamaStream("chat", "m", clock=lambda: float(next(now)))
    out.started = 0.5  # the clock read 0 at the start, 1 at the first piece
    turn = [Reasoning("Hm."), Text("Sure."), *_call(), Finish("stop", "EndOfTurn", None, True, 5), Usage(10, 5, 0, 1)]
    objects = [json.loads(line) for f in _feed(out, [None, *turn]) for line in f.decode().splitlines()]
    assert objects[0]["message"] == {"role": "assistant", "content": ""} and not objects[0]["done"]  # a tick
    assert objects[1]["message"] == {"role": "assistant", "content": "", "thinking": "Hm."}
    assert objects[2]["message"]["content"] == "Sure."
    assert objects[3]["message"]["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    final = objects[4]
    assert final["done"] and final["done_reason"] == "stop" and final["retries"] == 1
    assert final["eval_count"] == 5 and final["prompt_eval_count"] == 10
    assert final["prompt_eval_duration"] == 500_000_000
    whole = OllamaStream("chat", "m").whole(Collected.of(turn))
    assert whole["message"]["content"] == "Sure." and whole["message"]["thinking"] == "Hm."
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
