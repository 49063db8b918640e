"""Constrained decoding with llguidance: per-sequence token masks from a grammar.

Theory of operation: a request that demands a structure (a JSON Schema, forced tool calls)
carries a ``Grammar`` (Lark text, ``%json{..}`` for schemas).  On the model thread,
``Grammars`` compiles it once per model tokenizer (cached by text; a schema feature llguidance
cannot enforce is refused here, by name, before any prefill) and hands each sequence its own
``Matcher``; a budget too small for the grammar's shortest finished output is refused with
it (``least_tokens``).  Before every sampling step the matcher gives the set of tokens that
keep the output inside the grammar; after it, the sampled token is consumed.  End of sequence is in the
set only where the grammar accepts, so a finished output always parses.

llguidance was chosen for its per-token cost on CPU and its JSON Schema coverage (see
``design/decisions/0011-constrained-decoding.md``).  No Trio, no MLX: the backends apply the
mask to their logits.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import attrs
import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from ..errors import RequestInvalid

__all__ = ["Grammar", "Grammars", "Matcher"]

_CACHED = 64  # compiled grammars kept per model


@attrs.frozen
class Grammar:
    """A constraint on a sequence's output, as a Lark grammar for llguidance (``%json{..}``
    embeds a JSON Schema).  ``what`` names the request field it enforces, for error messages."""

    lark: str
    what: str
    shortest: tuple[str, ...] = ()  # the shortest outputs it accepts (lower bounds), one per way
    kind: str = "json"  # "json" (a schema, forced calls) or "grammar" (regex, choice, GBNF, Lark)

    # ``shortest`` is written so that no output the grammar accepts is shorter than all of them;
    # the model thread counts their tokens (``Grammars.least_tokens``) to refuse a budget that
    # cannot hold any finished output.


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, eos_id: int) -> None:
        self._m = matcher
        self._vocab = vocab
        self._eos = eos_id
        self._bits = llg_numpy.allocate_token_bitmask(1, vocab)
        self.consumed = 0  # tokens llguidance took (a stopped grammar takes none), for rollback

    def allowed(self) -> np.ndarray:
        """A boolean mask over the tokenizer's vocabulary: the tokens allowed next (only the
        end of sequence once the grammar is complete)."""
        if self._m.is_stopped():
            mask = np.zeros(self._vocab, dtype=bool)
            mask[self._eos] = True
            return mask
        llg_numpy.fill_next_token_bitmask(self._m, self._bits, 0)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab].astype(bool)

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; False when the grammar did not allow it."""
        if self._m.is_stopped() or self._m.is_error():
            return token == self._eos
        took = bool(self._m.consume_token(token))
        self.consumed += took
        return took

    def allows(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order from here, the grammar allows (nothing is consumed)."""
        if self._m.is_stopped() or self._m.is_error():
            return 0
        return int(self._m.validate_tokens(tokens))

    def rollback(self, tokens: int) -> None:
        """Undo the last ``tokens`` consumed (a speculative step's refused draft tokens)."""
        if tokens > 0:
            self._m.rollback(tokens)
            self.consumed -= tokens

    def forced(self) -> list[int]:
        """Tokens the grammar forces next, whatever is sampled (may be none)."""
        return list(self._m.compute_ff_tokens())

    @property
    def done(self) -> bool:
        """Broken (a token it did not allow got through): nothing more can be enforced."""
        return bool(self._m.is_error())

    def accepting(self) -> bool:
        return bool(self._m.is_accepting())


class Grammars:
    """Compiled grammars for one tokenizer."""

    def __init__(self, tokenizer_json: str, *, vocab: int, eos_id: int) -> None:
        self._tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos_id)
        self.vocab = vocab
        self.eos_id = eos_id
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def compile(self, grammar: Grammar, *, budget: int | None = None) -> llguidance.LLMatcher:
        """The grammar's initial matcher (cached).  With ``budget`` (the sequence's
        ``max_tokens``), a budget that cannot hold the grammar's shortest finished output is
        refused too.

        Raises:
            RequestInvalid: the grammar (a JSON Schema in it) uses something llguidance cannot
                enforce, or is malformed; the message names it.  Or ``budget`` is too small
                (``param`` ``max_tokens``).
        """
        matcher = self._compiled(grammar)
        if budget is not None and budget < (least := self.least_tokens(grammar)):
            demand = (
                "the call tool_choice" if grammar.what == "tool_choice"
                else f"the JSON {grammar.what}" if grammar.kind == "json" else f"the {grammar.what}"
            )
            raise RequestInvalid(
                f"max_tokens is {budget}, too small for {demand} demands: the shortest valid "
                f"answer takes {least} tokens with this model, its end included; raise max_tokens",
                param="max_tokens",
            )
        return matcher

    def _compiled(self, grammar: Grammar) -> llguidance.LLMatcher:
        found = self._cache.get(grammar.lark)
        if found is not None:
            self._cache.move_to_end(grammar.lark)
            return found
        compiled = llguidance.LLMatcher.grammar_from_lark(grammar.lark)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, self._tok)
        if failed or messages:
            detail = "; ".join(_plain(m) for m in messages) or "the grammar was refused"
            problem = "this schema cannot be enforced" if grammar.kind == "json" else "the grammar does not compile"
            raise RequestInvalid(f"{grammar.what}: {problem}: {detail}", param=grammar.what)
        matcher = llguidance.LLMatcher(self._tok, compiled, log_level=0)
        if matcher.is_error():
            raise RequestInvalid(f"{grammar.what}: {matcher.get_error()}", param=grammar.what)
        self._cache[grammar.lark] = matcher
        if len(self._cache) > _CACHED:
            self._cache.popitem(last=False)
        return matcher

    def least_tokens(self, grammar: Grammar) -> int:
        """The fewest tokens a finished output of ``grammar`` takes: its shortest outputs
        (``Grammar.shortest``, written by ``structured.grammar_for`` as lower bounds) as this
        tokenizer writes them, the fewest of them, plus the end of the sequence; 0 when the
        grammar names none."""
        if not grammar.shortest:
            return 0
        return 1 + min(len(self._tok.tokenize_str(text)) for text in grammar.shortest)

    def matcher(self, grammar: Grammar) -> Matcher:
        return Matcher(self.compile(grammar).deep_copy(), self.vocab, self.eos_id)


def _plain(message: str) -> str:
    """llguidance's message without its position in our grammar text (the caller never saw
    that text): ``at 1(8): failed to compile JSON schema: X`` becomes ``X``."""
    lines = message.strip().splitlines()
    first = lines[0] if lines else message
    if first.endswith("regex parse error:"):  # the reason is on a later line: "error: unclosed .."
        first += " " + next((ln.strip()[7:] for ln in lines if ln.strip().startswith("error: ")), "")
    first = first.split("failed to compile JSON schema: ", 1)[-1]
    return re.sub(r"^at \d+\(\d+\): ", "", first)
