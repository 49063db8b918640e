"""The per-model latency histograms in ``/metrics`` (vLLM's names and meanings, turbospark's
prefix): what each counts, sans-io and through a server on the scripted backend."""

from __future__ import annotations

import re

import trio

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from turbospark.actors._latency import Latency
from turbospark.messages import Generated
from turbospark.model.scripted import ScriptedBackend

from ._support import chat_body

NAMES = ("time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
         "request_decode_time_seconds", "e2e_request_latency_seconds", "inter_token_latency_seconds",
         "request_prompt_tokens", "request_generation_tokens")


def _value(text: str, name: str, model: str) -> float:
    m = re.search(rf'^turbospark_{name}{{model="{model}"}} (\S+)$', text, re.M)
    assert m, name
    return float(m.group(1))


def _event(**extra: object) -> Generated:
    fields = dict(id=1, model="m", prompt_tokens=30, new_tokens=4, prefill_seconds=0.2, decode_seconds=0.3,
                  stop_reason="EndOfTurn", reused_prefix_tokens=0, ttft_seconds=0.25, queue_seconds=0.05,
                  total_seconds=0.55, token_gaps=(0.1, 0.1, 0.1))
    return Generated(**(fields | extra))  # type: ignore[arg-type]


def test_one_generation_observed() -> None:
    registry = CollectorRegistry()
    latency = Latency(registry)
    latency.record(_event())
    latency.record(_event(model="other", stop_reason="Cancelled", phase="decode", token_gaps=(1.0,)))
    text = generate_latest(registry).decode()
    for name in NAMES:
        assert _value(text, name + "_count", "m") == (3 if name == "inter_token_latency_seconds" else 1)
    assert _value(text, "request_prompt_tokens_sum", "m") == 30
    assert _value(text, "request_generation_tokens_sum", "m") == 4
    assert _value(text, "e2e_request_latency_seconds_sum", "m") == 0.55
    assert 'turbospark_inter_token_latency_seconds_bucket{le="0.1",model="m"} 3.0' in text
    # a cancelled generation: its queue time and first token count, not its durations
    assert _value(text, "request_queue_time_seconds_count", "other") == 1
    assert _value(text, "time_to_first_token_seconds_count", "other") == 1
    assert "turbospark_e2e_request_latency_seconds_count{model=\"other\"}" not in text
    assert "turbospark_inter_token_latency_seconds_count{model=\"other\"}" not in text


async def test_metrics_count_what_the_requests_did(start_server, client) -> None:
    server = await start_server([ScriptedBackend(script="one two three four", token_delay=0.002)])
    usages = []
    for _ in range(2):
        r = await client.post(f"{server.url}/v1/chat/completions", json=chat_body(max_tokens=50))
        usages.append(r.json()["usage"])
    r = await client.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    usages.append(r.json()["usage"])

    with trio.fail_after(10):  # the observer records the events as they come
        while 'turbospark_e2e_request_latency_seconds_count{model="scripted"} 3.0' not in (
            text := (await client.get(f"{server.url}/metrics")).text
        ):
            await trio.sleep(0.01)
    for name in NAMES:
        assert f"# TYPE turbospark_{name} histogram" in text
    assert _value(text, "request_prompt_tokens_sum", "scripted") == sum(u["prompt_tokens"] for u in usages)
    assert _value(text, "request_generation_tokens_sum", "scripted") == sum(u["completion_tokens"] for u in usages)
    # one gap between each two consecutive tokens of each request
    assert _value(text, "inter_token_latency_seconds_count", "scripted") == sum(u["completion_tokens"] - 1 for u in usages)
    assert _value(text, "request_queue_time_seconds_count", "scripted") == 3
    assert _value(text, "time_to_first_token_seconds_count", "scripted") == 3
