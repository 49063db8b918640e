"""A voice turn through ``/v1/realtime`` on the default models (server VAD, Whisper tiny.en,
SmolLM2, the Piper voice): how long from the end of speech to the first answer audio, and from
speech over an answer (barge-in) to its last audio frame.

A ``serve`` child with the default models; a question spoken by the server's own voice is
streamed in real time (100 ms frames every 100 ms, as a microphone sends them), then silence.
Times are taken at the client, from the moment the last frame of speech went out:
``speech_stopped`` (server VAD: 500 ms of silence), the transcription, ``response.created``, the
first ``response.output_audio.delta``.  Then a long answer is asked for; once its audio flows,
the question is streamed again over it: from its first frame, the time to ``speech_started``,
to the last audio frame of the answer that arrived after it (0 when none did) and to
``response.done`` (``cancelled``), and how many audio frames still came after
``speech_started``; and how long that answer's first audio took from ``response.create`` (a
text turn: the model and the voice alone).  Medians of ``--runs``.

    python -m turbospark.cli.blas python benchmarks/bench_realtime.py [--runs 5] [--question q.wav]

The voice samples as it speaks, so each synthesis of the question ends a little differently and
VAD hears its end a frame sooner or later (``stopped`` moves by 0.1 s between invocations);
``--question FILE`` keeps one clip for runs that are compared.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from websockets.sync.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._server import Child  # noqa: E402
from turbospark.audio import wav  # noqa: E402

QUESTION = "What is the capital of France?"
FRAME = 2400  # 100 ms at 24 kHz


def spoken(url: str, text: str) -> np.ndarray:
    r = httpx.post(url + "/v1/audio/speech", json={"model": "tts-1", "input": text, "response_format": "wav"},
                   timeout=120)
    samples, rate = wav.read(r.content)
    at24k = np.interp(np.arange(0, len(samples), rate / 24000), np.arange(len(samples)), samples)
    return np.clip(at24k * 32768, -32768, 32767).astype("<i2")


def stream(ws: Any, pcm: np.ndarray) -> float:
    """``pcm`` in real time; when its last frame went out."""
    start = time.perf_counter()
    for i, at in enumerate(range(0, len(pcm), FRAME)):
        delay = start + i * 0.1 - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        ws.send(json.dumps({"type": "input_audio_buffer.append",
                            "audio": base64.b64encode(pcm[at:at + FRAME].tobytes()).decode()}))
    return time.perf_counter()


def until(ws: Any, kind: str, seen: dict[str, float], frames: list[float] | None = None) -> None:
    while True:
        event = json.loads(ws.recv(timeout=120))
        now = time.perf_counter()
        seen.setdefault(event["type"], now)
        if frames is not None and event["type"] == "response.output_audio.delta":
            frames.append(now)
        if event["type"] == kind:
            return


def one(url: str, question: np.ndarray) -> dict[str, float]:
    silence = np.zeros(24000, "<i2")
    ws_url = url.replace("http://", "ws://") + "/v1/realtime?model=gpt-realtime"
    with connect(ws_url, max_size=1 << 26) as ws:
        json.loads(ws.recv())
        seen: dict[str, float] = {}
        end = stream(ws, question)
        sender = threading.Thread(target=stream, args=(ws, np.concatenate([silence, silence])))
        sender.start()  # the microphone goes on sending silence while the answer comes
        until(ws, "response.output_audio.delta", seen)
        until(ws, "response.done", seen)
        sender.join()
        out = {
            "stopped": seen["input_audio_buffer.speech_stopped"] - end,
            "transcribed": seen["conversation.item.input_audio_transcription.completed"] - end,
            "created": seen["response.created"] - end,
            "first audio": seen["response.output_audio.delta"] - end,
        }
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Tell me a long story about a dragon and a knight."}]}}))
        asked = time.perf_counter()
        ws.send(json.dumps({"type": "response.create"}))
        seen = {}
        until(ws, "response.output_audio.delta", seen)
        out["text turn: first audio"] = seen["response.output_audio.delta"] - asked
        time.sleep(0.5)
        frames: list[float] = []
        begin = time.perf_counter()
        sender = threading.Thread(target=stream, args=(ws, question))
        sender.start()
        until(ws, "response.done", seen, frames)
        sender.join()
        started = seen["input_audio_buffer.speech_started"]
        out |= {
            "barge-in: speech_started": started - begin,
            "barge-in: last audio frame": (max(frames) if frames else begin) - begin,
            "barge-in: response.done": seen["response.done"] - begin,
            "barge-in: audio frames after speech_started": float(sum(f > started for f in frames)),
        }
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--question", type=Path, help="a WAV of the question: read if it exists, else the "
                        "voice's written there (the voice samples, so each synthesis ends differently)")
    args = parser.parse_args()
    child = Child([])
    try:
        if args.question is not None and args.question.exists():
            samples, rate = wav.read(args.question.read_bytes())
            assert rate == 24000, f"{args.question}: {rate} Hz, not the 24 kHz this writes"
            question = np.clip(np.round(samples * 32768), -32768, 32767).astype("<i2")
        else:
            question = np.concatenate([np.zeros(4800, "<i2"), spoken(child.url, QUESTION)])
            if args.question is not None:
                args.question.write_bytes(wav.encode(question.tobytes(), 24000))
        one(child.url, question)  # warm-up
        runs = [one(child.url, question) for _ in range(args.runs)]
    finally:
        child.close()
    print(f"bench_realtime: default models, {args.runs} runs, medians (seconds from the end of speech, "
          "or from the first frame of speech over the answer)")
    for key in runs[0]:
        values = [r[key] for r in runs]
        print(f"  {key:40s} {statistics.median(values):8.3f}   (min {min(values):.3f}, max {max(values):.3f})")


if __name__ == "__main__":
    main()
