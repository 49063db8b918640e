"""Small helpers shared by the HTTP tests."""

from __future__ import annotations

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
