"""Prompt-lookup speculation with the real default model (SmolLM2-135M-Instruct): greedy text with
speculation equals greedy text without it, alone and in a batch of two, while drafts really are
kept; a request can turn it off; a client that leaves while its drafts are checked stops within
that step."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
import trio

from turbospark.config import Settings
from turbospark.kernels import ops as kernels
from turbospark.messages import Generated
from turbospark.model.backend import BackendSpec, SamplingParams
from turbospark.server import serve

from ._support import FIRST_TEXT, raw_post, read_until
from .realmodels import smollm2_store

pytestmark = pytest.mark.mlx
PASSAGE = (
    "The keeper climbed the spiral stair at dusk with a can of oil and a green notebook. He wrote "
    "the colour of the sky, the wind, the swell and the names of the ships that passed."
)
COPY = [{"role": "user", "content": "Repeat this text exactly:\n\n" + PASSAGE}]
STORY = [{"role": "user", "content": "Write a short story about a dragon."}]


def greedy(backend, prompts: list[list[int]], new: int, speculate: int, **sampling) -> list[list[int]]:
    """``new`` tokens of each prompt, decoded together (greedy unless ``sampling`` says)."""
    backend.speculate_up_to = speculate
    for seq, ids in enumerate(prompts):
        backend.insert(seq, ids, SamplingParams(**{"max_tokens": new, "temperature": 0.0, **sampling}))
    out: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < new for o in out):
        step = backend.step()
        for seq in step.tokens:
            out[seq] += step.emitted(seq)
    for seq in range(len(prompts)):
        backend.remove(seq, keep_cache=False)
    return [o[:new] for o in out]


def test_greedy_text_is_the_same_with_speculation_alone_and_in_a_batch() -> None:
    from turbospark.model.mlx_backend import MlxBackend

    stored = smollm2_store()
    backend = MlxBackend(stored.path, model_id=stored.name, cache_entries=0)
    # by default one sequence speculates on the CPU kernels (a verifying row costs what a token
    # does there), up to 4 on MLX's own ops (decision 0025)
    assert backend.speculate_up_to == (1 if kernels.available() and mx.default_device() == mx.cpu else 4)
    tok = backend.tokenizer
    copy, story = (tok.encode(tok.render_chat(m)) for m in (COPY, STORY))
    plain = greedy(backend, [copy, story], 24, speculate=0)
    backend.accepted = 0
    assert greedy(backend, [copy], 24, speculate=1) == plain[:1]
    assert backend.accepted > 0  # drafts were checked and kept
    backend.accepted = 0
    assert greedy(backend, [copy, story], 24, speculate=2) == plain
    assert backend.accepted > 0


def test_a_newcomer_read_in_one_pass_beside_the_streams_leaves_every_text_as_it_was() -> None:
    """Joins (``mlx_fused``, ``mlx_joining``): the streams' and the newcomer's greedy tokens are
    the ones the engine's own two-pass steps give."""
    from turbospark.model.mlx_backend import MlxBackend

    stored = smollm2_store()
    backend = MlxBackend(stored.path, model_id=stored.name, cache_entries=0)
    backend.speculate_up_to = 0
    tok = backend.tokenizer
    topics = ["a dragon", "the sea", "a robot", "winter"]
    running = [tok.encode(tok.render_chat([{"role": "user", "content": f"Write a story about {t}."}])) for t in topics]
    joiner = tok.encode(tok.render_chat([{"role": "user", "content": "Summarise this:\n\n" + PASSAGE * 3}]))

    def run(fuse: bool) -> list[list[int]]:
        backend.fuse = fuse
        out: list[list[int]] = [[] for _ in range(5)]
        for seq, ids in enumerate(running):
            backend.insert(seq, ids, SamplingParams(max_tokens=40, temperature=0.0))
        steps = 0
        while any(len(o) < 40 for o in out[:4]) or len(out[4]) < 12:
            if (steps := steps + 1) == 4:
                backend.insert(4, joiner, SamplingParams(max_tokens=12, temperature=0.0))
            step = backend.step()
            for seq in step.tokens:
                out[seq] += step.emitted(seq)
        for seq in range(5):
            backend.remove(seq, keep_cache=False)
        return [o[:n] for o, n in zip(out, [40] * 4 + [12], strict=True)]

    plain = run(False)
    assert backend.fused_steps == 0
    assert run(True) == plain
    assert backend.fused_steps > len(joiner) // backend.prefill_chunk  # its chunks were read beside them


_served: list = []  # the spec_server's backend, to read how many drafts it kept


@pytest.fixture
async def spec_server(nursery: trio.Nursery):
    from turbospark.model.mlx_backend import MlxBackend

    stored = smollm2_store()

    def make() -> MlxBackend:
        _served.append(backend := MlxBackend(stored.path, model_id=stored.name, prefill_chunk=64))
        return backend

    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0, max_batch=4)
    server = await nursery.start(serve, settings, [BackendSpec(stored.name, make)])
    yield server
    server.stop.set()


async def test_speculative_false_gives_the_same_text_and_a_bad_value_is_a_400(spec_server, client) -> None:
    url = f"{spec_server.url}/v1/chat/completions"
    body = {"messages": COPY, "max_tokens": 16, "temperature": 0}
    on = await client.post(url, json=body)
    off = await client.post(url, json={**body, "speculative": False})
    assert on.json()["choices"][0]["message"]["content"] == off.json()["choices"][0]["message"]["content"]
    bad = await client.post(url, json={**body, "speculative": "sometimes"})
    assert bad.status_code == 400
    assert "speculative" in bad.json()["error"]["message"]


async def test_a_client_leaving_while_drafts_are_checked_stops_within_that_step(spec_server) -> None:
    events = spec_server.system.subscribe(buffer=100_000)
    leaving = await raw_post(spec_server.url, "/v1/chat/completions", {
        "messages": COPY, "max_tokens": 200, "stream": True, "temperature": 0})
    seen = await read_until(leaving, FIRST_TEXT, timeout=120)
    for _ in range(6):
        seen += await read_until(leaving, b"\n\n", timeout=60)
    await leaving.aclose()
    with trio.fail_after(60):
        async for event in events:
            if isinstance(event, Generated) and event.stop_reason == "Cancelled":
                break
    assert event.phase == "decode"
    # what it had shown, then at most the step in flight and one more, each of at most a full
    # draft (12) and its bonus token: far short of the 200 it asked for
    assert event.new_tokens <= seen.count(b'"content"') + 1 + 2 * 13


async def test_stop_strings_budgets_and_the_prefix_cache_are_exact_under_speculation(spec_server, client) -> None:
    """A stop string or a budget that falls inside a kept draft ends the text where plain
    decoding ends it (the same text, finish reason and token count), and a follow-up turn
    reads as much of its prompt from the prefix cache after a speculative answer as after a
    plain one: rejected draft tokens never reach a client or the cache."""
    url = f"{spec_server.url}/v1/chat/completions"

    async def both(body: dict) -> tuple[dict, dict]:
        on = (await client.post(url, json=body)).json()
        off = (await client.post(url, json={**body, "speculative": False})).json()
        return on, off

    for extra in ({"stop": ["swell"]}, {"max_tokens": 13}, {"stop": ["ships", "notebook"]}):
        kept = _served[-1].accepted
        on, off = await both({"messages": COPY, "max_tokens": 40, "temperature": 0, **extra})
        assert _served[-1].accepted > kept, extra  # drafts were checked and kept
        assert on["choices"][0]["message"] == off["choices"][0]["message"], extra
        assert on["choices"][0]["finish_reason"] == off["choices"][0]["finish_reason"], extra
        assert on["usage"]["completion_tokens"] == off["usage"]["completion_tokens"], extra

    async def follow_up(speculative: bool) -> int:
        first = [{"role": "system", "content": f"Session {'AB'[speculative]}."}, *COPY]
        body = {"messages": first, "max_tokens": 24, "temperature": 0, "speculative": speculative}
        answer = (await client.post(url, json=body)).json()["choices"][0]["message"]["content"]
        turn = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Again."}]
        r = await client.post(url, json={**body, "messages": turn, "max_tokens": 2})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await follow_up(True) == await follow_up(False) > 40


async def test_logprobs_and_constraints_stay_exact_under_speculation(spec_server, client) -> None:
    """A request that reports log-probabilities, or whose output a JSON Schema constrains (or
    both), speculates too: the same text, the same tokens with the same log-probabilities and
    alternatives as without speculation, while drafts are kept; the grammar's matcher is rolled
    back past refused drafts (the constrained answer still parses and fills the schema)."""
    url = f"{spec_server.url}/v1/chat/completions"
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
              "additionalProperties": False}
    ask = [{"role": "user", "content": 'Answer in JSON as {"text": ...}. Repeat this text exactly:\n\n' + PASSAGE}]
    constrained = {"type": "json_schema", "json_schema": {"name": "copy", "schema": schema}}
    cases = {
        "logprobs": {"messages": COPY, "logprobs": True, "top_logprobs": 3},
        "schema": {"messages": ask, "response_format": constrained},
        "both": {"messages": ask, "response_format": constrained, "logprobs": True, "top_logprobs": 2},
    }
    for name, extra in cases.items():
        body = {"max_tokens": 40, "temperature": 0, **extra}
        kept = _served[-1].accepted
        on = (await client.post(url, json=body)).json()["choices"][0]
        assert _served[-1].accepted > kept, name  # drafts were checked and kept
        off = (await client.post(url, json={**body, "speculative": False})).json()["choices"][0]
        assert on["message"] == off["message"], name
        assert on["finish_reason"] == off["finish_reason"], name
        if "logprobs" in extra:
            mine, plain = on["logprobs"]["content"], off["logprobs"]["content"]
            assert [t["token"] for t in mine] == [t["token"] for t in plain], name
            assert len(mine) == len(plain) > 20, name
            for a, b in zip(mine, plain, strict=True):
                assert a["logprob"] == pytest.approx(b["logprob"], abs=2e-3), name
                assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]], name
        if "response_format" in extra and on["finish_reason"] == "stop":
            assert set(json.loads(on["message"]["content"])) == {"text"}, name


def test_a_draft_model_drafts_where_prompt_lookup_cannot_and_the_text_is_the_same() -> None:
    """``--draft-model`` on the real model (itself as its draft: the one model here with its
    vocabulary): greedy text and seeded text equal plain decoding, drafts are kept on the
    story, where the prompt has nothing to copy; a draft model of another vocabulary is refused."""
    from turbospark.model.mlx_backend import MlxBackend

    from .realmodels import gemma_store

    stored = smollm2_store()
    plain = MlxBackend(stored.path, model_id=stored.name, cache_entries=0)
    drafted = MlxBackend(stored.path, model_id=stored.name, cache_entries=0, draft_path=stored.path)
    tok = plain.tokenizer
    copy, story = (tok.encode(tok.render_chat(m)) for m in (COPY, STORY))
    expected = greedy(plain, [story, copy], 16, speculate=0)
    assert greedy(drafted, [story], 16, speculate=1) == expected[:1]
    assert drafted.accepted > 0  # the story had drafts, all of them kept: the draft is the model
    assert greedy(drafted, [story, copy], 16, speculate=2) == expected
    for seed in range(3):  # a sampled draft token is kept with the model's own probability
        seeded = {"temperature": 1.0, "seed": seed}
        assert greedy(drafted, [story], 12, speculate=1, **seeded) == greedy(plain, [story], 12, speculate=0, **seeded)
    with pytest.raises(ValueError, match="does not share this model's vocabulary"):
        MlxBackend(stored.path, model_id=stored.name, draft_path=gemma_store().path)

