"""MCP tools run by the server, on the real default model (SmolLM2-135M-Instruct), through the
official SDKs as a new user drives them: a small MCP server written with the ``mcp`` SDK
(``tests/mcp_servers/demo_server.py``) in an ``mcpServers`` file, the openai SDK's Responses API
with ``tool_choice: "required"`` (the tool runs with the arguments the model wrote, its result in
``mcp_call``, then the model's message; approval runs nothing until approved), and Anthropic's
MCP connector through the anthropic SDK."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anthropic
import openai
import pytest
import trio

from turbospark.cli.args import build_parser, settings_from
from turbospark.model.backend import BackendSpec
from turbospark.server import serve

from .realmodels import smollm2_store
from .test_mcp import DEMO, marks

pytestmark = pytest.mark.mlx


@pytest.fixture
async def server(nursery: trio.Nursery, tmp_path: Path):
    from turbospark.model.mlx_backend import MlxBackend

    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"demo": {
        "command": sys.executable, "args": [str(DEMO)], "env": {"MCP_DEMO_MARKS": str(tmp_path / "marks")}}}}))
    parser = build_parser()
    settings = settings_from(parser.parse_args(["serve", "--port", "0", "--mcp-config", str(config)]), parser)
    stored = smollm2_store()
    running = await nursery.start(serve, settings, [
        BackendSpec(stored.name, lambda: MlxBackend(stored.path, model_id=stored.name, prefill_chunk=64))])
    yield running, tmp_path / "marks"
    running.stop.set()


async def test_the_model_calls_an_mcp_tool_the_server_runs_it_and_the_model_answers(server) -> None:
    running, path = server
    sdk = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="unused", timeout=120)
    tools = [{"type": "mcp", "server_label": "demo", "allowed_tools": ["shout"], "require_approval": "never"}]
    r = await sdk.responses.create(model="any", input="Shout the word hello.", tools=tools, tool_choice="required",
                                   max_output_tokens=48, temperature=0)
    kinds = [item.type for item in r.output]
    assert kinds[:2] == ["mcp_list_tools", "mcp_call"] and kinds[-1] == "message", kinds
    call = r.output[1]
    written = json.loads(call.arguments)["text"]
    assert call.name == "shout" and call.error is None and call.output == written.upper()
    assert marks(path)[0] == f"shout {written}"  # it really ran, with what the model wrote
    assert r.output[-1].content[0].text.strip()
    await sdk.close()


async def test_approval_runs_nothing_until_the_user_approves(server) -> None:
    running, path = server
    sdk = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="unused", timeout=120)
    tools = [{"type": "mcp", "server_label": "demo", "allowed_tools": ["add"]}]  # approval: OpenAI's default
    asked = await sdk.responses.create(model="any", input="Add 2 and 3.", tools=tools, tool_choice="required",
                                       max_output_tokens=48, temperature=0)
    request = asked.output[-1]
    assert request.type == "mcp_approval_request" and request.name == "add" and marks(path) == []
    approved = await sdk.responses.create(
        model="any", previous_response_id=asked.id, tools=tools, max_output_tokens=48, temperature=0,
        input=[{"type": "mcp_approval_response", "approve": True, "approval_request_id": request.id}])
    ran = approved.output[0]
    arguments = json.loads(request.arguments)
    assert ran.type == "mcp_call" and ran.approval_request_id == request.id
    assert ran.output == str(arguments["a"] + arguments["b"]) and marks(path) == [f"add {arguments['a']} {arguments['b']}"]
    await sdk.close()


async def test_anthropics_mcp_connector_streams_the_call_and_its_result(server) -> None:
    running, path = server
    claude = anthropic.AsyncAnthropic(base_url=running.url, api_key="unused", timeout=120)
    async with claude.beta.messages.stream(
        model="any", max_tokens=48, messages=[{"role": "user", "content": "Shout the word hello."}],
        mcp_servers=[{"type": "url", "url": "https://example.com/mcp", "name": "demo",
                      "tool_configuration": {"allowed_tools": ["shout"]}}],
        tool_choice={"type": "any"}, betas=["mcp-client-2025-04-04"],
    ) as stream:
        message = await stream.get_final_message()
    use, result = message.content[0], message.content[1]
    assert (use.type, use.name, use.server_name) == ("mcp_tool_use", "shout", "demo")
    assert result.type == "mcp_tool_result" and result.tool_use_id == use.id and not result.is_error
    assert result.content[0].text == use.input["text"].upper() and marks(path) == [f"shout {use.input['text']}"]
    await claude.close()
