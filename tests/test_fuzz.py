"""The published OpenAPI document, and a fuzzer driven by it over every route.

Bodies come from each route's own schema (Hypothesis strategies read from it), from that schema with one
field replaced by arbitrary JSON, and from arbitrary JSON or bytes. Every answer must be no 5xx,
arrive in time, and keep its documented shape: an error in the route family's shape, a success
that matches its schema. Examples are bounded so the suite stays fast; ``benchmarks/fuzz.py``
runs the same properties for longer.
"""

from __future__ import annotations

import json
import math
import os
import re

import httpx
import hypothesis.strategies as st
import jsonschema
import pytest
import trio
from hypothesis import HealthCheck, given, settings

from turbospark.audio.engines import ScriptedSpeechToText, ScriptedTextToSpeech
from turbospark.images.scripted import ScriptedImages
from turbospark.model.encoder import ScriptedEncoder
from turbospark.model.scripted import ScriptedBackend
from turbospark.web.openapi import Route, document, error_schema, routes

EXAMPLES = int(os.environ.get("TURBOSPARK_FUZZ_EXAMPLES", "25"))
BUDGET_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "num_predict")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def _openapi_path(rule: str) -> str:
    return re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule)


async def test_the_document_covers_every_route_and_is_served(start_server, client) -> None:
    server = await start_server(audio=[ScriptedSpeechToText(), ScriptedTextToSpeech()], encoders=[ScriptedEncoder()])
    doc = (await client.get(f"{server.url}/openapi.json")).json()
    assert doc["openapi"] == "3.1.0"
    from turbospark.routes.app import create_app

    app = create_app(server.system)
    served = {(m.lower(), _openapi_path(r.rule)) for r in app.url_map.iter_rules()
              for m in r.methods - {"HEAD", "OPTIONS"} if r.endpoint != "static"}
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert served <= documented, served - documented
    for path, ops in doc["paths"].items():  # every schema is itself valid
        for op in ops.values():
            for content in op.get("requestBody", {}).get("content", {}).values():
                jsonschema.Draft202012Validator.check_schema(content["schema"] | {"components": doc["components"]})


def from_schema(schema: dict, components: dict) -> st.SearchStrategy[object]:
    """Values for the JSON Schema subset the document uses (types, enums, anyOf, arrays,
    objects, references), small on purpose."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(components[name], components))
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=20)
    if kind == "integer":
        return st.integers(-3, 100)
    if kind == "number":
        return st.floats(-3, 3, allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components), max_size=3)
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", ()))
        props = {k: from_schema(v, components) for k, v in schema["properties"].items()}
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    if kind == "object":
        return st.dictionaries(st.text(max_size=8), from_schema(schema.get("additionalProperties", {}), components), max_size=3)
    return json_values


def _tame(body: object) -> object:
    """Keep a generated request cheap: a small budget, few choices (the fuzzer looks for bad
    answers, not long generations)."""
    if isinstance(body, dict):
        for field in BUDGET_FIELDS:
            if isinstance(body.get(field), int) and not isinstance(body.get(field), bool):
                body[field] = max(-5, min(body[field], 4))
        if isinstance(body.get("n"), int):
            body["n"] = min(body["n"], 2)
        if isinstance(body.get("options"), dict) and isinstance(body["options"].get("num_predict"), int):
            body["options"]["num_predict"] = min(body["options"]["num_predict"], 4)
    return body


def _bodies(route: Route, components: dict) -> st.SearchStrategy[bytes]:
    garbage = json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64)
    if route.body is None:
        return garbage
    schema = document([route])["paths"][route.path][route.method]["requestBody"]["content"]["application/json"]["schema"]
    valid = from_schema(schema, components).map(_tame)
    broken = st.tuples(valid, st.text(max_size=12), json_values).map(
        lambda t: {**t[0], t[1]: t[2]} if isinstance(t[0], dict) else t[0]
    ).map(_tame)
    return st.one_of(valid, broken).map(lambda b: json.dumps(b, allow_nan=False).encode()) | garbage


def _check(route: Route, response: httpx.Response) -> None:
    assert response.status_code < 500 or response.status_code == route.always, (
        route.path, response.status_code, response.text[:500])
    ctype = response.headers.get("content-type", "")
    if response.status_code >= 400:
        jsonschema.validate(response.json(), error_schema(route.family))
        assert "Traceback" not in response.text
    elif ctype.startswith("application/json") and route.returns is not None:
        jsonschema.validate(response.json(), route.returns)
    elif ctype.startswith("text/event-stream"):
        for frame in response.text.split("\n\n"):
            for line in frame.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[6:])
    elif ctype.startswith("application/x-ndjson"):
        for line in response.text.splitlines():
            json.loads(line)


FUZZED = [r for r in routes() if r.method == "post" and r.path != "/v1/audio/transcriptions/realtime"]


@pytest.mark.parametrize("route", FUZZED, ids=[f"{r.method} {r.path}" for r in FUZZED])
async def test_fuzz_every_route(route: Route, start_server) -> None:
    server = await start_server(
        [ScriptedBackend(script="Hello there.")],
        encoders=[ScriptedEncoder()], audio=[ScriptedSpeechToText(), ScriptedTextToSpeech()],
        images=[ScriptedImages(step_delay=0)],
    )
    components = document()["components"]["schemas"]
    strategy = _bodies(route, components)
    samples: list[bytes] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), derandomize=True)
    @given(strategy)
    def collect(body: bytes) -> None:
        samples.append(body)

    collect()  # hypothesis drives a sync function; the requests go out from Trio below
    path = route.path.replace("{", "").replace("}", "")
    async with httpx.AsyncClient(timeout=30) as client:
        for body in samples:
            with trio.fail_after(30):  # no hang
                r = await client.post(f"{server.url}{path}", content=body,
                                      headers={"content-type": route.raw_body or "application/json"})
            _check(route, r)
        ok = await client.post(f"{server.url}/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert ok.status_code == 200  # and it keeps serving
    assert math.isfinite(len(samples)) and samples
