"""The turn's event stream without a server: the holdback of what may begin a call, calls as
argument deltas, validation holding a refused call back for the corrective retry, usage over
every attempt, and the events collected into a whole response."""

from __future__ import annotations

import ast
import importlib
import itertools
import json
from pathlib import Path

import pytest

from turbospark.messages import Delta, Finished
from turbospark.model.call_reader import JsonCallReader, read_head
from turbospark.model.output import CallPiece, Dialect, OutputParser, Parts, ToolCall
from turbospark.turns.guardrails import Guardrails
from turbospark.turns.holdback import Holdback, Release, Span
from turbospark.turns.turn_events import (
    ArgumentsDelta, CallEnd, CallStart, Collected, Finish, Reasoning, Retried, Text, Usage,
    arguments_object, split_arguments,
)
from turbospark.turns.turn_stream import TurnStream

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = (WEATHER,)


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _fin(reason: str = "stop", completion: int = 5, index: int = 0, prompt: int = 20) -> Finished:
    return Finished(reason, "EndOfTurn" if reason == "stop" else "MaxTokens", None, prompt, completion, 4, index)  # type: ignore[arg-type]


def _stream(**kw) -> TurnStream:
    return TurnStream(tools=kw.pop("tools", TOOLS), guardrails=kw.pop("guardrails", Guardrails()), new_id=_ids(), **kw)


def _feed(ts: TurnStream, *msgs) -> list[list]:
    """The events of each reply, one list per reply."""
    return [ts.feed(m) for m in msgs]


def test_the_modules_are_sans_io() -> None:
    for name in ("turn_events", "turn_stream", "holdback"):
        tree = ast.parse(Path(importlib.import_module(f"turbospark.turns.{name}").__file__).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in imported if m.split(".")[0] in ("trio", "quart", "quart_trio")}, name


# --- holdback ---------------------------------------------------------------------------------


def _hold(*pieces: str) -> tuple[list, str]:
    h = Holdback()
    out = [x for p in pieces for x in h.feed(p)]
    return out, h.finish()


def test_prose_and_code_pass_at_once() -> None:
    out, left = _hold("Sure, ", "in code: if (x) { return 1; } ", "and [1, 2]. The <b>end</b>")
    assert all(isinstance(x, Release) for x in out) and left == ""
    assert "".join(x.text for x in out) == "Sure, in code: if (x) { return 1; } and [1, 2]. The <b>end</b>"


def test_a_bare_object_is_held_until_it_closes() -> None:
    h = Holdback()
    assert h.feed("Let me check. ") == [Release("Let me check. ")]
    assert h.feed('{"na') == []  # may be a call
    assert h.feed('me": "get_weather", "arguments": {"city": "}"') == []  # a brace inside a string
    assert h.feed('}} Done') == [Span('{"name": "get_weather", "arguments": {"city": "}"}}'), Release(" Done")]


@pytest.mark.parametrize("span", [
    '<tool_call>{"name": "x"}</tool_call>', '[TOOL_CALLS] [{"name": "x", "arguments": {}}]',
    '<|python_tag|>{"name": "x"}', "call:get_weather{city: 'Oslo'}", '<function=x><parameter=a>1</parameter></function>',
    '[{"name": "x", "arguments": {}}]',
])
def test_other_markups_are_held_until_they_close(span: str) -> None:
    pieces = [span[i : i + 3] for i in range(0, len(span), 3)]
    out, left = _hold("a ", *pieces, " b")
    assert out == [Release("a "), Span(span), Release(" b")] and left == ""


def test_an_unfinished_span_is_handed_back_at_the_end() -> None:
    assert _hold("x ", '{"name": "get_') == ([Release("x ")], '{"name": "get_')
    assert _hold("the call: it", " rang c") == ([Release("the call: it"), Release(" rang ")], "c")


# --- arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ['{"city": "Oslo"}', '{"a": {"b": [1, 2]}, "c": "x,y:z"}', "{}", '{"q": "\\"}"}'])
def test_arguments_split_into_pieces_that_join(text: str) -> None:
    pieces = split_arguments(text)
    assert "".join(pieces) == text
    if text != "{}":
        assert len(pieces) >= 3


def test_arguments_as_an_object() -> None:
    assert arguments_object('{"a": 1}') == {"a": 1}
    assert arguments_object("[1]") == {"value": [1]}
    assert arguments_object('{"a": ') == {} and arguments_object("") == {}


# --- the stream -------------------------------------------------------------------------------


def test_prose_with_tools_streams_piece_by_piece() -> None:
    ts = _stream()
    steps = _feed(ts, Delta("", reasoning="Hm."), Delta("The "), Delta("answer "), Delta("is 4."), _fin())
    assert steps[0] == [Reasoning("Hm.")]
    assert steps[1:4] == [[Text("The ")], [Text("answer ")], [Text("is 4.")]]
    assert steps[4] == [Finish("stop", "EndOfTurn", None, False, 5), Usage(20, 5, 4, 0)]
    assert ts.done and ts.again is None


def test_a_bare_call_is_rescued_in_place_text_call_text() -> None:
    ts = _stream()
    steps = _feed(ts, Delta("Checking. "), Delta('{"name": "get_weather", '), Delta('"arguments": {"city": "Oslo"}}'),
                  Delta(" Then more."), _fin())
    assert steps[0] == [Text("Checking. ")] and steps[1] == []
    start, *deltas, end = steps[2]
    assert start == CallStart(0, "call_0", "get_weather")
    assert len(deltas) >= 3 and "".join(d.text for d in deltas) == '{"city": "Oslo"}'
    assert end == CallEnd(ToolCall(0, "call_0", "get_weather", '{"city": "Oslo"}'))
    assert steps[3] == [Text(" Then more.")]
    assert steps[4][0] == Finish("stop", "EndOfTurn", None, True, 5)
    whole = Collected.of([e for s in steps for e in s])
    assert [k for k, _ in whole.choices[0].parts] == ["text", "call", "text"]


def test_a_native_call_is_sent_as_soon_as_it_is_complete() -> None:
    call = ToolCall(0, "call_x", "get_weather", '{"city": "Oslo"}')
    ts = _stream()
    steps = _feed(ts, Delta("Sure. "), Delta(""), Delta("", tool_calls=(call,)), _fin())
    assert steps[0] == [Text("Sure. ")] and steps[1] == []
    assert steps[2][0] == CallStart(0, "call_x", "get_weather") and steps[2][-1] == CallEnd(call)


def test_a_refused_call_is_held_and_retried_before_any_of_it_is_sent() -> None:
    wrong = ToolCall(0, "call_w", "get_weather", '{"town": "Oslo"}')
    right = ToolCall(0, "call_r", "get_weather", '{"city": "Oslo"}')
    ts = _stream()
    steps = _feed(ts, Delta("Let me see. "), Delta("", tool_calls=(wrong,)), Delta(" ok"), _fin(completion=7))
    assert steps[0] == [Text("Let me see. ")] and steps[1] == [] and steps[2] == []
    (retried,) = steps[3]
    assert isinstance(retried, Retried) and retried.attempt == 1 and "town" in retried.nudge or "city" in retried.nudge
    said, nudge = ts.again.turns
    assert said["role"] == "assistant" and said["content"] == "Let me see.  ok"
    assert said["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"town": "Oslo"}}
    assert nudge["role"] == "user"
    ts.retry_started()
    steps = _feed(ts, Delta("", tool_calls=(right,)), _fin(completion=3, prompt=40))
    assert steps[0][0] == CallStart(0, "call_r", "get_weather")
    assert steps[1] == [Finish("stop", "EndOfTurn", None, True, 10), Usage(60, 10, 8, 1)]


def test_when_no_retry_is_left_the_refused_call_goes_out_as_it_is() -> None:
    wrong = ToolCall(0, "call_w", "get_weather", '{"town": "Oslo"}')
    ts = _stream(guardrails=Guardrails(retries=0))
    steps = _feed(ts, Delta("", tool_calls=(wrong,)), _fin())
    assert steps[0][-1] == CallEnd(wrong)  # sent at once: there is nothing to wait for
    ts = _stream()
    _feed(ts, Delta("", tool_calls=(wrong,)), _fin())
    ts.retry_started()
    steps = _feed(ts, Delta("", tool_calls=(wrong,)), _fin())
    assert steps[0][-1] == CallEnd(wrong) and steps[1][-1] == Usage(40, 10, 8, 1)


def test_a_required_call_that_never_came_is_asked_for_again() -> None:
    ts = _stream(call_required=True)
    steps = _feed(ts, Delta("I would rather chat."), _fin())
    assert steps[0] == [Text("I would rather chat.")]  # sent stays sent
    assert isinstance(steps[1][0], Retried) and ts.again.turns[-1]["content"].startswith("You must answer with a tool call")


def test_guardrails_off_leave_bare_json_as_text() -> None:
    ts = _stream(guardrails=Guardrails.off())
    text = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert _feed(ts, Delta(text))[0] == [Text(text)]


def test_without_parallel_calls_the_first_call_stands() -> None:
    a, b = (ToolCall(i, f"call_{i}", "get_weather", '{"city": "Oslo"}') for i in range(2))
    ts = _stream(parallel=False)
    steps = _feed(ts, Delta("", tool_calls=(a, b)), _fin())
    assert [e for e in steps[0] if isinstance(e, CallEnd)] == [CallEnd(a)]


def test_a_forced_call_cut_by_the_budget_comes_back_as_far_as_it_got() -> None:
    ts = _stream(call_required=True)
    steps = _feed(ts, Delta('<tool_call>\n{"name":"get_weather","arguments":{"city":"Os'), _fin("length"))
    assert steps[0] == []
    end = next(e for e in steps[1] if isinstance(e, CallEnd))
    assert end.call.name == "get_weather" and end.call.arguments == '{"city":"Os'
    assert not [e for e in steps[1] if isinstance(e, Text)]
    assert steps[1][-2] == Finish("length", "MaxTokens", None, True, 5)


def test_several_choices_are_rescued_each_and_never_retried() -> None:
    ts = _stream(n=2)
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    steps = _feed(ts, Delta(call, index=0), Delta("Prose.", index=1), _fin(index=1), _fin(index=0))
    assert isinstance(steps[0][-1], CallEnd) and steps[1] == [Text("Prose.", 1)]
    assert steps[2] == [Finish("stop", "EndOfTurn", None, False, 5, 1)]
    assert steps[3][-1] == Usage(20, 10, 4, 0)
    whole = Collected.of([e for s in steps for e in s], n=2)
    assert whole.choices[0].calls[0].arguments == '{"city": "Oslo"}' and whole.choices[1].text == "Prose."
    assert json.loads(whole.choices[0].calls[0].arguments) == {"city": "Oslo"}


# --- calls read as they are written -----------------------------------------------------------


@pytest.mark.parametrize("text, head", [
    ('{"name": "get_weather", "arguments": {', ("get_weather", 37)),
    ('\n{"name":"get_weather","parameters":{"city"', ("get_weather", 36)),
    ('{"name": "get_we', None),  # may still be
    ('{"name": "get_weather", "argu', None),
    ('{"arguments": {}, "name": "get_weather"}', False),  # name first, or not read as written
    ('[{"name": "get_weather"', False),  # a list of calls
    ('{"name": "get_weather", "arguments": "{\\"city', False),  # arguments as a JSON string
    ('<function=get_weather>', False),
])
def test_a_calls_head_is_read_as_it_grows(text: str, head) -> None:
    assert read_head(text) == head


def test_the_arguments_are_read_up_to_their_closing_brace() -> None:
    reader = JsonCallReader({"get_weather"})
    pieces = [reader.feed(p) for p in ('{"name": "get_w', 'eather", "arguments": {"ci', 'ty": "a}b\\"', '", "n": [1, {}]', '}}', "\n")]
    assert pieces == ["", '{"ci', 'ty": "a}b\\"', '", "n": [1, {}]', "}", ""]
    assert reader.closed and reader.arguments == '{"city": "a}b\\"", "n": [1, {}]}'
    unknown = JsonCallReader({"get_weather"})
    assert unknown.feed('{"name": "rm_rf", "arguments": {"path": "/"}}') == "" and unknown.name is None


def _pieces_of(parser: OutputParser, text: str, step: int = 3) -> Parts:
    parts = Parts()
    for at in range(0, len(text), step):
        parts += parser.feed(text[at : at + step])
    return parts + parser.finish()


def test_the_parser_gives_out_a_json_call_as_it_is_written() -> None:
    parts = _pieces_of(OutputParser(Dialect(), tools=TOOLS), 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call> Done.')
    (call,) = parts.calls
    assert len(parts.writing) >= 4 and {(p.index, p.id, p.name) for p in parts.writing} == {(0, call.id, "get_weather")}
    assert "".join(p.text for p in parts.writing) == call.arguments == '{"city": "Oslo"}'
    assert parts.content == "Sure.  Done."


def test_a_harmony_call_is_given_out_as_it_is_written() -> None:
    text = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|> {"city": "Oslo"} <|call|>'
    parts = _pieces_of(OutputParser(Dialect(harmony=True, name="harmony"), tools=TOOLS), text)
    assert "".join(p.text for p in parts.writing) == parts.calls[0].arguments == '{"city": "Oslo"}'


def test_a_call_written_and_then_cut_stands_as_far_as_it_got() -> None:
    parts = _pieces_of(OutputParser(Dialect(), tools=TOOLS), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os')
    assert parts.content == "" and [(c.name, c.arguments) for c in parts.calls] == [("get_weather", '{"city": "Os')]
    assert "".join(p.text for p in parts.writing) == '{"city": "Os'


def test_a_block_that_names_no_offered_tool_is_not_given_out() -> None:
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}\n</tool_call>'
    parts = _pieces_of(OutputParser(Dialect(), tools=TOOLS), text)
    assert not parts.writing and not parts.calls and parts.content == text


def _written(name: str = "get_weather", pieces=('{"ci', 'ty": "Os', 'lo"}'), id: str = "call_w") -> list[Delta]:
    writing = [Delta("", writing=(CallPiece(0, id, name, p),)) for p in pieces]
    return [*writing, Delta("", tool_calls=(ToolCall(0, id, name, "".join(pieces)),))]


@pytest.mark.parametrize("kw", [
    {"guardrails": Guardrails.off()},
    {"call_required": True},  # its grammar keeps the schema: nothing to check
    {"guardrails": Guardrails(retries=0)},
])
def test_a_call_streams_as_written_when_nothing_must_be_checked_first(kw) -> None:
    ts = _stream(**kw)
    steps = _feed(ts, Delta("Sure. "), *_written(), _fin())
    assert steps[1] == [CallStart(0, "call_w", "get_weather"), ArgumentsDelta(0, '{"ci')]
    assert steps[2] == [ArgumentsDelta(0, 'ty": "Os')] and steps[3] == [ArgumentsDelta(0, 'lo"}')]
    assert steps[4] == [CallEnd(ToolCall(0, "call_w", "get_weather", '{"city": "Oslo"}'))]
    assert steps[5][0] == Finish("stop", "EndOfTurn", None, True, 5)


def test_a_call_that_may_be_retried_goes_out_once_complete_and_checked() -> None:
    ts = _stream()
    steps = _feed(ts, *_written(), _fin())
    assert steps[:3] == [[], [], []]
    assert isinstance(steps[3][0], CallStart) and isinstance(steps[3][-1], CallEnd)
    assert "".join(e.text for e in steps[3] if isinstance(e, ArgumentsDelta)) == '{"city": "Oslo"}'
    ts = _stream()
    steps = _feed(ts, *_written(pieces=('{"town": "Oslo"}',)), _fin())
    assert steps[0] == steps[1] == [] and steps[2] == [Retried(1, steps[2][0].nudge)]  # never seen


def test_live_calls_keep_their_order_and_one_call_per_turn_holds() -> None:
    ts = _stream(guardrails=Guardrails.off())
    first, second = _written(id="a"), _written(id="b")
    steps = _feed(ts, *first, Delta("then "), *second, _fin())
    starts = [e for s in steps for e in s if isinstance(e, CallStart)]
    assert [(s.index, s.id) for s in starts] == [(0, "a"), (1, "b")]
    ts = _stream(guardrails=Guardrails.off(), parallel=False)
    steps = _feed(ts, *first, *second, _fin())
    assert [e.call.id for s in steps for e in s if isinstance(e, CallEnd)] == ["a"]
    assert not [e for s in steps[4:] for e in s if isinstance(e, ArgumentsDelta)]
