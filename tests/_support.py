"""Small helpers shared by the HTTP tests."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import trio


def chat_body(content: str = "Hello there", **extra: Any) -> dict[str, Any]:
    return {"model": "scripted", "messages": [{"role": "user", "content": content}], **extra}


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """Split an SSE body into (event name, data) pairs; comments are skipped."""
    out = []
    for frame in text.split("\n\n"):
        if not frame.strip() or frame.startswith(":"):
            continue
        name, data = None, []
        for line in frame.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        out.append((name, "\n".join(data)))
    return out


async def wait_for(condition: Any, timeout: float = 10) -> None:
    """Wait (on the real clock) until ``condition()`` holds."""
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.005)


async def raw_post(url: str, path: str, body: dict[str, Any]) -> trio.SocketStream:
    """Send a POST over a raw socket and leave the response unread (the test closes it)."""
    import json
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    await stream.send_all(head + data)
    return stream


#: A streamed chat's first token's text: the opening chunk (an empty content) and prefill progress
#: come before it, while the request is still prefilling.
FIRST_TEXT = re.compile(rb'"content":\s*"[^"]')


async def read_until(stream: trio.SocketStream, needle: bytes | re.Pattern[bytes], timeout: float = 10) -> bytes:
    """Read until ``needle`` (bytes, or a pattern such as ``FIRST_TEXT``) has arrived."""
    buf = b""
    with trio.fail_after(timeout):
        while not (needle.search(buf) if isinstance(needle, re.Pattern) else needle in buf):
            chunk = await stream.receive_some(65536)
            if not chunk:
                raise AssertionError(f"connection closed before {needle!r}; got {buf!r}")
            buf += chunk
    return buf


# LangChain's bind_tools schema for get_weather(city: str), as it sends it: no additionalProperties.
LANGCHAIN = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"},
    },
}


# A plain function tool, as the OpenAI SDK sends it.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


async def streamed_call(sdk: Any, **create: Any) -> tuple[list[str], Any]:
    """A streamed chat through the openai SDK: the argument deltas as they came, and the final
    completion the SDK assembled from them."""
    pieces: list[str] = []
    async with sdk.chat.completions.stream(**create) as stream:
        async for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
        final = await stream.get_final_completion()
    return pieces, final


def json_children() -> list[int]:
    """This process's JSON children (the parser actor's, ``/proc``): an in-process server's
    big JSON went through one when there is one."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid()
                    and b"json_worker" in (proc / "cmdline").read_bytes()):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def tiny_llama(vocab: int, layers: int, seed: int, arch: str = "llama", hidden: int = 32) -> Any:
    """A tiny random model of mlx-lm's llama layer stack (``arch``: its ``llama`` or ``qwen2``
    module) for engine tests, no download; its weights are scaled up from the default init, so
    its distributions are peaked (few near-ties)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_map

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    args = module.ModelArgs(
        model_type=arch, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab,
    )
    model = module.Model(args)
    model.update(tree_map(lambda w: w * 3, model.parameters()))
    mx.eval(model.parameters())
    return model


def import_into(home: Path, source: Path, name: str, *args: str) -> str:
    """``turbospark models import SOURCE --name NAME`` into ``home``'s store, as a user runs it; its
    output."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "turbospark", "models", "import", str(source), "--name", name, *args],
        env={**os.environ, "TURBOSPARK_HOME": str(home)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


async def serve_store(nursery: trio.Nursery, home: Path, **settings: Any) -> Any:
    """A server on 127.0.0.1:0 whose models are ``home``'s store, each loaded when first asked for."""
    from functools import partial

    from turbospark.cli.attach import load_mlx, store_loaders
    from turbospark.config import Settings
    from turbospark.server import serve
    from turbospark.store.shelf import StoreShelf
    from turbospark.store.store import ModelStore

    shelf = StoreShelf(ModelStore(home / "models"), load_mlx, store_loaders())
    return await nursery.start(partial(
        serve, Settings(host="127.0.0.1", port=0, graceful_timeout=1.0, **settings), [],
        library=shelf.loadables, shelf=shelf,
    ))  # fmt: skip
