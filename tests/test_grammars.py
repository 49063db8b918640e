"""Grammars beyond JSON: llama.cpp's ``grammar``/``json_schema`` and vLLM's ``structured_outputs``
and ``guided_*`` fields, as grammars (sans-io) and through the server on the scripted backend,
which follows its script where the grammar allows and takes the shortest way out otherwise."""

from __future__ import annotations

import json
import re

import pytest

from turbospark.errors import RequestInvalid
from turbospark.model.scripted import ScriptedBackend, shipped_tokenizer
from turbospark.turns.grammars import grammar_demand

from ._support import chat_body

TOK = shipped_tokenizer()
GBNF = 'root ::= answer "."\nanswer ::= "yes" | "no"'
LARK = 'start: "id-" /[0-9]{2}/'


def accepts(grammar, text: str) -> bool:
    """Whether ``text`` then the end of sequence is a finished output of ``grammar``."""
    m = TOK.grammars.matcher(grammar)
    for token in TOK.encode(text):
        if not m.allowed()[token] or not m.consume(token):
            return False
    return bool(m.allowed()[TOK.grammars.eos_id])


@pytest.mark.parametrize(
    ("fields", "what", "good", "bad"),
    [
        ({"guided_regex": "[0-9]{3}-x/y"}, "guided_regex", "123-x/y", "12-x/y"),
        ({"structured_outputs": {"regex": r"\d+"}}, "structured_outputs.regex", "42", "4a"),
        ({"guided_choice": ["red", "green"]}, "guided_choice", "green", "blue"),
        ({"structured_outputs": {"choice": ["a b", 'q"uote']}}, "structured_outputs.choice", 'q"uote', "a"),
        ({"grammar": GBNF}, "grammar", "no.", "no"),
        ({"guided_grammar": LARK}, "guided_grammar", "id-07", "id-7"),
        ({"structured_outputs": {"grammar": GBNF}}, "structured_outputs.grammar", "yes.", "maybe."),
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
         "json_schema", '{"a":1}', "{}"),
        ({"guided_json": '{"type": "array", "items": {"type": "integer"}}'}, "guided_json", "[1,2]", '["x"]'),
        ({"structured_outputs": {"json": {"type": "string"}}}, "structured_outputs.json", '"x"', "x"),
        ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object", "{}", "[]"),
    ],
)
def test_each_peer_field_becomes_a_grammar_that_holds(fields, what, good, bad) -> None:
    grammar = grammar_demand(**fields)
    assert grammar is not None and grammar.what == what
    assert accepts(grammar, good) and not accepts(grammar, bad)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"grammar": "root ::= (("}, "grammar", "grammar: the grammar does not compile: Expected ')'"),
        ({"grammar": "root ::= nothing"}, "grammar", "grammar: the grammar does not compile: Rule 'nothing' not found"),
        ({"guided_grammar": "start: nothing"}, "guided_grammar", 'guided_grammar: the grammar does not compile: unknown name: "nothing"'),
        ({"guided_regex": "[a-"}, "guided_regex", "unclosed character class"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", 'guided_json: this schema cannot be enforced: Unimplemented keys: ["uniqueItems"]'),
        ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "guided_choice must be a non-empty list of non-empty strings"),
        ({"guided_choice": "yes"}, "guided_choice", "guided_choice must be a non-empty list"),
        ({"guided_regex": ""}, "guided_regex", "guided_regex must be a non-empty string"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag not supported"),
        ({"structured_outputs": "regex"}, "structured_outputs", "structured_outputs must be an object"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "give one output constraint, not several: guided_regex, guided_choice"),
    ],
)
def test_what_does_not_compile_is_refused_naming_the_error(fields, param, message) -> None:
    with pytest.raises(RequestInvalid) as err:
        TOK.grammars.compile(grammar_demand(**fields))
    assert err.value.param == param and message in err.value.message


async def test_the_server_obeys_regex_choice_and_gbnf(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="The answer is 12345 and more")])
    cases = [
        ({"guided_regex": "[0-9]{3}"}, re.compile(r"[0-9]{3}").fullmatch),
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
        ({"grammar": GBNF}, lambda t: t in ("yes.", "no.")),
        ({"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
         lambda t: json.loads(t).keys() == {"n"}),
    ]
    for fields, holds in cases:
        r = await server_chat(client, server, fields)
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and holds(choice["message"]["content"]), (fields, choice)
        assert choice["finish_reason"] == "stop"
        r = await client.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 20, **fields})
        assert holds(r.json()["choices"][0]["text"]), fields


async def server_chat(client, server, fields):
    return await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=20, **fields))


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"grammar": "root ::= nothing"}, "grammar", "the grammar does not compile: Rule 'nothing' not found"),
        ({"structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs.grammar", 'unknown name: "nothing"'),
        ({"guided_regex": "(a"}, "guided_regex", "the grammar does not compile"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice",
         "guided_choice cannot be combined with response_format"),
    ],
)
async def test_a_bad_grammar_is_a_400_in_openais_shape(start_server, client, fields, param, needle) -> None:
    server = await start_server()
    for path, body in (("/v1/chat/completions", chat_body(**fields)), ("/v1/completions", {"prompt": "x", **fields})):
        r = await client.post(f"{server.url}{path}", json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and needle in error["message"], error
