"""The web page's sans-io parts: the live status fold and who may fetch the page."""

from __future__ import annotations

import base64

from turbospark.messages import BatchState, Generated, ModelLoaded, ModelUnloaded, QueueDepth, RequestFinished
from turbospark.web.page import asset, is_page, subprotocol_key, wants_page
from turbospark.web.status import HISTORY_SECONDS, MAX_ERRORS, StatusFold

METRICS = """\
# TYPE turbospark_cancellations counter
turbospark_cancellations_total{phase="queued"} 1.0
turbospark_cancellations_total{phase="prefill"} 0.0
turbospark_cancellations_total{phase="decode"} 4.0
# TYPE turbospark_generated_tokens counter
turbospark_generated_tokens_total 120.0
# TYPE turbospark_requests counter
turbospark_requests_total{route="/v1/chat/completions",status="200"} 7.0
turbospark_requests_total{route="/health",status="200"} 2.0
"""


def generated(model: str, tokens: int, stop: str = "Stop", phase: str | None = None) -> Generated:
    return Generated(id=1, model=model, prompt_tokens=10, new_tokens=tokens, prefill_seconds=0.1,
                     decode_seconds=0.5, stop_reason=stop, reused_prefix_tokens=0, phase=phase)  # type: ignore[arg-type]


def test_counters_start_from_the_metrics_and_follow_the_events() -> None:
    fold = StatusFold()
    fold.seed(METRICS)
    fold.seed(METRICS)  # seeding again (a feed that subscribed again) sets, never adds
    assert fold.cancellations == {"queued": 1, "prefill": 0, "decode": 4}
    assert fold.generated_tokens == 120 and fold.requests == 9
    fold.record(generated("a", 5, "Cancelled", "prefill"), 100.0)
    fold.record(BatchState("a", 3, 4096), 100.2)
    fold.record(QueueDepth("a", 2), 100.3)
    fold.record(RequestFinished(id=42, route="/v1/chat/completions", status=503, duration_ms=1.0, error="queue full"), 100.4)
    snap = fold.snapshot(100.5, [{"model": "a", "leases": 1, "expires": None}])
    assert snap["cancellations"] == {"queued": 1, "prefill": 1, "decode": 4}
    assert snap["generated_tokens"] == 125 and snap["requests"] == 10
    assert snap["running"] == 3 and snap["queue_depth"] == 2 and snap["kv_bytes"] == 4096
    assert snap["models"]["a"] == {"running": 3, "kv_bytes": 4096, "queued": 2, "size": 0, "loaded": False, "tokens": 5}
    assert snap["errors"] == [{"id": 42, "route": "/v1/chat/completions", "status": 503, "error": "queue full", "at": 100.4}]
    assert snap["loaded"] == [{"model": "a", "leases": 1, "expires": None}]


def test_history_has_a_point_a_second_and_is_bounded() -> None:
    fold = StatusFold()
    fold.record(ModelLoaded("a", 1.0, 1000), 10.0)
    fold.record(generated("a", 7), 10.5)
    fold.record(BatchState("a", 2, 0), 10.6)
    fold.record(generated("a", 3), 12.1)  # second 11 had no events: a point of its own
    snap = fold.snapshot(13.0)
    assert [(p["t"], p["tokens"], p["running"]) for p in snap["history"]] == [(10, 7, 2), (11, 0, 2), (12, 3, 2)]
    assert snap["tokens_per_second"] == round(10 / 3, 2)
    fold.record(ModelUnloaded("a", "expired"), 13.5)
    assert fold.snapshot(14.0)["models"]["a"]["loaded"] is False
    later = fold.snapshot(14.0 + 10 * HISTORY_SECONDS)  # a long silence is skipped, not looped over
    assert len(later["history"]) == HISTORY_SECONDS and later["history"][-1]["t"] == int(13.0 + 10 * HISTORY_SECONDS)
    for i in range(MAX_ERRORS + 5):
        fold.record(RequestFinished(id=i, route="/x", status=400, duration_ms=1.0), 20000.0)
    errors = fold.snapshot(20000.0)["errors"]
    assert len(errors) == MAX_ERRORS and errors[0]["id"] == MAX_ERRORS + 4  # newest first


def test_the_page_is_for_browsers_and_its_files_only_by_name() -> None:
    assert wants_page("GET", "text/html,application/xhtml+xml;q=0.9") and not wants_page("HEAD", "text/html")
    assert not wants_page("GET", "*/*") and not wants_page("GET", None)
    assert is_page("GET", "/", "text/html") and not is_page("GET", "/", "application/json")
    assert is_page("GET", "/ui/app.js", None) and not is_page("POST", "/ui/app.js", None)
    assert not is_page("GET", "/api/tags", "text/html")
    assert asset("index.html")[1] == "text/html; charset=utf-8"  # type: ignore[index]
    assert asset("../page.py") is None and asset("page.py") is None and asset("nothing.js") is None


def test_a_browser_websocket_offers_its_key_as_a_subprotocol() -> None:
    key = "s3cret key/with+symbols"
    encoded = base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")
    assert subprotocol_key(f"turbospark, turbospark-key.{encoded}") == key
    assert subprotocol_key("turbospark") == "" and subprotocol_key(None) == ""
    assert subprotocol_key("turbospark-key.%%%") == ""
