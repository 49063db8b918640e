"""How soon a Realtime API transcription session's words arrive (decision 0045): a ``serve`` child
with the default models; a 9.6 s passage spoken by the server's own voice is streamed in real
time (100 ms frames) to ``/v1/realtime?intent=transcription`` with server VAD, ``--runs`` times.
Each word's end comes from mlx-whisper's word timestamps on the whole clip; reported is the time
from that end to the ``conversation.item.input_audio_transcription.delta`` that carries the
word: median, 90th percentile and largest, and how many words came before the commit.

    python -m turbospark.cli.blas python benchmarks/bench_transcription_deltas.py [--runs 3]
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEXT = ("The quick brown fox jumps over the lazy dog. A local server answers speech in real time. "
        "Every request is its own scope, and a client that leaves stops its work.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--words", action="store_true", help="also print each word's lateness, run by run")
    args = parser.parse_args()
    import httpx
    import mlx_whisper
    from websockets.sync.client import connect

    from benchmarks._server import Child
    from turbospark.audio import wav

    child = Child([])
    try:
        r = httpx.post(child.url + "/v1/audio/speech", json={"model": "tts-1", "input": TEXT, "response_format": "wav"},
                       timeout=120)
        samples, rate = wav.read(r.content)
        words = mlx_whisper.transcribe(
            wav.resample(samples, rate), path_or_hf_repo=str(Path.home() / ".cache/turbospark/models/whisper-tiny.en"),
            word_timestamps=True, fp16=False, temperature=0.0)
        ends = [w["end"] for seg in words["segments"] for w in seg["words"]]
        pcm = np.clip(np.interp(np.arange(0, len(samples), rate / 24000), np.arange(len(samples)), samples) * 32768,
                      -32768, 32767).astype("<i2")
        pcm = np.concatenate([pcm, np.zeros(24000, "<i2")])  # a second of silence: VAD commits
        late, before = [], 0
        for _ in range(args.runs):
            with connect(child.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription",
                         max_size=1 << 26) as ws:
                json.loads(ws.recv())
                ws.send(json.dumps({"type": "session.update", "session": {
                    "type": "transcription", "audio": {"input": {"turn_detection": {"type": "server_vad"}}}}}))
                json.loads(ws.recv())
                began = time.perf_counter()

                def send() -> None:
                    for i, at in enumerate(range(0, len(pcm), 2400)):
                        if (wait := began + i * 0.1 - time.perf_counter()) > 0:
                            time.sleep(wait)
                        ws.send(json.dumps({"type": "input_audio_buffer.append",
                                            "audio": base64.b64encode(pcm[at:at + 2400].tobytes()).decode()}))

                sender = threading.Thread(target=send)
                sender.start()
                given, committed = 0, False
                while True:
                    e = json.loads(ws.recv(timeout=60))
                    now = time.perf_counter() - began
                    committed = committed or e["type"] == "input_audio_buffer.committed"
                    if e["type"] == "conversation.item.input_audio_transcription.delta":
                        for j in range(given, min(given + len(e["delta"].split()), len(ends))):
                            late.append(now - ends[j])
                            before += not committed
                        given += len(e["delta"].split())
                    if e["type"].endswith("completed"):
                        break
                sender.join()
                if args.words:
                    print(" ".join(f"{t:.2f}" for t in late[-len(ends):]))
        lat = np.array(late)
        print(f"{len(ends)} words, {args.runs} runs: from a word's end to its delta, median {np.median(lat):.2f} s, "
              f"p90 {np.percentile(lat, 90):.2f} s, max {lat.max():.2f} s; {before} of {len(lat)} before the commit")
    finally:
        child.close()


if __name__ == "__main__":
    main()
