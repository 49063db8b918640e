"""Slow and idle clients: hundreds of idle or trickling connections hold nothing up, a head or a
body that trickles is cut at its timeout, and a 25 MiB body is answered beside running streams."""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import httpx
import pytest
import trio

from tests._support import chat_body, read_until, sse_events, wait_for
from turbospark.model.scripted import ScriptedBackend, shipped_tokenizer

PATH = "/v1/chat/completions"
IDLE = 150


async def _connect(url: str) -> trio.SocketStream:
    parts = urlsplit(url)
    return await trio.open_tcp_stream(parts.hostname, parts.port)


def _head(url: str, path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def _trickle(stream: trio.SocketStream, data: bytes, pause: float) -> None:
    """Send ``data`` a byte at a time until it is all sent or the server closes the socket."""
    for i in range(len(data)):
        try:
            await stream.send_all(data[i : i + 1])
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        await trio.sleep(pause)


async def _read_to_close(stream: trio.SocketStream, timeout: float = 20) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    buf = b""
    with trio.fail_after(timeout):
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return buf
            if not chunk:
                return buf
            buf += chunk


async def _still_open(stream: trio.SocketStream) -> bool:
    """Nothing to read and not closed: the server has neither answered nor dropped it."""
    with trio.move_on_after(0.05):
        await stream.receive_some(1)
        return False
    return True


async def test_idle_and_trickling_connections_do_not_hold_up_a_normal_request(start_server, client) -> None:
    server = await start_server([ScriptedBackend(token_delay=0.002)], header_timeout=60.0, body_timeout=60.0)
    idle = [await _connect(server.url) for _ in range(IDLE)]
    heads = [await _connect(server.url) for _ in range(10)]
    bodies = [await _connect(server.url) for _ in range(10)]
    body = json.dumps(chat_body(max_tokens=3)).encode()
    async with trio.open_nursery() as nursery:
        for s in heads:
            nursery.start_soon(_trickle, s, _head(server.url, PATH, len(body)) + body, 0.05)
        for s in bodies:
            await s.send_all(_head(server.url, PATH, len(body)))
            nursery.start_soon(_trickle, s, body, 0.05)
        # with all of them open, a plain request, a stream and /health are answered in full
        plain = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=20))
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 20
        streamed = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=20, stream=True))
        frames = sse_events(streamed.text)
        assert frames[-1][1] == "[DONE]" and len(frames) >= 20
        assert (await client.get(f"{server.url}/health")).json()["status"] == "ok"
        # the idle ones were neither answered nor dropped, and each can still make a request
        assert all([await _still_open(s) for s in idle])
        await idle[0].send_all(f"GET /health HTTP/1.1\r\nHost: {urlsplit(server.url).netloc}\r\n\r\n".encode())
        assert b'"status": "ok"' in await read_until(idle[0], b"}")
        nursery.cancel_scope.cancel()
    for s in idle + heads + bodies:
        await s.aclose()


async def test_a_head_or_body_that_trickles_is_cut_at_its_timeout(start_server, client) -> None:
    server = await start_server(header_timeout=0.5, body_timeout=1.0)
    body = json.dumps(chat_body(max_tokens=3)).encode()
    idle = await _connect(server.url)
    head = await _connect(server.url)
    results: dict[str, bytes] = {}

    async def body_trickle(name: str, path: str, length: int) -> None:
        stream = await _connect(server.url)
        await stream.send_all(_head(server.url, path, length))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_trickle, stream, body, 0.05)
            results[name] = await _read_to_close(stream)
            nursery.cancel_scope.cancel()
        await stream.aclose()

    async def head_trickle() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_trickle, head, _head(server.url, PATH, len(body)), 0.05)
            results["head"] = await _read_to_close(head)
            nursery.cancel_scope.cancel()

    async def idle_wait() -> None:
        results["idle"] = await _read_to_close(idle)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(idle_wait)
        nursery.start_soon(head_trickle)
        for name, path in (("openai", PATH), ("anthropic", "/v1/messages"), ("ollama", "/api/embed")):
            nursery.start_soon(body_trickle, name, path, len(body))
        # a body big enough for the parser's child process (read in pieces): the same timeout
        nursery.start_soon(body_trickle, "openai, 2 MiB", PATH, 2 << 20)
    # an idle connection and a head that never completes are closed without an answer
    assert results["idle"] == b"" and results["head"] == b""
    # a body that never completes gets a 408 in its family's shape, and the connection closes
    for name in ("openai", "anthropic", "ollama", "openai, 2 MiB"):
        head_part, _, payload = results[name].partition(b"\r\n\r\n")
        assert head_part.startswith(b"HTTP/1.1 408"), results[name]
        assert b"connection: close" in head_part.lower()
        error = json.loads(payload)
        message = error["error"] if name == "ollama" else error["error"]["message"]
        assert message == "the request body did not arrive within 1 seconds"
        if name == "anthropic":
            assert error["type"] == "error"
    # and the server keeps serving
    r = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=4))
    assert r.json()["usage"]["completion_tokens"] == 4


async def test_a_25_mib_body_is_answered_beside_a_running_stream(start_server, client) -> None:
    backend = ScriptedBackend(token_delay=0.01)
    server = await start_server([backend])
    done: dict[str, httpx.Response] = {}

    async def stream() -> None:  # 6 s of tokens: longer than the bodies take on a busy machine
        done["stream"] = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=600, stream=True))

    big = json.dumps(chat_body("word " * (25 * 1024 * 1024 // 5 - 40), max_tokens=5)).encode()
    assert 25 * 1024 * 1024 - 1024 < len(big) <= 25 * 1024 * 1024
    image = chat_body(max_tokens=5)
    image["messages"][0]["content"] = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * (25 * 1024 * 1024 - 400)}},
    ]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        await wait_for(lambda: backend.counters.decode_steps >= 5)
        headers = {"content-type": "application/json"}
        # a prompt far past the context window: refused without encoding it all
        r = await client.post(f"{server.url}{PATH}", content=big, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        least = shipped_tokenizer().fewest_tokens(25 * 1024 * 1024 - 1024)  # from the length alone
        message = r.json()["error"]["message"]
        assert message.startswith("The prompt is at least ") and int(message.split()[5].replace(",", "")) >= least
        assert "this model's context window is 8192 tokens" in message
        # the same on count_tokens (exact up to four context windows)
        r = await client.post(f"{server.url}/v1/messages/count_tokens", content=big, headers=headers)
        assert r.status_code == 400 and "at least" in r.json()["error"]["message"]
        assert "context window is 8192 tokens" in r.json()["error"]["message"]
        # a 25 MiB image: parsed, dropped with the degradation note, answered
        r = await client.post(f"{server.url}{PATH}", json=image)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        # one byte over the limit: 413
        r = await client.post(f"{server.url}{PATH}", content=b" " * (25 * 1024 * 1024 + 1), headers=headers)
        assert r.status_code == 413
        assert not done  # the stream was still running through all of that
    frames = sse_events(done["stream"].text)
    assert frames[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in frames[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_long_text_is_measured_against_a_limit_without_encoding_it_all() -> None:
    tok = shipped_tokenizer()
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(3000))
    exact = len(tok.encode(text))
    assert len(text) > 4 * 16384  # several slices
    assert not tok.surely_longer(text, exact)  # a text of exactly the limit is encoded in full
    assert not tok.surely_longer(text, exact - 10)  # within the slack: "encode it and see"
    assert tok.surely_longer(text, exact // 2)
    assert not tok.surely_longer("short text", 1)  # short texts are always encoded
    blob = "A" * 200_000  # no whitespace to cut at
    assert tok.surely_longer(blob, len(tok.encode(blob)) // 2)
    assert not tok.surely_longer(blob, len(tok.encode(blob)))
    least = tok.tokens_past(text, exact // 2)  # a lower bound past the limit, from a few slices
    assert least is not None and exact // 2 < least <= exact


class _Spy:
    """A ``tokenizers.Tokenizer`` that tells how many characters it was given to encode."""

    def __init__(self, tok: object) -> None:
        self.tok, self.chars = tok, 0

    def encode(self, text: str, **kwargs: object) -> object:
        self.chars += len(text)
        return self.tok.encode(text, **kwargs)  # type: ignore[attr-defined]

    def encode_batch(self, texts: list[str], **kwargs: object) -> object:
        self.chars += sum(map(len, texts))
        return self.tok.encode_batch(texts, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.tok, name)


def test_a_refused_prompt_names_its_size_exactly_unless_it_is_huge() -> None:
    from types import SimpleNamespace

    from turbospark.errors import ContextOverflow
    from turbospark.messages import ChatPrompt, GenerationJob, TextPrompt
    from turbospark.model.backend import SamplingParams
    from turbospark.threads.prompt import EXACT_UP_TO, encode_prompt, render_prompt

    tok = shipped_tokenizer()
    backend = SimpleNamespace(tokenizer=tok, context_window=8192)
    line = "line {}: the quick brown fox jumps over the lazy dog\n"

    def refusal(text: str) -> ContextOverflow:
        params = SamplingParams(max_tokens=16)
        job = GenerationJob(1, "m", TextPrompt(text), params, None, 0.0)  # type: ignore[arg-type]
        with pytest.raises(ContextOverflow) as caught:
            encode_prompt(backend, job)  # type: ignore[arg-type]
        return caught.value

    # 100 K characters: surely too long, but encoded in full, so the refusal is exact
    moderate = "".join(line.format(i) for i in range(2000))
    assert 16384 < len(moderate) <= EXACT_UP_TO and tok.surely_longer(moderate, 8192)
    exact = len(tok.encode(moderate, add_bos=tok.add_bos_token))
    error = refusal(moderate)
    assert error.message == (f"The prompt is {exact:,} tokens; this model's context window is 8192 tokens. "
                             "Shorten the prompt, or serve a model with a longer context.")
    assert (error.context_window, error.prompt_tokens, error.exact, error.param) == (8192, exact, True, "messages")
    assert error.code == "context_length_exceeded" and error.status == 400
    # a prompt that fills the window leaves no room: the same refusal, not "lower max_tokens"
    fills = tok.decode(tok.encode(moderate)[:8192])
    error = refusal(fills)
    assert error.prompt_tokens == len(tok.encode(fills, add_bos=tok.add_bos_token)) >= 8192
    assert error.param == "messages" and "max_tokens" not in error.message
    # past EXACT_UP_TO: a lower bound from a few slices, named as one
    spy = _Spy(tok._tok)
    tok._tok = spy  # type: ignore[assignment]
    long = "".join(line.format(i) for i in range(6000))
    assert EXACT_UP_TO < len(long) < 4 * tok.longest_token * 8193  # not refused by length alone
    error = refusal(long)
    assert spy.chars < 64 * 1024  # a few slices, not 300 K characters
    assert not error.exact and 8192 < error.prompt_tokens
    assert error.message.startswith(f"The prompt is at least {error.prompt_tokens:,} tokens; this model's "
                                    "context window is 8192 tokens.")
    # far past it: refused by its length, nothing encoded, nor a chat rendered
    spy.chars = 0
    huge = "word " * (3 * 1024 * 1024 // 5)
    for prompt in (TextPrompt(huge), ChatPrompt(({"role": "user", "content": huge},))):
        with pytest.raises(ContextOverflow) as caught:
            render_prompt(tok, prompt, 8192)  # as the model thread asks
        assert caught.value.prompt_tokens == tok.fewest_tokens(len(huge)) > 8192
        assert not caught.value.exact and "context window is 8192 tokens" in caught.value.message
    assert spy.chars == 0
    # the exact count of the moderate one is what count_tokens answers: no refusal
    assert len(render_prompt(tok, TextPrompt(moderate), 4 * 8192, window=8192)[0]) == exact


async def _never_reading(url: str, max_tokens: int) -> trio.SocketStream:
    """A streamed chat from a client that reads nothing (a small receive buffer fills at once)."""
    import socket

    parts = urlsplit(url)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((parts.hostname, parts.port))
    stream = trio.SocketStream(sock)
    body = json.dumps(chat_body(stream=True, max_tokens=max_tokens)).encode()
    await stream.send_all(_head(url, PATH, len(body)) + body)
    return stream


async def test_a_client_that_stops_reading_is_closed_at_the_write_timeout(start_server, client) -> None:
    """Its generation runs on (the reply buffer holds every token) until a write has waited
    --write-timeout for room; then its connection closes and the generation stops, counted as
    a cancellation, while another request is answered throughout."""
    backend = ScriptedBackend(context_window=40_000)
    server = await start_server([backend], write_timeout=0.5)
    stream = await _never_reading(server.url, 30_000)
    await wait_for(lambda: backend.counters.decode_steps > 100)
    r = await client.post(f"{server.url}{PATH}", json=chat_body(max_tokens=3))
    assert r.status_code == 200
    with trio.fail_after(20):
        while 'turbospark_cancellations_total{phase="decode"} 1.0' not in (await client.get(f"{server.url}/metrics")).text:
            await trio.sleep(0.1)
    assert backend.counters.decode_steps < 30_000  # stopped far from its budget
    await stream.aclose()


async def test_shutdown_is_not_held_by_a_client_that_never_reads(nursery) -> None:
    """SIGTERM's path (``Server.stop``) with a 30,000-token stream nobody reads: the server is
    gone within its grace (graceful timeout and the margin for endings), though Hypercorn shields
    its socket writes (without the write deadlines it never ended).  Alone it takes ~3 s with a
    1 s grace; the bound allows a few seconds more, for a machine busy with other tests."""
    from turbospark.config import Settings
    from turbospark.model.backend import BackendSpec
    from turbospark.server import SHUTDOWN_MARGIN, serve

    backend = ScriptedBackend(context_window=40_000)
    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0)
    done = trio.Event()

    async def run(*, task_status: trio.TaskStatus) -> None:
        await serve(settings, [BackendSpec("scripted", lambda: backend)], task_status=task_status)
        done.set()

    server = await nursery.start(run)
    stream = await _never_reading(server.url, 30_000)
    await wait_for(lambda: backend.counters.decode_steps > 2_000)  # far more than the buffers hold
    server.stop.set()
    with trio.fail_after(settings.drain_delay + settings.graceful_timeout + SHUTDOWN_MARGIN + 5):
        await done.wait()
    await stream.aclose()
