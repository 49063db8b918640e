"""MCP servers run by the server (``serve --mcp-config``): the config file, the actors that own
the children, OpenAI's Responses ``mcp`` tool (calls, their bound, approvals, streamed events),
cancellation reaching the tool, ``GET /v1/mcp/tools``, the metrics, and no child left behind.

The server is ``tests/mcp_servers/demo_server.py``, written with the official ``mcp`` SDK; the
model is the scripted backend, whose every turn writes the same call."""

from __future__ import annotations

import json
import os
import sys
import uuid
from functools import partial
from pathlib import Path

import pytest
import trio

from turbospark.actors.mcp import start_mcp_servers
from turbospark.config import Settings
from turbospark.errors import RequestInvalid
from turbospark.model.backend import BackendSpec
from turbospark.model.scripted import ScriptedBackend
from turbospark.server import serve
from turbospark.turns.mcp_uses import DECLINED, anthropic_uses, offer, responses_uses
from turbospark.wire.mcp_config import McpServerSpec, parse_mcp_config, read_mcp_config

from ._support import raw_post, read_until, sse_events, wait_for

DEMO = Path(__file__).parent / "mcp_servers" / "demo_server.py"
CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
CALL_SLOW = '<tool_call>\n{"name": "slow", "arguments": {"seconds": 30}}\n</tool_call>'


def demo(marks: Path, tag: str = "", timeout: float = 10) -> McpServerSpec:
    return McpServerSpec("demo", command=sys.executable, args=(str(DEMO), tag), env={"MCP_DEMO_MARKS": str(marks)},
                         timeout=timeout)


def children(tag: str) -> list[int]:
    """The live processes whose command line holds ``tag``."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if pid.isdigit() and tag.encode() in cmdline:
            found.append(int(pid))
    return found


def marks(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def stored_turns(server, response_id: str) -> tuple[dict, ...]:
    """The conversation a stored response continues (what its follow-up's prompt starts with)."""
    return server.system.responses.get(response_id).messages


def mcp_tool(**extra):
    return {"type": "mcp", "server_label": "demo", "require_approval": "never", **extra}


# --- the config file and what a request may use (sans-io) -----------------------------------


def test_the_mcp_servers_file_of_claude_desktop_and_cursor_reads_as_specs(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"], "env": {"A": "1"}},
        "search": {"url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"}, "timeout": 5},
        "off": {"command": "x", "disabled": True},
    }}))
    files, search = read_mcp_config(path)
    assert (files.name, files.transport, files.command, files.args, dict(files.env)) == (
        "files", "stdio", "npx", ("-y", "@modelcontextprotocol/server-filesystem", "/tmp"), {"A": "1"})
    assert (search.transport, search.url, dict(search.headers), search.timeout) == (
        "http", "https://example.com/mcp", {"Authorization": "Bearer x"}, 5.0)


@pytest.mark.parametrize("servers, words", [
    ({"a": {"type": "sse", "url": "http://x/sse"}}, "SSE servers are not supported"),
    ({"a": {"args": []}}, 'needs an http(s) "url"'),
    ({"a": {"command": ""}}, 'needs a "command"'),
    ({"a": {"command": "x", "args": "y"}}, '"args" must be an array'),
    ({"a": {"command": "x", "timeout": 0}}, "timeout is seconds"),
    ({"a b": {"command": "x"}}, "letters, digits"),
    ({"a": {"command": "x", "env": {"A": 1}}}, '"env" must be an object of strings'),
])
def test_a_wrong_entry_is_refused_naming_the_server_and_key(servers, words) -> None:
    with pytest.raises(ValueError) as caught:
        parse_mcp_config({"mcpServers": servers})
    assert words in str(caught.value)


def test_a_request_names_configured_servers_only() -> None:
    (use,) = responses_uses([{"type": "function", "name": "f"}, mcp_tool(allowed_tools=["add"])], ["demo"])
    assert (use.label, use.server, use.allowed, use.asks("add")) == ("demo", "demo", frozenset({"add"}), False)
    for tool, words in [
        ({"type": "mcp", "server_label": "other"}, "names no configured MCP server (configured: demo)"),
        ({"type": "mcp", "server_label": "demo", "server_url": "https://x/mcp"}, "only the MCP servers it was started"),
        ({"type": "mcp"}, "server_label must be a non-empty string"),
        (mcp_tool(require_approval="sometimes"), "require_approval must be"),
    ]:
        with pytest.raises(RequestInvalid) as caught:
            responses_uses([tool], ["demo"])
        assert words in str(caught.value)


def test_approval_follows_openais_rules() -> None:
    def asks(value) -> dict[str, bool]:
        (use,) = responses_uses([{"type": "mcp", "server_label": "demo", **value}], ["demo"])
        return {tool: use.asks(tool) for tool in ("add", "slow")}

    assert asks({}) == {"add": True, "slow": True}  # OpenAI's default: ask first
    assert asks({"require_approval": "never"}) == {"add": False, "slow": False}
    assert asks({"require_approval": {"never": {"tool_names": ["add"]}}}) == {"add": False, "slow": True}


def test_the_offer_names_the_tools_as_the_servers_do_and_a_shared_name_by_label() -> None:
    from turbospark.actors.mcp import McpTool

    tools = {s: [McpTool(s, "add", "Add.", {"type": "object"}), McpTool(s, s + "_only", "", {})] for s in ("a", "b")}
    uses = responses_uses([mcp_tool(server_label="a"), mcp_tool(server_label="b", allowed_tools=["add"])], ["a", "b"])
    made = offer(uses, tools)
    assert sorted(made.routes) == ["a_add", "a_only", "b_add"]
    assert (made.routes["b_add"].server, made.routes["b_add"].tool) == ("b", "add")
    assert made.tools[0] == {"type": "function", "function": {"name": "a_add", "parameters": {"type": "object"},
                                                               "description": "Add."}}


def test_anthropics_connector_names_servers_and_toolsets_narrow_them() -> None:
    servers = [{"type": "url", "url": "https://example.com/mcp", "name": "demo"}]
    (use,) = anthropic_uses(servers, [{"type": "mcp_toolset", "mcp_server_name": "demo",
                                       "configs": {"slow": {"enabled": False}}}], ["demo"])
    assert (use.offers("add"), use.offers("slow"), use.asks("add")) == (True, False, False)
    (only,) = anthropic_uses(servers, [{"type": "mcp_toolset", "mcp_server_name": "demo", "default_config":
                                        {"enabled": False}, "configs": {"add": {"enabled": True}}}], ["demo"])
    assert (only.offers("add"), only.offers("slow")) == (True, False)
    with pytest.raises(RequestInvalid, match="reaches only the MCP servers it was started with"):
        anthropic_uses([{"type": "url", "url": "https://x", "name": "elsewhere"}], None, ["demo"])


# --- the actors ------------------------------------------------------------------------------


async def test_a_server_actor_lists_calls_bounds_cancels_and_restarts(tmp_path: Path) -> None:
    tag, marks_path, events = f"tag-{uuid.uuid4().hex}", tmp_path / "marks", []
    async with trio.open_nursery() as nursery:
        servers = await start_mcp_servers(nursery, [demo(marks_path, tag, timeout=1.5)], events.append)
        (listing,) = await servers.listings()
        assert listing.state == "up" and [t.name for t in listing.tools] == ["add", "shout", "slow", "broken"]
        assert (await servers.call("demo", "add", {"a": 2, "b": 40})).text == "42"
        broken = await servers.call("demo", "broken", {})
        assert broken.outcome == "error" and broken.error
        timed_out = await servers.call("demo", "slow", {"seconds": 30})
        assert timed_out.outcome == "timeout" and "1.5 s" in timed_out.error
        with trio.move_on_after(0.5):  # the asker leaves: the server hears the cancellation
            await servers.call("demo", "slow", {"seconds": 30})
        await wait_for(lambda: marks(marks_path).count("cancelled") == 2)
        (first,) = children(tag)
        os.kill(first, 9)  # the child dies: the next call fails, and the actor starts another
        dead = await servers.call("demo", "add", {"a": 1, "b": 1})
        assert dead.outcome == "failed"
        with trio.fail_after(20):
            while (await servers.listings())[0].state != "up" or children(tag) in ([], [first]):
                await trio.sleep(0.1)
        assert (await servers.call("demo", "add", {"a": 1, "b": 1})).text == "2"
        nursery.cancel_scope.cancel()
    assert children(tag) == []  # none outlives its actor
    assert [e.outcome for e in events] == ["ok", "error", "timeout", "cancelled", "failed", "ok"]


async def test_a_server_that_cannot_start_is_down_and_answers_calls_with_an_error(tmp_path: Path) -> None:
    spec = McpServerSpec("gone", command=str(tmp_path / "no-such-program"))
    async with trio.open_nursery() as nursery:
        servers = await start_mcp_servers(nursery, [spec], lambda e: None)
        (listing,) = await servers.listings()
        assert listing.state == "down" and "no-such-program" in listing.error and listing.tools == ()
        failed = await servers.call("gone", "x", {})
        assert failed.outcome == "failed" and "not running" in failed.error
        nursery.cancel_scope.cancel()


# --- the Responses API -----------------------------------------------------------------------


@pytest.fixture
async def mcp_server(start_server, tmp_path: Path):
    """``await mcp_server(script, **settings)`` -> (server, marks file)."""

    async def start(script: str = CALL_ADD, **settings):
        path = tmp_path / "marks"
        server = await start_server([ScriptedBackend(script=script)], mcp_servers=(demo(path, timeout=10),), **settings)
        return server, path

    return start


def responses_body(**extra):
    return {"model": "scripted", "input": "What is 2 plus 3?", "tools": [mcp_tool()], "max_output_tokens": 80, **extra}


async def test_the_server_runs_the_models_calls_until_the_bound_then_it_answers(mcp_server, client) -> None:
    server, path = await mcp_server()
    r = await client.post(f"{server.url}/v1/responses", json=responses_body(max_tool_calls=2))
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert [item["type"] for item in out] == ["mcp_list_tools", "mcp_call", "mcp_call", "message"]
    listed = out[0]
    assert listed["server_label"] == "demo" and listed["error"] is None
    assert [t["name"] for t in listed["tools"]] == ["add", "shout", "slow", "broken"]
    assert listed["tools"][0]["input_schema"]["required"] == ["a", "b"]
    for call in out[1:3]:
        assert {k: call[k] for k in ("server_label", "name", "output", "error", "status")} == {
            "server_label": "demo", "name": "add", "output": "5", "error": None, "status": "completed"}
        assert json.loads(call["arguments"]) == {"a": 2, "b": 3}
    assert marks(path) == ["add 2 3", "add 2 3"]  # it really ran, with the model's arguments, twice
    assert r.json()["status"] == "completed"
    metrics = (await client.get(f"{server.url}/metrics")).text
    assert 'turbospark_mcp_calls_total{outcome="ok",server="demo"} 2.0' in metrics


async def test_streamed_mcp_events_come_in_openais_order(mcp_server, client) -> None:
    server, _ = await mcp_server()
    r = await client.post(f"{server.url}/v1/responses", json=responses_body(max_tool_calls=1, stream=True))
    events = [(name, json.loads(data)) for name, data in sse_events(r.text)]
    names = [name for name, _ in events if not name.endswith(".delta") or "mcp" in name]
    assert names[:9] == [
        "response.created",
        "response.output_item.added", "response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed",
        "response.output_item.done",
        "response.output_item.added", "response.mcp_call.in_progress", "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.delta",
    ]
    after = names[names.index("response.mcp_call_arguments.done"):]
    assert after[:3] == ["response.mcp_call_arguments.done", "response.mcp_call.completed", "response.output_item.done"]
    assert names[-1] == "response.completed"
    deltas = "".join(e["delta"] for n, e in events if n == "response.mcp_call_arguments.delta")
    assert json.loads(deltas) == {"a": 2, "b": 3}
    done = next(e for n, e in events if n == "response.output_item.done" and e["item"]["type"] == "mcp_call")
    assert done["item"]["output"] == "5" and done["output_index"] == 1
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == ["mcp_list_tools", "mcp_call", "message"]
    assert final["usage"]["input_tokens"] > 0


async def test_approval_runs_nothing_until_approved_then_continues(mcp_server, client) -> None:
    server, path = await mcp_server()
    tool = {"type": "mcp", "server_label": "demo"}  # require_approval: OpenAI's default, always
    first = (await client.post(f"{server.url}/v1/responses", json=responses_body(tools=[tool]))).json()
    assert [i["type"] for i in first["output"]] == ["mcp_list_tools", "mcp_approval_request"]
    asked = first["output"][1]
    assert asked["name"] == "add" and json.loads(asked["arguments"]) == {"a": 2, "b": 3}
    assert marks(path) == []  # nothing ran
    declined = await client.post(f"{server.url}/v1/responses", json=responses_body(
        tools=[tool], previous_response_id=first["id"], max_tool_calls=1,
        input=[{"type": "mcp_approval_response", "approve": False, "approval_request_id": asked["id"]}]))
    assert marks(path) == []  # declined: not run, and the model was told so before it went on
    assert [i["type"] for i in declined.json()["output"]] == ["mcp_approval_request"]  # it asked again
    told = stored_turns(server, declined.json()["id"])
    assert {"role": "tool", "tool_call_id": asked["id"].split("_", 1)[1], "content": DECLINED} in told
    approved = (await client.post(f"{server.url}/v1/responses", json=responses_body(
        tools=[{**tool, "require_approval": "never"}], previous_response_id=first["id"], max_tool_calls=1,
        input=[{"type": "mcp_approval_response", "approve": True, "approval_request_id": asked["id"]}]))).json()
    kinds = [i["type"] for i in approved["output"]]
    assert kinds[0] == "mcp_call" and "mcp_list_tools" not in kinds  # listed once per conversation
    assert approved["output"][0]["approval_request_id"] == asked["id"] and approved["output"][0]["output"] == "5"
    assert marks(path)[0] == "add 2 3"
    wrong = await client.post(f"{server.url}/v1/responses", json=responses_body(
        tools=[tool], input=[{"type": "mcp_approval_response", "approve": True, "approval_request_id": "mcpr_nope"}]))
    assert wrong.status_code == 400 and "mcpr_nope" in wrong.json()["error"]["message"]


async def test_mcp_tools_lists_every_server_and_a_wrong_label_is_a_400(mcp_server, client) -> None:
    server, _ = await mcp_server()
    listed = (await client.get(f"{server.url}/v1/mcp/tools")).json()
    (one,) = listed["data"]
    assert (one["name"], one["transport"], one["state"]) == ("demo", "stdio", "up")
    assert "command" not in one and "env" not in one  # what it runs is not shown
    assert [t["name"] for t in one["tools"]] == ["add", "shout", "slow", "broken"]
    r = await client.post(f"{server.url}/v1/responses", json=responses_body(tools=[mcp_tool(server_label="x")]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


async def test_a_client_that_leaves_during_a_slow_tool_cancels_it_and_the_server_serves_on(mcp_server, client) -> None:
    server, path = await mcp_server(CALL_SLOW)
    stream = await raw_post(server.url, "/v1/responses", responses_body(stream=True))
    await read_until(stream, b"response.mcp_call_arguments.done")
    await wait_for(lambda: "started" in marks(path))
    await stream.aclose()
    await wait_for(lambda: "cancelled" in marks(path))  # the MCP cancellation reached the tool
    metrics = ""
    with trio.fail_after(10):
        while 'outcome="cancelled"' not in metrics:
            metrics = (await client.get(f"{server.url}/metrics")).text
    listed = (await client.get(f"{server.url}/v1/mcp/tools")).json()
    assert listed["data"][0]["state"] == "up"


async def test_a_tool_past_its_timeout_is_an_mcp_call_with_an_error(start_server, client, tmp_path: Path) -> None:
    server = await start_server([ScriptedBackend(script=CALL_SLOW)], mcp_servers=(demo(tmp_path / "m", timeout=1),))
    r = await client.post(f"{server.url}/v1/responses", json=responses_body(max_tool_calls=1))
    call = r.json()["output"][1]
    assert call["type"] == "mcp_call" and call["status"] == "failed" and call["output"] is None
    assert "longer than 1 s" in call["error"]


async def test_on_shutdown_no_mcp_child_remains(tmp_path: Path) -> None:
    tag = f"tag-{uuid.uuid4().hex}"
    config = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0, mcp_servers=(demo(tmp_path / "m", tag),))
    backend = ScriptedBackend()
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve, config, [BackendSpec(backend.model_id, lambda: backend)]))
        assert len(children(tag)) == 1
        server.stop.set()
    assert children(tag) == []


# --- Anthropic's MCP connector -----------------------------------------------------------------

CONNECTOR = [{"type": "url", "url": "https://example.com/mcp", "name": "demo"}]


async def test_anthropics_connector_writes_tool_use_and_result_blocks_whole_and_streamed(mcp_server, client) -> None:
    server, path = await mcp_server()
    body = {"model": "scripted", "max_tokens": 60, "messages": [{"role": "user", "content": "2 plus 3?"}],
            "mcp_servers": CONNECTOR, "tools": [{"type": "mcp_toolset", "mcp_server_name": "demo",
                                                "default_config": {"enabled": False}, "configs": {"add": {"enabled": True}}}]}
    headers = {"anthropic-beta": "mcp-client-2025-11-20"}
    whole = (await client.post(f"{server.url}/v1/messages", json=body, headers=headers)).json()
    kinds = [b["type"] for b in whole["content"]]
    assert kinds[:2] == ["mcp_tool_use", "mcp_tool_result"] and kinds.count("mcp_tool_use") == 8  # the bound
    use, result = whole["content"][:2]
    assert (use["name"], use["server_name"], use["input"]) == ("add", "demo", {"a": 2, "b": 3})
    assert result == {"type": "mcp_tool_result", "tool_use_id": use["id"], "is_error": False,
                      "content": [{"type": "text", "text": "5"}]}
    assert whole["stop_reason"] == "end_turn" and kinds[-1] == "text"
    streamed = await client.post(f"{server.url}/v1/messages", json={**body, "stream": True}, headers=headers)
    events = [json.loads(data) for _, data in sse_events(streamed.text)]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts[:3] == ["mcp_tool_use", "mcp_tool_result", "mcp_tool_use"]
    assert [e["index"] for e in events if e["type"] == "content_block_start"] == list(range(len(starts)))
    assert events[-1]["type"] == "message_stop" and len(marks(path)) == 16


async def test_a_conversation_carrying_the_connectors_blocks_reads_as_calls_and_results() -> None:
    from turbospark.routes.anthropic_request import plan
    from turbospark.wire.anthropic import MessagesRequest
    from turbospark.wire.codec import structure

    body = structure({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "2 plus 3?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Adding."},
            {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "add", "server_name": "demo", "input": {"a": 2, "b": 3}},
            {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "is_error": False, "content": [{"type": "text", "text": "5"}]},
            {"type": "text", "text": "It is 5."}]},
        {"role": "user", "content": "Thanks"}]}, MessagesRequest)
    roles = [(m["role"], m.get("content"), len(m.get("tool_calls", []))) for m in plan(body, None).messages]
    assert roles == [("user", "2 plus 3?", 0), ("assistant", "Adding.", 1), ("tool", "5", 0),
                     ("assistant", "It is 5.", 0), ("user", "Thanks", 0)]


def test_a_stored_mcp_response_continues_as_calls_then_results() -> None:
    from turbospark.routes.openai_responses_request import said

    output = [
        {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "demo", "tools": []},
        {"type": "mcp_call", "id": "mcp_call_a", "name": "add", "arguments": "{}", "output": "5", "error": None},
        {"type": "message", "content": [{"type": "output_text", "text": "It is 5."}]},
        {"type": "mcp_approval_request", "id": "mcpr_call_b", "name": "add", "arguments": "{}", "server_label": "demo"},
    ]
    turns = said(output)
    assert [(t["role"], t.get("content"), [c["id"] for c in t.get("tool_calls", [])]) for t in turns] == [
        ("assistant", "", ["call_a"]), ("tool", "5", []), ("assistant", "It is 5.", ["call_b"])]
    approved = said([{"type": "mcp_call", "id": "mcp_call_b", "name": "add", "arguments": "{}", "output": None,
                      "error": "boom", "approval_request_id": "mcpr_call_b"}])
    assert approved == [{"role": "tool", "tool_call_id": "call_b", "content": "Error: boom"}]


async def test_a_server_that_is_down_is_a_424_naming_it(start_server, client, tmp_path: Path) -> None:
    gone = McpServerSpec("gone", command=str(tmp_path / "no-such-program"))
    server = await start_server([ScriptedBackend(script=CALL_ADD)], mcp_servers=(gone,))
    r = await client.post(f"{server.url}/v1/responses", json=responses_body(tools=[mcp_tool(server_label="gone")]))
    assert r.status_code == 424 and r.json()["error"]["type"] == "external_connector_error"
    assert "'gone'" in r.json()["error"]["message"] and "no-such-program" in r.json()["error"]["message"]
    (listed,) = (await client.get(f"{server.url}/v1/mcp/tools")).json()["data"]
    assert listed["state"] == "down" and listed["tools"] == []


# --- a request's own servers (serve --mcp-urls) ---------------------------------------------------


@pytest.fixture
async def http_demo(tmp_path: Path):
    """The demo server over streamable HTTP on a free loopback port: (url, marks file)."""
    import socket
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    path = tmp_path / "http-marks"
    child = subprocess.Popen([sys.executable, str(DEMO), "--http", str(port)], env={**os.environ, "MCP_DEMO_MARKS": str(path)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with trio.fail_after(30):
            while True:
                try:
                    await (await trio.open_tcp_stream("127.0.0.1", port)).aclose()
                    break
                except OSError:
                    await trio.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp", path
    finally:
        child.kill()
        child.wait()


async def test_a_requests_own_server_url_needs_mcp_urls_and_a_public_address(start_server, client, http_demo) -> None:
    url, _ = http_demo
    remote = {"type": "mcp", "server_label": "mine", "server_url": url, "require_approval": "never"}
    closed = await start_server([ScriptedBackend(script=CALL_ADD)])
    r = await client.post(f"{closed.url}/v1/responses", json=responses_body(tools=[remote]))
    assert r.status_code == 400 and "serve --mcp-urls" in r.json()["error"]["message"]
    opened = await start_server([ScriptedBackend(script=CALL_ADD)], mcp_urls=True)
    r = await client.post(f"{opened.url}/v1/responses", json=responses_body(tools=[remote]))
    assert r.status_code == 400 and "loopback, private or reserved" in r.json()["error"]["message"]
    many = [{**remote, "server_label": f"s{i}"} for i in range(5)]
    r = await client.post(f"{opened.url}/v1/responses", json=responses_body(tools=many))
    assert r.status_code == 400 and "at most 4" in r.json()["error"]["message"]


async def test_a_requests_own_server_serves_that_request_only(start_server, client, http_demo, monkeypatch) -> None:
    from turbospark.routes import _images

    monkeypatch.setattr(_images, "_public", lambda address: True)  # the test's server is on loopback
    url, path = http_demo
    server = await start_server([ScriptedBackend(script=CALL_ADD)], mcp_urls=True)
    remote = {"type": "mcp", "server_label": "mine", "server_url": url, "require_approval": "never"}
    for _ in range(2):
        r = await client.post(f"{server.url}/v1/responses", json=responses_body(tools=[remote], max_tool_calls=1))
        out = r.json()["output"]
        assert [i["type"] for i in out] == ["mcp_list_tools", "mcp_call", "message"]
        assert out[1]["server_label"] == "mine" and out[1]["output"] == "5"
    assert marks(path) == ["add 2 3", "add 2 3"]
    assert (await client.get(f"{server.url}/v1/mcp/tools")).json()["data"] == []  # nobody else sees it
    connector = [{"type": "url", "url": url, "name": "mine", "authorization_token": "t"}]
    r = await client.post(f"{server.url}/v1/messages", headers={"anthropic-beta": "mcp-client-2025-04-04"}, json={
        "model": "scripted", "max_tokens": 40, "messages": [{"role": "user", "content": "2 plus 3?"}],
        "mcp_servers": connector})
    assert [b["type"] for b in r.json()["content"]][:2] == ["mcp_tool_use", "mcp_tool_result"]


async def test_a_stream_keeps_alive_while_a_tool_runs(start_server, client, tmp_path: Path) -> None:
    slow = '<tool_call>\n{"name": "slow", "arguments": {"seconds": 1}}\n</tool_call>'
    server = await start_server([ScriptedBackend(script=slow)], mcp_servers=(demo(tmp_path / "m"),),
                                keepalive_interval=0.2)
    r = await client.post(f"{server.url}/v1/responses", json=responses_body(max_tool_calls=1, stream=True))
    during = r.text.split("response.mcp_call_arguments.done", 1)[1].split("response.mcp_call.completed", 1)[0]
    assert during.count(": keepalive") >= 3  # about one per 0.2 s of the tool's second


def test_a_tools_output_is_read_as_text_and_cut_where_it_is_huge() -> None:
    from types import SimpleNamespace as NS

    from turbospark.actors import mcp as actor

    def result(*content, structured=None, error=False):
        return NS(content=list(content), structured_content=structured, is_error=error)

    text = NS(type="text", text="It is sunny.")
    image = NS(type="image", mime_type="image/png")
    assert actor._outcome(result(text, image)).text == "It is sunny.\n[image: image/png]"
    assert actor._outcome(result(structured={"t": 21})).text == '{"t": 21}'
    failed = actor._outcome(result(NS(type="text", text="no such city"), error=True))
    assert (failed.outcome, failed.error) == ("error", "no such city")
    huge = actor._outcome(result(NS(type="text", text="x" * (actor.MAX_OUTPUT_CHARS + 5))))
    assert len(huge.text) < actor.MAX_OUTPUT_CHARS + 100 and huge.text.endswith("characters]")


def test_serve_names_its_mcp_servers_at_startup_and_leaves_no_child_on_sigint(tmp_path: Path) -> None:
    import signal
    import subprocess

    tag = f"tag-{uuid.uuid4().hex}"
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {
        "demo": {"command": sys.executable, "args": [str(DEMO), tag]},
        "gone": {"command": str(tmp_path / "no-such-program")}}}))
    proc = subprocess.Popen([sys.executable, "-m", "turbospark", "serve", "--port", "0", "--model", "scripted",
                             "--mcp-config", str(config)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        said = []
        assert proc.stderr is not None
        for line in proc.stderr:
            said.append(line.rstrip())
            if line.startswith("  mcp: gone"):
                break
        assert "  mcp: demo (stdio): 4 tools (add, shout, slow, broken)" in said
        assert said[-1].startswith("  mcp: gone (stdio): down: ") and "no-such-program" in said[-1]
        assert len(children(tag)) == 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert children(tag) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_wrong_mcp_config_stops_serve_with_one_line(tmp_path: Path, capsys) -> None:
    from turbospark.cli.args import build_parser, settings_from

    parser = build_parser()
    for text, words in [("{", "is not JSON"), ('{"mcpServers": {"x": {"type": "sse", "url": "http://h/sse"}}}',
                                                "SSE servers are not supported")]:
        path = tmp_path / "mcp.json"
        path.write_text(text)
        with pytest.raises(SystemExit) as stopped:
            settings_from(parser.parse_args(["serve", "--mcp-config", str(path)]), parser)
        assert stopped.value.code == 2 and words in capsys.readouterr().err
    with pytest.raises(SystemExit):
        settings_from(parser.parse_args(["serve", "--mcp-config", str(tmp_path / "missing.json")]), parser)
    assert "cannot read" in capsys.readouterr().err
