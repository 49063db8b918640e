"""The probes a load balancer reads (``/health/live``, ``/health/ready``) and how a replica
drains on shutdown: readiness turns 503 at once, requests in flight finish, a new request on a
kept-alive connection is a retryable 503 with ``Connection: close``."""

from __future__ import annotations

import json

import httpx
import trio

from turbospark.model.scripted import ScriptedBackend

from ._support import chat_body, sse_events, wait_for


async def _exchange(stream: trio.SocketStream, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on a kept-alive connection: status, headers, body (by length)."""
    await stream.send_all(request)
    data = b""
    with trio.fail_after(10):
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            body += await stream.receive_some(65536)
    return int(lines[0].split()[1]), headers, body


def _get(path: str, port: int) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()


async def test_live_and_ready_say_what_a_balancer_needs(start_server, client: httpx.AsyncClient) -> None:
    server = await start_server(api_key="s3cret")  # probes are never authenticated
    r = await client.get(f"{server.url}/health/live")
    assert (r.status_code, r.json()) == (200, {"status": "live", "faults": {"model": 0, "encoder": 0, "audio": 0, "image": 0, "observer": 0}})
    r = await client.get(f"{server.url}/health/ready")
    assert r.status_code == 200
    assert r.json() == {"status": "ready", "models": ["scripted"], "queue": {}}
    assert (await client.get(f"{server.url}/health")).json() == {"status": "ok", "state": "ready"}


async def test_a_full_queue_makes_the_replica_not_ready(start_server, client: httpx.AsyncClient) -> None:
    backend = ScriptedBackend(token_delay=0.02)
    server = await start_server([backend], max_queue=1, max_batch=1)
    url = f"{server.url}/v1/chat/completions"
    async with trio.open_nursery() as nursery:
        async def post(max_tokens: int) -> None:
            await client.post(url, json=chat_body(max_tokens=max_tokens))

        nursery.start_soon(post, 40)  # runs
        await wait_for(lambda: backend.counters.generations == 1)
        nursery.start_soon(post, 2)  # waits: the queue is full

        async def not_ready() -> bool:
            return (await client.get(f"{server.url}/health/ready")).status_code == 503

        with trio.fail_after(10):
            while not await not_ready():
                await trio.sleep(0.02)
        body = (await client.get(f"{server.url}/health/ready")).json()
        assert body["status"] == "not_ready" and body["reasons"] == ["the queue of scripted is full"]
        assert body["queue"] == {"scripted": 1}
    # both answered: ready again
    r = await client.get(f"{server.url}/health/ready")
    assert r.status_code == 200 and r.json()["queue"] == {"scripted": 0}
    metrics = (await client.get(f"{server.url}/metrics")).text
    assert 'turbospark_model_queue_depth{model="scripted"} 0.0' in metrics
    assert 'turbospark_model_loaded{model="scripted"} 1.0' in metrics


async def test_a_draining_replica_finishes_its_streams_and_turns_new_requests_away(
    start_server, client: httpx.AsyncClient
) -> None:
    backend = ScriptedBackend(token_delay=0.02)
    server = await start_server([backend], graceful_timeout=30.0, drain_delay=30.0)
    port = int(server.url.rsplit(":", 1)[1])
    kept = await trio.open_tcp_stream("127.0.0.1", port)
    probe = await trio.open_tcp_stream("127.0.0.1", port)
    status, _, _ = await _exchange(kept, _get("/v1/models", port))
    assert status == 200
    status, _, body = await _exchange(probe, _get("/health/ready", port))
    assert status == 200
    streamed: list[httpx.Response] = []

    async def stream() -> None:
        body = chat_body(max_tokens=60, stream=True)
        streamed.append(await client.post(f"{server.url}/v1/chat/completions", json=body))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        await wait_for(lambda: backend.counters.decode_steps >= 3)
        server.stop.set()
        # readiness is 503 at once, while the stream still runs
        with trio.fail_after(10):
            while True:
                status, _, body = await _exchange(probe, _get("/health/ready", port))
                if status == 503:
                    break
                await trio.sleep(0.01)
        assert json.loads(body)["reasons"] == ["draining"]
        status, _, _ = await _exchange(probe, _get("/health/live", port))
        assert status == 200
        # a new request on a kept-alive connection: a retryable 503, and the connection closes
        status, headers, body = await _exchange(kept, _get("/v1/models", port))
        assert status == 503 and headers["connection"] == "close" and headers["retry-after"] == "1"
        error = json.loads(body)["error"]
        assert error["code"] == "draining" and error["retryable"] is True
        with trio.fail_after(5):
            assert await kept.receive_some(1) == b""
        assert backend.counters.decode_steps < 60  # the stream was still running meanwhile
        # the port stays open meanwhile: a new connection is answered too
        r = await client.get(f"{server.url}/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    (r,) = streamed
    frames = sse_events(r.text)
    assert frames[-1][1] == "[DONE]"
    finish = [json.loads(d)["choices"][0]["finish_reason"] for _, d in frames[:-1] if json.loads(d)["choices"]]
    assert finish[-1] == "length"
    await probe.aclose()
    await kept.aclose()


async def test_a_failed_server_answers_what_is_in_flight_and_what_comes_503(start_server, client: httpx.AsyncClient) -> None:
    """``System.fail`` (a lost rank of a sharded model, ``cli/lifeline.py``): a stream whose model
    will never answer again ends with a retryable 503 error event now, a new request is a 503
    with ``Connection: close``, and readiness says why."""
    from turbospark.errors import RankLost

    from ._support import FIRST_TEXT, raw_post, read_until

    server = await start_server([ScriptedBackend(token_delay=0.05)])
    sock = await raw_post(server.url, "/v1/chat/completions", chat_body(stream=True, max_tokens=500))
    await read_until(sock, FIRST_TEXT)
    server.system.fail(RankLost("rank 1 exited"))
    rest = await read_until(sock, b'"code":"rank_lost"')
    assert b"event: error" in rest and b"[DONE]" not in rest
    await sock.aclose()
    r = await client.post(f"{server.url}/v1/messages", json={
        "model": "scripted", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
    assert r.headers["connection"] == "close" and "rank 1 exited" in r.json()["error"]["message"]
    r = await client.get(f"{server.url}/health/ready")
    assert r.status_code == 503 and "failed: rank_lost" in r.json()["reasons"]
