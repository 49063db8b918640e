"""The real MLX backend behind the server: SmolLM2-135M-Instruct for a few tokens at a time."""

from __future__ import annotations

import json
from functools import partial
import httpx
import pytest
import trio

from turbospark.config import Settings
from turbospark.messages import Generated
from turbospark.model.backend import BackendSpec
from turbospark.server import serve

from ._support import FIRST_TEXT, chat_body, raw_post, read_until, sse_events
from .realmodels import gemma_store, smollm2_store

pytestmark = pytest.mark.mlx
PATH = "/v1/chat/completions"
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture
async def mlx_server(nursery: trio.Nursery):
    """A server with SmolLM2; ``server.backend`` is the backend its model thread built."""
    from turbospark.model.mlx_backend import MlxBackend

    stored = smollm2_store()
    built: list[MlxBackend] = []

    def make() -> MlxBackend:
        built.append(MlxBackend(stored.path, model_id=stored.name, prefill_chunk=64))
        return built[0]

    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0)
    server = await nursery.start(serve, settings, [BackendSpec(stored.name, make)])
    yield _WithBackend(server, built[0])
    server.stop.set()


class _WithBackend:
    def __init__(self, server, backend) -> None:
        self.url, self.system, self.backend = server.url, server.system, backend


async def test_answers_sensibly_and_counts_exactly(mlx_server, client: httpx.AsyncClient) -> None:
    # no sampling fields, as the openai SDK sends it: the model's own defaults apply (greedy)
    r = await client.post(f"{mlx_server.url}{PATH}", json={"model": "any", "messages": FRANCE})
    data = r.json()
    assert data["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert data["choices"][0]["finish_reason"] == "stop"
    usage = data["usage"]
    assert usage["completion_tokens"] == 8  # 7 tokens of text and <|im_end|>
    from turbospark.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_store().path)
    assert usage["prompt_tokens"] == len(tok.encode_chat(FRANCE))


async def test_seed_repeats_and_second_turn_reuses_the_prefix(mlx_server, client) -> None:
    story = [{"role": "user", "content": "Invent a name for a dragon and describe it."}]
    body = {"messages": story, "temperature": 1.0, "seed": 1234, "max_tokens": 16}
    texts = [
        (await client.post(f"{mlx_server.url}{PATH}", json=body | {"seed": seed})).json()
        for seed in (1234, 1234, 99)
    ]
    texts = [t["choices"][0]["message"]["content"] for t in texts]
    assert texts[0] == texts[1]  # the same seed repeats exactly
    assert texts[0] != texts[2]  # and the sampler really samples
    first = (await client.post(f"{mlx_server.url}{PATH}", json={"messages": FRANCE, "max_tokens": 12, "temperature": 0})).json()

    answer = first["choices"][0]["message"]["content"]
    follow_up = FRANCE + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And of Germany?"},
    ]
    r = await client.post(f"{mlx_server.url}{PATH}", json={"messages": follow_up, "max_tokens": 8, "temperature": 0})
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 20
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


async def test_stop_strings_and_streaming(mlx_server, client) -> None:
    body = {"messages": FRANCE, "temperature": 0, "stop": ["Paris"], "stream": True}
    r = await client.post(f"{mlx_server.url}{PATH}", json=body)
    chunks = [json.loads(d) for _, d in sse_events(r.text)[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "The capital of France is "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_prompt_over_the_context_window_is_a_400(mlx_server, client) -> None:
    r = await client.post(f"{mlx_server.url}{PATH}", json={"messages": FRANCE, "max_tokens": 8190})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


async def test_disconnect_mid_decode_stops_the_mlx_loop(mlx_server, client) -> None:
    events = mlx_server.system.subscribe()
    story = chat_body("Tell me a very long story about the sea.", max_tokens=2000, stream=True)
    sock = await raw_post(mlx_server.url, PATH, story | {"temperature": 0})
    await read_until(sock, FIRST_TEXT, timeout=60)
    for _ in range(3):
        await read_until(sock, b"\n\n")
    steps_at_close = mlx_server.backend.decode_steps
    await sock.aclose()
    with trio.fail_after(10):
        async for event in events:
            if isinstance(event, Generated):
                break
    assert event.stop_reason == "Cancelled" and event.phase == "decode"
    # the step under way when the client left finishes; its send fails; nothing more runs
    assert mlx_server.backend.decode_steps - steps_at_close <= 1
    settled = mlx_server.backend.decode_steps
    await trio.sleep(0.5)
    assert mlx_server.backend.decode_steps == settled
    r = await client.post(f"{mlx_server.url}{PATH}", json={"messages": FRANCE, "temperature": 0})
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."


async def test_disconnect_during_prefill_stops_between_chunks(mlx_server, client) -> None:
    events = mlx_server.system.subscribe()
    long_prompt = "The sea is calm and the sky is blue. " * 120  # ~1300 tokens, 64 per chunk
    sock = await raw_post(mlx_server.url, PATH, chat_body(long_prompt, max_tokens=4))
    await trio.sleep(1.0)
    await sock.aclose()
    closed_at = trio.current_time()
    with trio.fail_after(30):
        async for event in events:
            if isinstance(event, Generated):
                break
    assert event.stop_reason == "Cancelled" and event.phase == "prefill"
    assert event.new_tokens == 0
    assert 0 < event.prefilled_tokens < event.prompt_tokens - 64
    # it stopped at the next chunk boundary: one chunk's worth of prefill time at most
    seconds_per_chunk = event.prefill_seconds / (event.prefilled_tokens / 64)
    assert trio.current_time() - closed_at < 2 * seconds_per_chunk + 0.5


async def test_sampling_edges_are_not_errors(mlx_server, client) -> None:
    texts = {}
    for name, extra in (
        ("top_k past the vocabulary", {"top_k": 10**6, "temperature": 1.0}),
        ("top_p 0", {"top_p": 0.0, "temperature": 1.0}),
        ("repetition penalty", {"repetition_penalty": 1.3, "temperature": 1.0}),
        ("penalties", {"presence_penalty": 1.0, "frequency_penalty": 1.0, "temperature": 1.0}),
    ):
        r = await client.post(f"{mlx_server.url}{PATH}", json={"messages": FRANCE} | extra)
        assert r.status_code == 200, (extra, r.text)
        texts[name] = r.json()["choices"][0]["message"]["content"]
    # top_p 0 keeps only the most likely token: greedy
    assert texts["top_p 0"] == "The capital of France is Paris."
    # a one-token prompt leaves the repetition penalty no prompt history to look at
    r = await client.post(
        f"{mlx_server.url}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 4, "repetition_penalty": 1.2},
    )
    assert r.status_code == 200 and r.json()["usage"] == {
        "prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def run_alone(backend, prompt: list[int], params, *, leave_after: int | None = None, seq: int = 0):
    """Run one sequence through the batch engine by hand: (tokens, cached prompt tokens).
    With ``leave_after`` N it leaves, as a client would, after N engine steps (0: before any)."""
    cached = backend.insert(seq, prompt, params)
    out: list[int] = []
    steps = idle = 0
    while (leave_after is None or steps < leave_after) and len(out) < params.max_tokens:
        result = backend.step()
        steps += 1
        if seq not in result.tokens:
            idle += 1  # still reading its prompt; an engine that ended it gives nothing for ever
            assert idle < 10_000, "the engine stopped giving this sequence tokens"
            continue
        for token in result.emitted(seq):  # several after a speculative step
            if token in backend.tokenizer.stop_ids or len(out) == params.max_tokens:
                break
            out.append(token)
        else:
            continue
        break
    backend.remove(seq)
    return out, cached


def test_prefix_cache_is_exact_and_keeps_other_conversations() -> None:
    from turbospark.model.backend import SamplingParams
    from turbospark.model.mlx_backend import MlxBackend

    stored = smollm2_store()
    backend = MlxBackend(stored.path, model_id=stored.name, prefill_chunk=64)
    tok = backend.tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=10)

    def run(messages, leave_after: int | None = None) -> tuple[str, int]:
        ids, cached = run_alone(backend, tok.encode_chat(messages), greedy, leave_after=leave_after)
        return tok.decode(ids), cached

    a1 = [{"role": "user", "content": "Name three colours."}]
    answer, _ = run(a1)
    a2 = a1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And three fruits?"}]
    fresh = MlxBackend(stored.path, model_id="fresh")
    reference_ids, _ = run_alone(fresh, tok.encode_chat(a2), SamplingParams(temperature=0, max_tokens=4))

    run([{"role": "user", "content": "Something else entirely."}])  # another conversation between
    text, cached = run(a2)
    assert cached > len(tok.encode_chat(a1))  # A's first turn, answer included, was reused
    assert text.startswith(tok.decode(reference_ids))  # and reuse changes nothing in the output

    # A client that leaves after one prefill chunk leaves that chunk cached; the next request for
    # the same prompt takes that entry whole, and leaving before its first step gives it back.
    long = [{"role": "user", "content": "Tell me about the sea. " * 30}]
    run(long, leave_after=1)
    first = run(long, leave_after=0)[1]
    assert first >= 64
    assert run(long, leave_after=0)[1] == first

    # The same prompt again and again (retries, a greedy default) refreshes one entry instead
    # of filling the cache with copies and pushing the other conversations out.
    other = [{"role": "user", "content": "Count to three."}]
    run(other)
    for _ in range(5):
        run(a1)
    assert run(other)[1] >= len(tok.encode_chat(other)) - 1


async def test_a_base_model_serves_plain_completions(nursery, client) -> None:
    from turbospark.model.mlx_backend import MlxBackend

    stored = gemma_store()
    make = partial(MlxBackend, stored.path, model_id=stored.name)
    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0)
    server = await nursery.start(serve, settings, [BackendSpec(stored.name, make)])
    prompt = "The history of computing is a long story that starts with"
    r = await client.post(
        f"{server.url}/v1/completions",
        json={"model": "gemma-3-270m", "prompt": prompt, "max_tokens": 16, "temperature": 0},
    )
    assert r.json()["choices"][0]["text"].startswith(" the invention of the first computer in 1947.")
    # it has no chat template, so chat finds no capable model
    r = await client.post(f"{server.url}{PATH}", json={"messages": FRANCE})
    assert r.status_code == 503 and "no model capable" in r.json()["error"]["message"]
    server.stop.set()


def test_sampling_defaults_come_from_the_model_directory(tmp_path) -> None:
    import json

    from turbospark.model.mlx_backend import generation_defaults

    # the store wrote the catalogue's defaults for the default model into its directory
    assert generation_defaults(smollm2_store().path) == {"temperature": 0.0}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 20, "eos_token_id": 2})
    )
    assert generation_defaults(tmp_path) == {"temperature": 0.7, "top_k": 20}
    # a directory without one has no defaults of its own: the runtime reads nothing else
    assert generation_defaults(tmp_path / "nothing") == {}
