"""The observer's latency histograms, per model: how long requests wait, read their prompts,
take to their first token and between tokens, and how many tokens they read and write.

Named and meant as vLLM's (``vllm:time_to_first_token_seconds`` is
``turbospark_time_to_first_token_seconds``, and so on), labelled ``model``.  Observed from the
``Generated`` event each generation ends with (the model thread's own clock); the durations of
a generation that did not run to its end (cancelled, failed, shut down) are left out, as vLLM
leaves out aborted requests, but its time in the queue and to its first token count.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from ..messages import Generated

__all__ = ["LATENCY_BUCKETS", "Latency", "TOKEN_BUCKETS", "TOKEN_GAP_BUCKETS"]

# Bucket edges for a 135M model on a CPU and a large one on a GPU alike: a millisecond to ten
# minutes, a millisecond to seconds between tokens, one token to 200,000.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
_ENDED = ("MaxTokens", "EndOfTurn", "Eos", "StopString")  # ran to its end


class Latency:
    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=registry)

        self.ttft = histogram("turbospark_time_to_first_token_seconds", "From request accepted to its first token")
        self.queue = histogram("turbospark_request_queue_time_seconds",
                               "From request accepted to the model starting on it (queued, waiting for room)")
        self.prefill = histogram("turbospark_request_prefill_time_seconds",
                                 "Reading the prompt: from the model starting on it to its first token")
        self.decode = histogram("turbospark_request_decode_time_seconds", "Generating: from the first token to the last")
        self.e2e = histogram("turbospark_e2e_request_latency_seconds", "From request accepted to its last token")
        self.itl = histogram("turbospark_inter_token_latency_seconds", "Between consecutive tokens of a sequence",
                             TOKEN_GAP_BUCKETS)
        self.prompt = histogram("turbospark_request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.generation = histogram("turbospark_request_generation_tokens",
                                    "Tokens generated per request (every choice)", TOKEN_BUCKETS)

    def record(self, event: Generated) -> None:
        model = event.model
        if event.ttft_seconds is not None:
            self.ttft.labels(model).observe(event.ttft_seconds)
        if event.began and event.queue_seconds is not None:
            self.queue.labels(model).observe(event.queue_seconds)
        if event.stop_reason not in _ENDED:
            return
        self.prefill.labels(model).observe(event.prefill_seconds)
        self.decode.labels(model).observe(event.decode_seconds)
        if event.total_seconds is not None:
            self.e2e.labels(model).observe(event.total_seconds)
        self.prompt.labels(model).observe(event.prompt_tokens)
        self.generation.labels(model).observe(event.new_tokens)
        itl = self.itl.labels(model)
        for gap in event.token_gaps:
            itl.observe(gap)
