"""The scripted backend: deterministic, paced output for client test suites.

It runs through the same model actor and thread as MLX and uses a real tokenizer and chat
template (SmolLM2's, shipped in ``data/chatml``), so prompt and completion token counts are exact.

- With a script, it emits the script's tokens one per decode step, then the end-of-turn token
  (finish ``stop``).  Without one, it emits an endless deterministic text until the budget runs
  out (finish ``length``).
- ``token_delay`` paces every prefill chunk and every decode step, so a test can land a
  disconnect in the queued, prefill or decode phase on purpose.
- ``counters`` records what really ran, so tests can check that a cancelled generation stopped.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Generator
from pathlib import Path

import attrs

from .backend import PrefillProgress, SamplingParams
from .tokenizer import Tokenizer

__all__ = ["SCRIPTED_ID", "ScriptedBackend", "ScriptedCounters", "shipped_tokenizer"]

SCRIPTED_ID = "scripted"
DATA_DIR = Path(__file__).parent / "data" / "chatml"
ENDLESS_TEXT = (
    "The quick brown fox jumps over the lazy dog. "
    "Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! "
)


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
    ) -> None:
        self.model_id = model_id
        self.context_window = context_window
        self.sampling_defaults: dict[str, float] = {}  # its output ignores sampling anyway
        self.tokenizer = tokenizer or shipped_tokenizer()
        self.token_delay = token_delay
        self.prefill_chunk = prefill_chunk
        self.counters = ScriptedCounters()
        end = self.tokenizer.encode("<|im_end|>")
        self._end_of_turn = end[0] if len(end) == 1 and end[0] in self.tokenizer.stop_ids else None
        self._script = None if script is None else self.tokenizer.encode(script)
        self._endless = self.tokenizer.encode(ENDLESS_TEXT)

    def generate(
        self, prompt: list[int], params: SamplingParams
    ) -> Generator[PrefillProgress | int, None, None]:
        self.counters.generations += 1
        total = len(prompt)
        yield PrefillProgress(0, total, 0)
        for done in range(0, total, self.prefill_chunk):
            self._pace()
            self.counters.prefill_chunks += 1
            yield PrefillProgress(min(done + self.prefill_chunk, total), total, 0)
        if self._script is None:
            tokens = itertools.cycle(self._endless)
        else:
            tail = [] if self._end_of_turn is None else [self._end_of_turn]
            tokens = iter([*self._script, *tail])
        for token in tokens:
            self._pace()
            self.counters.decode_steps += 1
            yield token

    def _pace(self) -> None:
        if self.token_delay > 0:
            time.sleep(self.token_delay)
