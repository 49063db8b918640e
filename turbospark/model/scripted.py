"""The scripted backend: deterministic, paced output for client test suites.

It runs through the same model actor and thread as MLX and uses a real tokenizer and chat
template (SmolLM2's, shipped in ``data/chatml``), so prompt and completion token counts are exact.

- With a script, it emits the script's tokens one per decode step, then the end-of-turn token
  (finish ``stop``).  Without one, it emits an endless deterministic text until the budget runs
  out (finish ``length``).
- It batches like the real engine: each ``step`` advances every sequence once (a prefill chunk
  or one token), and ``token_delay`` paces each step, so a test can land a disconnect in the
  queued, prefill or decode phase on purpose.
- ``counters`` records what really ran, so tests can check that a cancelled generation stopped.
- It keeps a prefix cache the way the real backend does (what recent sequences' KV held, prompt
  and output): a prompt that repeats one prefills only the rest, and usage reports the cached
  tokens, so client test suites see cache reads.  With ``prompt_cache_dir`` those token lists
  persist across restarts as the real one's entries do (``prompt_files``, empty KV).
- Under a grammar (constrained decoding) it follows its script where the grammar allows, and
  otherwise takes the grammar's shortest way out.
- Where its end-of-turn token is held back (``ignore_eos``, or fewer than ``min_tokens`` tokens
  so far), it writes the endless text instead, as a model whose end is masked writes on, and
  ends once it may: after exactly ``min_tokens`` tokens, never with ``ignore_eos`` (the budget
  ends it).  Under a grammar it takes another way the grammar allows, and the grammar's end
  where that is all it allows.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import attrs

from .. import __version__
from .backend import PrefillProgress, SamplingParams, StepOutput, common_prefix, fingerprint
from .constraint import Matcher
from .prompt_files import PromptFiles, tokenizer_digest
from .prompt_slots import Slots
from .tokenizer import Tokenizer

__all__ = ["SCRIPTED_ID", "ScriptedBackend", "ScriptedCounters", "shipped_tokenizer"]

SCRIPTED_ID = "scripted"
DATA_DIR = Path(__file__).parent / "data" / "chatml"
KV_BYTES_PER_TOKEN = 46_080  # what SmolLM2-135M's KV cache holds per token in float32
ENDLESS_TEXT = (
    "The quick brown fox jumps over the lazy dog. "
    "Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! "
)

_TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def shipped_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DATA_DIR)


@attrs.define
class ScriptedCounters:
    """What the backend really computed, for tests and benchmarks."""

    generations: int = 0
    prefill_chunks: int = 0
    decode_steps: int = 0


class ScriptedBackend:
    def __init__(
        self,
        *,
        script: str | None = None,
        token_delay: float = 0.0,
        prefill_chunk: int = 16,
        context_window: int = 8192,
        tokenizer: Tokenizer | None = None,
        model_id: str = SCRIPTED_ID,
        prompt_cache_dir: Path | None = None,
    ) -> None:
        self.model_id = model_id
        self.context_window = context_window
        self.sampling_defaults: dict[str, float] = {}  # its output ignores sampling anyway
        self.tokenizer = tokenizer or shipped_tokenizer()
        self.token_delay = token_delay
        self.prefill_chunk = prefill_chunk
        self.counters = ScriptedCounters()
        # a script ends with the end of the turn its template writes (any tokenizer may be given)
        ends = [self.tokenizer.encode(t) for t in (*_TURN_ENDS, self.tokenizer.eos_token) if t]
        self._end_of_turn = next((e[0] for e in ends if len(e) == 1 and e[0] in self.tokenizer.stop_ids), None)
        self._script = None if script is None else self.tokenizer.encode(script)
        self._endless = self.tokenizer.encode(ENDLESS_TEXT)
        self._closers = [ids[0] for text in ('"', "}", "]", "0") if len(ids := self.tokenizer.encode(text)) == 1]
        self._seqs: dict[int, _ScriptedSeq] = {}
        self._seen: list[list[int]] = []  # what recent sequences' KV held, for the prefix cache
        self.fingerprint = fingerprint(
            "scripted", f"turbospark {__version__}", script if script is not None else ENDLESS_TEXT
        )
        self._files = None
        if prompt_cache_dir is not None:
            self._files = PromptFiles.for_model(prompt_cache_dir, self.fingerprint, tokenizer_digest(DATA_DIR), 1 << 30)
            self._seen = [tokens for tokens, _, _ in self._files.restore(4, 1 << 30)]

    # --- the batched engine: every sequence advances once per step, one pace for all -------

    def kv_estimate(self, tokens: int) -> int:
        return tokens * KV_BYTES_PER_TOKEN

    def kv_bytes(self) -> int:
        return sum(s.in_cache for s in self._seqs.values()) * KV_BYTES_PER_TOKEN

    def cached_prefix(self, prompt: list[int], images: object = None) -> int:
        """Like a real prefix cache: the longest start of ``prompt`` that a recent sequence
        (prompt and output) held, all but its last token."""
        best = max((common_prefix(prompt, seen) for seen in self._seen), default=0)
        return min(best, len(prompt) - 1) if best > 0 else 0

    def insert(self, seq: int, prompt: list[int], params: SamplingParams, images: object = None) -> int:
        self.counters.generations += 1
        cached = self.cached_prefix(prompt)
        self._seqs[seq] = _ScriptedSeq(
            total=len(prompt), tokens=self._tokens(params), logprobs=params.logprobs,
            matcher=self._matcher(params), done=cached, cached=cached, prompt=list(prompt), params=params,
        )
        return cached

    def _matcher(self, params: SamplingParams) -> Matcher | None:
        return None if params.grammar is None else self.tokenizer.grammars.matcher(params.grammar)

    def fork(self, seq: int, new: Mapping[int, SamplingParams]) -> bool:
        total = self._seqs[seq].total
        for sid, params in new.items():
            self._seqs[sid] = _ScriptedSeq(
                total=total, tokens=self._tokens(params), done=total, logprobs=params.logprobs,
                matcher=self._matcher(params), params=params,
            )
        return True

    def _tokens(self, params: SamplingParams) -> Iterator[int]:
        if self._script is None:
            # under a grammar the endless text would fill the first string forever: take the
            # grammar's shortest way out instead
            return iter(()) if params.grammar is not None else itertools.cycle(self._endless)
        tail = [] if self._end_of_turn is None else [self._end_of_turn]
        return iter([*self._script, *tail])

    def step(self) -> StepOutput:
        self._pace()
        progress: dict[int, PrefillProgress] = {}
        out: dict[int, int] = {}
        logprobs: dict[int, tuple[float, tuple[tuple[int, float], ...]]] = {}
        for sid, seq in list(self._seqs.items()):
            if seq.done < seq.total:
                self.counters.prefill_chunks += 1
                seq.done = min(seq.done + self.prefill_chunk, seq.total)
                progress[sid] = PrefillProgress(seq.done, seq.total, seq.cached)
                continue
            held = seq.params.holds_end(seq.generated)
            if seq.matcher is not None:
                token = self._constrained(seq.matcher, next(seq.tokens, None), held)
            else:
                token = self._scripted(seq, held)
            self.counters.decode_steps += 1
            seq.generated += 1
            seq.emitted.append(token)
            out[sid] = token
            if seq.logprobs is not None:  # certain of its token; the next ids, far behind
                top = [(token, 0.0), *((token + k, -20.0 - k) for k in range(1, seq.logprobs))]
                logprobs[sid] = (0.0, tuple(top[: seq.logprobs]))
        return StepOutput(progress, out, logprobs=logprobs)

    def _scripted(self, seq: _ScriptedSeq, held: bool) -> int:
        """The script's next token.  Its end, while held back, waits and the endless text goes
        on; it comes once it may (after ``min_tokens`` tokens; never with ``ignore_eos``)."""
        if seq.end is None:
            token = next(seq.tokens, None)
            if token is None:  # a script without an end-of-turn token: stop repeating
                return self._endless[0]
            if not (held and token in self.tokenizer.stop_ids):
                return token
            seq.end = token
        if not held:
            return seq.end
        if seq.filler is None:
            seq.filler = itertools.cycle(self._endless)
        return next(seq.filler)

    def _constrained(self, matcher: Matcher, token: int | None, held: bool = False) -> int:
        """The script's token where the grammar allows it.  Else the shortest way out: what the
        grammar forces, the end of the turn where it may end, a token that closes a string,
        an object or an array, a zero, else the lowest token it allows.  ``held``: the end of the
        turn is not allowed where the grammar allows anything else."""
        if matcher.done:
            return token if token is not None else self._endless[0]
        allowed = matcher.allowed()
        if held:
            others = allowed.copy()
            others[[i for i in self.tokenizer.stop_ids if i < others.size]] = False
            allowed = others if others.any() else allowed
        if token is None or not allowed[token]:
            forced = matcher.forced()
            preferred = [self.tokenizer.eos_id, *self._closers]
            token = forced[0] if forced else next(
                (t for t in preferred if t is not None and allowed[t]), int(allowed.argmax())
            )
        matcher.consume(token)
        return token

    def remove(self, seq: int, *, keep_cache: bool = True) -> None:
        gone = self._seqs.pop(seq, None)
        if gone is not None and keep_cache and gone.prompt:
            held = gone.prompt[: gone.done] if gone.done < gone.total else gone.prompt + gone.emitted
            kept = [s for s in self._seen if s != held[: len(s)]]
            for evicted in kept[:-3]:
                self._write(evicted)
            self._seen = kept[-3:] + [held]

    def persist(self) -> None:
        for seen in self._seen:
            self._write(seen)

    def slot_command(self, action: str, slot: int | None, filename: str | None) -> object:
        """llama.cpp's slot actions on what the prefix cache holds (``prompt_slots``)."""

        def place(i: int, tokens: list[int], _kv: object) -> None:
            self._seen[i: i + 1] = [list(tokens)]

        slots = Slots(
            4, self.context_window, self.model_id, entries=lambda: [(s, []) for s in self._seen], place=place,
            erase=self._seen.pop, decode=self.tokenizer.decode, files=self._files,
        )
        return slots.run(action, slot, filename)

    def _write(self, tokens: list[int]) -> None:
        if self._files is not None and not self._files.path(tokens).exists():
            self._files.save(tokens, [])

    def reset(self) -> None:
        self._seqs.clear()
        self._seen.clear()

    def _pace(self) -> None:
        if self.token_delay > 0:
            time.sleep(self.token_delay)


@attrs.define
class _ScriptedSeq:
    total: int
    tokens: Iterator[int]
    done: int = 0
    generated: int = 0
    logprobs: int | None = None
    matcher: Matcher | None = None
    prompt: list[int] = attrs.field(factory=list)
    cached: int = 0
    emitted: list[int] = attrs.field(factory=list)
    params: SamplingParams = attrs.field(factory=SamplingParams)  # what holds its end back
    end: int | None = None  # its end of turn, while held back
    filler: Iterator[int] | None = None  # the endless text, written while its end is held back

    @property
    def in_cache(self) -> int:
        return self.done + self.generated
