"""Speculation side by side: one stream's decode speed, plain against prompt lookup (and, with
``--draft-model``, against a draft model).

Three workloads on the same model, greedy: free prose (little to copy), repeating back a given
~300-word passage, and code completion that copies from its context.  For each, the paths'
runs alternate (so whatever else the machine is doing weighs on all alike); every run starts
cold (no prefix cache).  Reported per workload and path: decode tok/s, medians over the runs
((new tokens - 1) / time from the first token to the last), the ratio to plain, the share of
draft tokens kept, and whether the greedy text is identical to plain.  Then the join stall: ``--streams`` streams
decode, a ~300-token request arrives; the streams' median gap between tokens before it, their
longest gap while it prefills, its time to first token, and the streams' longest gap in the 8
steps after it (while its layers are merged into the batch's cache); three ways, alternating:
the whole chunk every mixed step in mlx-lm's two forward passes (as before pacing), the paced
chunk (``pacing.JoinPacer``) in two passes, and the paced chunk in one pass (``mlx_fused``).

    python benchmarks/bench_speculative.py [--model smollm2-135m-instruct] [--draft-model ID]
                                           [--runs 3] [--max-tokens 96] [--server]

With llama-cpp-python installed (``scripts/check-against-llama-cpp`` builds it), the table has
llama.cpp's rows too: the same prompt ids on the GGUF the model was imported from, plain and with
its own prompt-lookup decoding, greedy, on as many threads.

``--server`` instead sends the repeat-a-passage request through the HTTP API, speculation on and
off, as a new user would.

It drives the backend in-process (the engine step the server runs), with OpenBLAS preloaded where
installed, as ``python -m turbospark serve`` does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PASSAGE = (
    "The lighthouse stood on a narrow spit of rock at the mouth of the harbour, and for forty years "
    "the same family had kept its lamp burning. Every evening at dusk the keeper climbed the one "
    "hundred and twelve steps of the spiral stair, carrying a can of oil, a clean cloth and a small "
    "notebook bound in green leather. In the notebook he wrote the colour of the sky, the direction "
    "and strength of the wind, the height of the swell and the names of the ships that passed. Most "
    "nights were quiet. The fishing boats came home before dark, the ferry crossed twice, and the "
    "only sound was the slow turning of the lens and the water breaking on the rocks below. But in "
    "winter the storms came in from the west without warning, and then the keeper did not sleep. He "
    "watched the light, trimmed the wick, wiped the salt from the glass and listened for the horns "
    "of ships that had lost their way. Once, in a gale that tore the roof from the boathouse, a "
    "cargo ship ran aground on the outer reef, and the keeper rowed out alone in the grey morning to "
    "bring the crew ashore, six men in three trips, his hands bleeding on the oars. The harbour "
    "master gave him a medal, which he kept in a drawer with his spare wicks and never wore. When "
    "the light was finally automated, the keeper moved to a cottage in the village, but every "
    "evening at dusk he still walked to the end of the pier to watch the lamp come on by itself."
)

CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users


def load_orders(path):
    orders = []
    with open(path) as f:
        for line in f:
'''

WORKLOADS = {
    "free prose": [{"role": "user", "content": "Write a short story about a dragon who learns to bake bread."}],
    "repeat a passage": [{"role": "user", "content": "Repeat the following passage back to me exactly, word for word:\n\n" + PASSAGE}],
    "code completion": [{"role": "user", "content": "Complete this Python file. Reply with the whole file in one code block.\n\n```python\n" + CODE + "```"}],
}


def run(backend, ids: list[int], speculate: bool, max_tokens: int) -> tuple[float, list[int], int, int]:
    from turbospark.model.backend import SamplingParams

    backend.speculate_up_to = 1 if speculate else 0
    backend.drafted = backend.accepted = 0
    backend.insert(0, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    out: list[int] = []
    first = last = 0.0
    while len(out) < max_tokens:
        step = backend.step()
        if 0 in step.tokens:
            last = time.perf_counter()
            first = first or last
            out += step.emitted(0)
            if backend.tokenizer.stop_ids and out[-1] in backend.tokenizer.stop_ids:
                break
    backend.remove(0, keep_cache=False)
    speed = (len(out) - 1) / (last - first) if last > first else float("nan")  # one step gave them all
    return speed, out, backend.drafted, backend.accepted


def batch(backend, prompts: list[list[int]], speculate: bool, max_tokens: int) -> float:
    """``prompts`` decoding together, speculating (all of them) or not: tokens a second, all
    rows together, from the first step that gives every row a token to the end."""
    from turbospark.model.backend import SamplingParams

    backend.speculate_up_to = len(prompts) if speculate else 0
    for seq, ids in enumerate(prompts):
        backend.insert(seq, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    counts = [0] * len(prompts)
    first = 0.0
    while min(counts) < max_tokens:
        step = backend.step()
        for seq in step.tokens:
            counts[seq] += len(step.emitted(seq))
        if not first and all(counts):
            first, base = time.perf_counter(), sum(counts)
    took = time.perf_counter() - first
    for seq in range(len(prompts)):
        backend.remove(seq, keep_cache=False)
    return (sum(min(c, max_tokens) for c in counts) - base) / took


def join(backend, running: list[list[int]], joiner: list[int], paced: bool, before: int = 6,
         after: int = 8) -> tuple[float, float, float, float]:
    """``running`` streams decode; after ``before`` steps ``joiner`` arrives.  Returns the
    streams' median gap before it came, their longest gap while it prefilled (up to its first
    token), its time to first token, and the longest gap of the ``after`` steps that follow,
    while it decodes beside them (seconds).  ``paced`` False: every mixed step prefills the
    whole chunk."""
    from turbospark.model.backend import SamplingParams
    backend.speculate_up_to = 0
    backend.pacer = backend.join_pacer()
    if not paced:
        backend.pacer.size = lambda decoding: backend.prefill_chunk
    for seq, ids in enumerate(running):
        backend.insert(seq, ids, SamplingParams(max_tokens=400, temperature=0.0))
    while len(backend.step().tokens) < len(running):  # every stream decodes
        pass
    gaps, last = [], time.perf_counter()
    for _ in range(before):
        backend.step()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    new = len(running)
    arrived = time.perf_counter()
    backend.insert(new, joiner, SamplingParams(max_tokens=after + 4, temperature=0.0))
    stalls = []
    while True:
        step = backend.step()
        now = time.perf_counter()
        stalls.append(now - last)
        last = now
        if new in step.tokens:
            break
    first = now - arrived
    later = []
    for _ in range(after):
        backend.step()
        now = time.perf_counter()
        later.append(now - last)
        last = now
    for seq in range(new + 1):
        backend.remove(seq, keep_cache=False)
    return statistics.median(gaps), max(stalls), first, max(later)


def llama_cpp_paths(model: str, max_tokens: int) -> dict[str, Any]:
    """llama.cpp on the GGUF the catalogue model comes from, plain and with its own prompt-lookup
    decoding (llama-cpp-python's ``LlamaPromptLookupDecoding``, 10-token drafts), each in its own
    process (``bench_llama_cpp``'s children, greedy, not stopping at the end of turn); none when
    llama-cpp-python is not installed (``scripts/check-against-llama-cpp`` builds it)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _gguf import catalogue_gguf
    from bench_llama_cpp import Child, llama_cpp_python

    from turbospark.store.catalogue import CATALOGUE

    python = llama_cpp_python()
    if python is None or model not in CATALOGUE:
        print("llama.cpp: skipped (llama-cpp-python is not installed in $LLAMA_CPP_VENV, default "
              "tests/.cache/llama-cpp/venv, or the model is not in the catalogue)", file=sys.stderr)
        return {}
    command = [str(python), str(Path(__file__).with_name("bench_llama_cpp.py")), "--threads", str(os.cpu_count() or 2),
               "--child", "llama-cpp", "--path", str(catalogue_gguf(model)), "--prompt-tokens", "1024",
               "--max-tokens", str(max_tokens)]
    return {"llama.cpp": Child(command, dict(os.environ)),
            "llama.cpp lookup": Child([*command, "--lookup", "10"], dict(os.environ))}


def through_the_server(model_dir, model: str, runs: int, max_tokens: int) -> None:
    """What a new user sees: the repeat-a-passage request through ``/v1/chat/completions``,
    speculation on (the default) and off (``"speculative": false``), alternating: the whole
    request's time and the decode speed the reply's ``timings`` report."""
    from functools import partial

    import httpx
    import trio

    from turbospark.config import Settings
    from turbospark.model.backend import BackendSpec
    from turbospark.model.mlx_backend import MlxBackend
    from turbospark.server import serve

    async def go() -> None:
        results: dict[bool, list[tuple[float, float, str]]] = {True: [], False: []}
        async with trio.open_nursery() as nursery:
            server = await nursery.start(partial(
                serve, Settings(host="127.0.0.1", port=0, graceful_timeout=1.0),
                [BackendSpec(model, lambda: MlxBackend(model_dir, model_id=model, cache_entries=0))],
            ))
            async with httpx.AsyncClient(timeout=600) as client:
                for run_ in range(runs + 1):
                    for speculative in (True, False):
                        body = {"model": model, "messages": WORKLOADS["repeat a passage"], "temperature": 0,
                                "max_tokens": max_tokens, "speculative": speculative}
                        began = time.perf_counter()
                        r = (await client.post(f"{server.url}/v1/chat/completions", json=body)).json()
                        if run_:  # the first round warms up
                            results[speculative].append((time.perf_counter() - began, r["timings"]["predicted_per_second"],
                                                         r["choices"][0]["message"]["content"]))
            server.stop.set()
        on = [statistics.median(x[i] for x in results[True]) for i in (0, 1)]
        off = [statistics.median(x[i] for x in results[False]) for i in (0, 1)]
        same = {x[2] for x in results[True]} == {x[2] for x in results[False]}
        print(f"through the server, repeat a passage, {max_tokens} new tokens (medians of {runs}):")
        print("| speculation | whole request s | decode tok/s | same text |")
        print("| --- | --- | --- | --- |")
        print(f"| off | {off[0]:.2f} | {off[1]:.1f} | |")
        print(f"| on | {on[0]:.2f} ({off[0] / on[0]:.2f}x faster) | {on[1]:.1f} ({on[1] / off[1]:.2f}x) | {'yes' if same else 'no'} |",
              flush=True)

    trio.run(go)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--streams", type=int, default=8, help="streams decoding when a request joins")
    parser.add_argument("--skip-speed", action="store_true", help="only the join part")
    parser.add_argument("--draft-model", help="also time speculation with this draft model")
    parser.add_argument("--batches", default="1,2,4,8", help="batch sizes for the cut-off table ('' to skip)")
    parser.add_argument("--skip-join", action="store_true", help="leave out the join part")
    parser.add_argument("--server", action="store_true", help="only the request through the server, on and off")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave out llama.cpp's columns")
    args = parser.parse_args()

    from turbospark.cli.attach import stored_model
    from turbospark.cli.blas import describe, reexec_with_openblas

    reexec_with_openblas([sys.executable, *sys.argv])
    from turbospark.model.mlx_backend import MlxBackend

    model_dir, _ = stored_model(args.model)
    if args.server:
        through_the_server(model_dir, args.model, args.runs, args.max_tokens)
        return
    backend = MlxBackend(model_dir, model_id=args.model, cache_entries=0)
    paths = {"plain": (backend, False), "lookup": (backend, True)}
    if args.draft_model:
        draft_dir, _ = stored_model(args.draft_model)
        paths["draft"] = (MlxBackend(model_dir, model_id=args.model, cache_entries=0, draft_path=draft_dir), True)
    tok = backend.tokenizer
    llama = {} if args.no_llama_cpp or args.skip_speed else llama_cpp_paths(args.model, args.max_tokens)
    print(f"model {args.model}{f', draft model {args.draft_model}' if args.draft_model else ''}, {args.runs} runs "
          f"alternating, {args.max_tokens} new tokens, greedy; BLAS: {describe()}", flush=True)
    print("| workload | prompt tokens | path | tok/s | /plain | /its own plain | draft tokens kept | same text |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for b, speculate in paths.values():  # warm-up
        run(b, tok.encode(tok.render_chat(WORKLOADS["free prose"])), speculate, 4)
    for child in llama.values():
        child.run(tok.encode(tok.render_chat(WORKLOADS["free prose"])), 4)
    stops = set(tok.stop_ids or ())
    for name, messages in ({} if args.skip_speed else WORKLOADS).items():
        ids = tok.encode(tok.render_chat(messages))
        speeds: dict[str, list[float]] = {path: [] for path in [*paths, *llama]}
        texts: dict[str, list[int]] = {}
        kept: dict[str, list[int]] = {path: [0, 0] for path in paths}
        for _ in range(args.runs):
            for path, (b, speculate) in paths.items():
                speed, out, d, a = run(b, ids, speculate, args.max_tokens)
                speeds[path].append(speed)
                texts[path] = out
                kept[path][0] += d
                kept[path][1] += a
            for path, child in llama.items():
                answer = child.run(ids, args.max_tokens)
                speeds[path].append(answer["sample"]["decode_tps"])
                ends = [i for i, t in enumerate(answer["tokens"]) if t in stops]
                texts[path] = answer["tokens"][:ends[0] + 1] if ends else answer["tokens"]
        plain = statistics.median(speeds["plain"])
        for path in speeds:
            speed = statistics.median(speeds[path])
            own = statistics.median(speeds["llama.cpp" if path.startswith("llama") else "plain"])
            share = f"{kept[path][1] / kept[path][0]:.0%}" if kept.get(path, [0])[0] else "-"
            print(f"| {name} | {len(ids)} | {path} | {speed:.1f} | {speed / plain:.2f}x | {speed / own:.2f}x | {share} "
                  f"| {'yes' if texts[path] == texts['plain'] else 'no'} |", flush=True)
    for child in llama.values():
        child.close()

    # --- where speculation stops paying: several copying streams at once --------------------
    sizes = [int(n) for n in args.batches.split(",") if n]
    if sizes:
        print(f"several streams at once, {args.max_tokens} new tokens each (tok/s, all streams "
              f"together; medians of {args.runs}):")
        print("| streams | what they write | plain | prompt lookup | lookup/plain |")
        print("| --- | --- | --- | --- | --- |")
        copy = tok.encode(tok.render_chat(WORKLOADS["repeat a passage"]))
        prose = tok.encode(tok.render_chat(WORKLOADS["free prose"]))
        for n in sizes:
            for label, prompts in (("all repeat the passage", [copy] * n),
                                   ("one repeats it, the rest free prose", [copy] + [prose] * (n - 1))):
                if n == 1 and label.startswith("one"):
                    continue
                rates: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(args.runs):
                    for speculate in (False, True):
                        rates[speculate].append(batch(backend, prompts, speculate, args.max_tokens))
                plain, spec = statistics.median(rates[False]), statistics.median(rates[True])
                print(f"| {n} | {label} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x |", flush=True)

    if args.skip_join:
        return
    # --- a ~300-token request joining streams that decode -----------------------------------
    topics = ["the sea", "a dragon", "Paris", "the moon", "a robot", "winter", "a garden", "trains"]
    running = [tok.encode(tok.render_chat([{"role": "user", "content": f"Write a story about {t}."}]))
               for t in (topics * 4)[:args.streams]]
    joiner = [{"role": "user", "content": "Summarise these notes:\n" + PASSAGE[:1500]}]
    # (label, paced, one pass): the engine's own two passes a mixed step, beside this tree's one
    ways = [("fixed chunk, two passes", False, False), ("paced, two passes", True, False),
            ("paced, one pass", True, True)]
    fusable = backend.fuse
    results: dict[str, list[tuple[float, float, float, float]]] = {label: [] for label, _, _ in ways}
    for run_ in range(args.runs):
        for label, paced, fused in ways:
            if fused and not fusable:
                continue
            backend.fuse = fused
            ids = tok.encode(tok.render_chat([{"role": "user", "content": f"Run {run_}, {label}."}, *joiner]))
            results[label].append(join(backend, running, ids, paced))
    backend.fuse = fusable
    print(f"a {len(ids)}-token request joining {args.streams} decoding streams (medians of {args.runs}):")
    print(f"{'chunk':<26} {'median gap s':>12} {'longest gap s':>13} {'longest/median':>14} {'joiner TTFT s':>13} "
          f"{'next 8: longest/median':>22}")
    for label in (label for label, _, _ in ways if results[label]):
        med = statistics.median(r[0] for r in results[label])
        worst = statistics.median(r[1] for r in results[label])
        ratio = statistics.median(r[1] / r[0] for r in results[label])
        ttft = statistics.median(r[2] for r in results[label])
        later = statistics.median(r[3] / r[0] for r in results[label])
        print(f"{label:<26} {med:>12.3f} {worst:>13.3f} {ratio:>13.2f}x {ttft:>13.2f} {later:>21.2f}x", flush=True)


if __name__ == "__main__":
    main()
