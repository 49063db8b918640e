"""Typed output, tool-call rescue and validation, grammars and request checks, without I/O."""

from __future__ import annotations

import json

import jsonschema
import pytest

from turbospark.model.tool_preamble import tools_in_preamble
from turbospark.errors import RequestInvalid
from turbospark.turns.guardrails import (
    Accept,
    Guardrails,
    Rescued,
    Retry,
    cut_short,
    inspect,
    rescue,
    truncated_call,
    validate,
)
from turbospark.model.output import Dialect, OutputParser, Parts, ToolCall
from turbospark.model.scripted import shipped_tokenizer
from turbospark.turns.structured import (
    Grammar,
    check_images,
    closed_objects,
    function_tools,
    grammar_for,
    select_tools,
    shortest_json,
)

from ._support import LANGCHAIN

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER]


def parse(text: str, dialect: Dialect | None = None, *, step: int = 1, **kw: object) -> Parts:
    """Feed ``text`` in ``step``-character pieces (markers split across pieces)."""
    p = OutputParser(dialect or Dialect(), tools=kw.pop("tools", TOOLS), **kw)  # type: ignore[arg-type]
    out = Parts()
    for i in range(0, len(text), step):
        out += p.feed(text[i : i + step])
    return out + p.finish()


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_think_span_and_a_hermes_call_in_any_piece_sizes(step: int) -> None:
    out = parse('<think>plan</think>Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call>', step=step)
    assert out.reasoning == "plan" and out.content == "Checking. "
    (call,) = out.calls
    assert (call.index, call.name, call.arguments) == (0, "get_weather", '{"city":"Oslo"}')  # as written
    assert call.id.startswith("call_")


def test_a_prompt_that_opened_think_starts_in_reasoning() -> None:
    assert parse("still thinking</think>Answer.", in_reasoning=True) == Parts("Answer.", "still thinking")


def test_think_later_in_the_text_is_content_and_no_tools_means_no_calls() -> None:
    assert parse("a <think>b</think>").content == "a <think>b</think>"
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert parse(text, tools=()).content == text


def test_a_call_to_an_unknown_tool_or_bad_json_is_released_as_content() -> None:
    for text in ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "<tool_call>{oops</tool_call>"]:
        out = parse("Hi " + text)
        assert out.calls == () and out.content == "Hi " + text


def test_harmony_channels() -> None:
    harmony = Dialect(harmony=True)
    out = parse("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Done.", harmony, step=2)
    assert out == Parts("Done.", "Think.")
    out = parse('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}', harmony)
    assert [(c.name, c.arguments) for c in out.calls] == [("get_weather", '{"city":"Oslo"}')]


def test_model_dialects_from_their_templates() -> None:
    mistral = Dialect.detect("{{ '[TOOL_CALLS]' }}", [])
    out = parse('Sure [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', mistral)
    assert out.content == "Sure " and [c.name for c in out.calls] == ["get_weather"]
    qwen_xml = '<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>'
    assert json.loads(parse(qwen_xml).calls[0].arguments) == {"city": "Oslo"}
    assert Dialect.detect(None, ["<|channel|>", "<|message|>"]).harmony
    assert Dialect.detect("plain {{ messages }}", []).name == "hermes"


def test_the_shipped_tokenizer_shows_markup_specials_and_hides_the_rest() -> None:
    tok = shipped_tokenizer()
    ids = tok.encode("<|im_start|>Hi")
    assert tok.decode_visible(ids) == "Hi"  # a control token that is not markup is dropped


@pytest.mark.parametrize(
    "text",
    [
        'I will call {"name": "get_weather", "arguments": {"city": "Oslo"}} now',
        "get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>",
        "<function=get_weather><parameter=city>Oslo</parameter></function>",
        'call:get_weather{city: "Oslo"}',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city":"Oslo"}<|tool_call_end|>',
        '<invoke name="get_weather"><parameter name="city">Oslo</parameter></invoke>',
    ],
    ids=["bare-json", "glm", "qwen-xml", "gemma", "mistral", "llama", "kimi", "minimax"],
)
def test_rescue_reads_every_common_markup(text: str) -> None:
    ((name, arguments),) = rescue(text, TOOLS)
    assert name == "get_weather" and json.loads(arguments) == {"city": "Oslo"}


def test_rescue_ignores_tools_that_were_not_offered() -> None:
    assert rescue('{"name": "rm_rf", "arguments": {}}', TOOLS) == []


def test_validation_names_what_is_wrong() -> None:
    bad = [ToolCall(0, "a", "get_weather", '{"unit": "k"}'), ToolCall(1, "b", "nope", "{}")]
    first, second = validate(bad, TOOLS)
    assert first.startswith("Your call to `get_weather` had invalid arguments:")
    assert "'city' is a required property" in first and "unit: 'k' is not one of" in first
    assert second == "There is no tool named `nope`; the tools are `get_weather`."
    assert validate([ToolCall(0, "a", "get_weather", '{"city": "Oslo"}')], TOOLS) == []


def test_verdicts() -> None:
    ids = iter(["r0", "r1"])
    common = dict(tools=TOOLS, guardrails=Guardrails(), new_id=lambda: next(ids))
    assert inspect(content="Hello", calls=(), call_required=False, **common) == Accept()
    assert isinstance(inspect(content="Hello", calls=(), call_required=True, **common), Retry)
    verdict = inspect(content='{"name": "get_weather", "arguments": {"city": "Oslo"}}', calls=(), call_required=False, **common)
    assert verdict == Rescued((ToolCall(0, "r0", "get_weather", '{"city": "Oslo"}'),))
    verdict = inspect(content="", calls=(ToolCall(0, "x", "get_weather", "{}"),), call_required=False, **common)
    assert isinstance(verdict, Retry) and verdict.nudge.endswith("Call the tool again with corrected arguments.")
    off = dict(common, guardrails=Guardrails.off())
    assert inspect(content='{"name": "get_weather", "arguments": {}}', calls=(), call_required=True, **off) == Accept()


def test_tools_and_tool_choice_checks() -> None:
    tools = function_tools([WEATHER])
    assert select_tools(tools, "none") == ((), False)
    assert select_tools(tools, None) == (tools, False)
    assert select_tools(tools, "required") == (tools, True)
    assert select_tools(tools, {"type": "function", "function": {"name": "get_weather"}}) == (tools, True)
    for choice, needle in [
        ({"type": "function", "function": {"name": "other"}}, "not among the tools"),
        ({"type": "web"}, "tool_choice must be"),
    ]:
        with pytest.raises(RequestInvalid, match=needle):
            select_tools(tools, choice)
    with pytest.raises(RequestInvalid, match="requires tools"):
        select_tools((), "required")
    for bad, needle in [
        ([{"type": "code_interpreter"}], "only function tools"),
        ([{"type": "function", "function": {"name": "has space"}}], "function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON Schema object"),
        ([WEATHER, WEATHER], "more than once"),
    ]:
        with pytest.raises(RequestInvalid, match=needle):
            function_tools(bad)


def test_image_checks() -> None:
    ok = "data:image/png;base64,AAAA"
    assert check_images([ok, ok]) == 2
    for urls, needle in [
        (["https://example.com/cat.png"], "does not fetch remote images"),
        (["data:image/png;base64"], "expected a comma"),
        (["data:image/png,AAAA"], "not base64-encoded"),
        ([ok] * 65, "too many images: 65 exceeds the 64-image limit"),
    ]:
        with pytest.raises(RequestInvalid, match=needle):
            check_images(urls)


def test_a_template_without_tools_gets_a_preamble_and_text_history() -> None:
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "1", "content": "12C"},
    ]
    system, user, assistant, result = tools_in_preamble(history, TOOLS)
    assert system["content"].startswith("Be brief.\n\nYou can call these tools:") and "<tool_call>" in system["content"]
    assert assistant == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert result == {"role": "user", "content": "<tool_response>\n12C\n</tool_response>"}
    rendered = shipped_tokenizer().render_chat(history, tools=TOOLS)
    assert rendered.count("<tool_call>") == 2 and "<tool_response>" in rendered


def walk(grammar_lark: str, text: str) -> tuple[bool, bool]:
    """Feed ``text``'s tokens through a fresh matcher: (every token allowed, end allowed after)."""
    tok = shipped_tokenizer()
    matcher = tok.grammars.matcher(Grammar(grammar_lark, "response_format"))
    ok = True
    for t in tok.encode(text):
        ok &= bool(matcher.allowed()[t]) and matcher.consume(t)
    return ok, bool(matcher.allowed()[tok.eos_id])


def test_grammars_enforce_schemas_and_forced_calls() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 5}}, "required": ["a"], "additionalProperties": False}
    g = grammar_for(json_schema=schema)
    assert g is not None and g.what == "response_format"
    assert walk(g.lark, '{"a":3}') == (True, True)
    assert walk(g.lark, '{"a":3') == (True, False)  # no end before the object closes
    assert walk(g.lark, '{"a":7}')[0] is False
    assert walk(g.lark, '{"b":1}')[0] is False
    call = grammar_for(tools=function_tools(TOOLS), call_required=True)
    assert call is not None and call.what == "tool_choice"
    good = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    assert walk(call.lark, good) == (True, True)
    assert walk(call.lark, "Sure!")[0] is False
    assert walk(call.lark, '<tool_call>\n{"name":"get_weather","arguments":{}}')[0] is False  # city required
    assert grammar_for() is None


def test_a_schema_feature_that_cannot_be_enforced_is_refused_by_name() -> None:
    tok = shipped_tokenizer()
    g = grammar_for(json_schema={"type": "array", "uniqueItems": True})
    with pytest.raises(RequestInvalid) as err:
        tok.grammars.compile(g)
    assert err.value.param == "response_format"
    assert err.value.message == 'response_format: this schema cannot be enforced: Unimplemented keys: ["uniqueItems"]'


def test_forced_call_schema_is_what_validation_accepts() -> None:
    """The forced call's arguments are valid against the tool's own schema."""
    args = {"city": "Oslo", "unit": "c"}
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    compact = json.dumps({"name": "get_weather", "arguments": args}, separators=(",", ":"))
    assert walk(grammar_for(tools=function_tools(TOOLS), call_required=True).lark,
                f"<tool_call>\n{compact}\n</tool_call>") == (True, True)




def test_forced_json_is_compact_and_objects_without_additional_properties_are_closed() -> None:
    call = grammar_for(tools=function_tools([LANGCHAIN]), call_required=True)
    compact = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    assert walk(call.lark, compact) == (True, True)
    assert walk(call.lark, '<tool_call>\n{"name": "get_weather"')[0] is False  # no free whitespace
    assert walk(call.lark, '<tool_call>\n{"name":"get_weather","arguments":{\n')[0] is False
    # what SmolLM2 wrote before: the closed object has no room for a second key
    assert walk(call.lark, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","type"')[0] is False
    opened = {"function": dict(LANGCHAIN["function"], parameters=dict(
        LANGCHAIN["function"]["parameters"], additionalProperties=True))}
    call = grammar_for(tools=function_tools([opened]), call_required=True)
    assert walk(call.lark, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}}\n</tool_call>') == (True, True)
    answer = grammar_for(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert walk(answer.lark, '{"a":1}') == (True, True)
    assert walk(answer.lark, '{"a":1,"b":2}')[0] is False and walk(answer.lark, '{"a": 1}')[0] is False
    any_object = grammar_for(json_object=True)  # any object: compact, never closed
    assert walk(any_object.lark, '{"x":[1,{"y":null}]}') == (True, True)
    assert walk(any_object.lark, '{ "x"')[0] is False


def test_closing_follows_openai_strict_mode_and_leaves_the_clients_schema_alone() -> None:
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
            "either": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "null"}]},
            "ref": {"$ref": "#/$defs/Point"},
            "map": {"type": "object", "additionalProperties": {"type": "integer"}},
            "open": {"type": "object", "additionalProperties": True},
            "free": {"type": "object"},
            "both": {"allOf": [{"type": "object", "properties": {"x": {}}}, {"properties": {"y": {}}}]},
            "fixed": {"const": {"k": 1}},
        },
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    }
    before = json.dumps(schema)
    closed = closed_objects(schema)
    assert json.dumps(schema) == before  # a copy
    p = closed["properties"]
    assert closed["additionalProperties"] is False
    assert p["tags"]["items"]["additionalProperties"] is False
    assert p["either"]["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in p["either"]["anyOf"][1]
    assert closed["$defs"]["Point"]["additionalProperties"] is False and p["ref"] == {"$ref": "#/$defs/Point"}
    assert p["map"]["additionalProperties"] == {"type": "integer"} and p["open"]["additionalProperties"] is True
    assert p["free"]["additionalProperties"] is False  # as strict mode: {} unless opened explicitly
    assert p["both"] == schema["properties"]["both"]  # allOf merges keys: its branches stay open
    assert p["fixed"] == {"const": {"k": 1}}
    beside = {"type": "object", "properties": {"kind": {}}, "anyOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed_objects(beside) == beside  # the branches add keys to the object's own
    jsonschema.Draft202012Validator.check_schema(closed)


@pytest.mark.parametrize(
    ("schema", "text"),
    [
        (LANGCHAIN["function"]["parameters"], '{"city":""}'),
        ({"type": "object"}, "{}"),
        ({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "minLength": 3},
                                           "l": {"type": "array", "items": {"type": "boolean"}, "minItems": 2}},
          "required": ["l", "n", "s"]}, '{"n":0,"s":"aaa","l":[true,true]}'),
        ({"enum": ["long", "s"]}, '"s"'),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, '""'),
        ({"type": ["null", "boolean"]}, "null"),
        ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"const": 1}}, "required": ["x"]}}}, '{"x":1}'),
        ({"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}, '{"me":{"me":0}}'),  # recursion: cut short
        ({"allOf": [{"type": "string"}, {"minLength": 2, "type": "string"}]}, '"aa"'),
        ({"description": "anything"}, "0"),
    ],
)
def test_shortest_json_is_the_smallest_instance_or_less(schema: dict, text: str) -> None:
    assert shortest_json(schema) == text


def test_a_budget_too_small_for_the_shortest_valid_answer_is_refused() -> None:
    tok = shipped_tokenizer()
    call = grammar_for(tools=function_tools([LANGCHAIN, WEATHER | {"function": dict(WEATHER["function"], name="w")}]),
                       call_required=True)
    assert call.shortest == (
        '<tool_call>\n{"name":"get_weather","arguments":{"city":""}}\n</tool_call>',
        '<tool_call>\n{"name":"w","arguments":{"city":""}}\n</tool_call>',
    )
    least = tok.grammars.least_tokens(call)
    assert least == 1 + len(tok.encode(call.shortest[1])) < 1 + len(tok.encode(call.shortest[0]))
    tok.grammars.compile(call, budget=least)
    with pytest.raises(RequestInvalid) as err:
        tok.grammars.compile(call, budget=least - 1)
    assert err.value.param == "max_tokens"
    assert err.value.message == (
        f"max_tokens is {least - 1}, too small for the call tool_choice demands: the shortest valid "
        f"answer takes {least} tokens with this model, its end included; raise max_tokens"
    )
    answer = grammar_for(json_schema={"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    with pytest.raises(RequestInvalid, match="too small for the JSON response_format demands"):
        tok.grammars.compile(answer, budget=2)
    assert tok.grammars.least_tokens(Grammar('start: "x"', "response_format")) == 0  # none named: never refused
    bad = grammar_for(json_schema={"type": "array", "uniqueItems": True})
    with pytest.raises(RequestInvalid, match="uniqueItems"):  # what cannot be enforced is named first
        tok.grammars.compile(bad, budget=1)


def test_a_forced_call_the_budget_cut_is_returned_as_far_as_it_got() -> None:
    ids = iter(f"c{i}" for i in range(10))
    new_id = lambda: next(ids)  # noqa: E731
    two = [LANGCHAIN, {"type": "function", "function": {"name": "get_time"}}]
    cut = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Os'
    assert truncated_call(cut, two, index=0, new_id=new_id) == ToolCall(0, "c0", "get_weather", '{"city":"Os')
    ended = '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool'
    assert truncated_call(ended, two, index=2, new_id=new_id) == ToolCall(2, "c1", "get_time", "{}")
    assert truncated_call('<tool_call>\n{"name":"get_w', two, index=0, new_id=new_id).name == "get_weather"
    assert truncated_call('<tool_call>\n{"name":"get_weather"', two, index=0, new_id=new_id).arguments == ""
    assert truncated_call('<tool_call>\n{"name":"get_', two, index=0, new_id=new_id) is None  # which one?
    assert truncated_call("<tool_", two, index=0, new_id=new_id) is None
    done = ToolCall(0, "x", "get_time", "{}")
    assert cut_short("\n" + cut, (done,), two, new_id=new_id) == (
        "", (done, ToolCall(1, "c4", "get_weather", '{"city":"Os'))
    )
    assert cut_short("<tool_", (), two, new_id=new_id) == ("", ())  # never markup as content
    common = dict(tools=two, guardrails=Guardrails(), new_id=new_id)
    verdict = inspect(content=cut, calls=(), call_required=True, truncated=True, **common)
    assert verdict == Rescued((ToolCall(0, "c5", "get_weather", '{"city":"Os'),))  # no retry
    off = dict(common, guardrails=Guardrails.off())
    assert inspect(content=cut, calls=(), call_required=True, truncated=True, **off) == Rescued(
        (ToolCall(0, "c6", "get_weather", '{"city":"Os'),))
    assert inspect(content="Hi", calls=(), call_required=False, truncated=True, **common) == Accept()
