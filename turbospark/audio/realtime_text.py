"""The text of a ``/v1/realtime`` session's turns, without I/O (``realtime_api.py`` carries its
audio and events):

- ``Agreement``: a turn's words from its hypotheses, as deltas that later hypotheses keep.
- ``Sentences``: text as it arrives, cut where speech can start (a sentence's end; the answer's
  first phrase).
- ``Spoken``: the text whose audio went out, so a cancelled or truncated answer keeps only what
  was heard.
"""

from __future__ import annotations

import re

import attrs

__all__ = ["Agreement", "Sentences", "Spoken"]


class Agreement:
    """A turn's transcript as deltas while it is spoken: the words two hypotheses in a row agree
    on (LocalAgreement-2, as whisper_streaming commits them; words compared without case or
    punctuation, which a hypothesis cut mid-sentence gets wrong) and not given yet, as the later
    hypothesis writes them; every word of a hypothesis whose audio ends in a pause (a speaker's
    words are whole there); then ``final``, the rest of the turn's transcript where it goes on
    from them ("" where it does not: its ``completed`` event's transcript is the one to keep)."""

    def __init__(self) -> None:
        self.given: list[str] = []
        self._last: list[str] | None = None

    @property
    def prefix(self) -> str:
        """The words given so far: a hypothesis may decode from them."""
        return " ".join(self.given)

    def hypothesis(self, text: str, settled: bool = False) -> str:
        """The delta ``text``, a hypothesis of the turn so far, gives: the words it and the one
        before agree on, or, where it is ``settled`` (its audio ends in a pause), all of them."""
        words, last = text.split(), self._last
        self._last = words
        if settled:
            return self._give(words[len(self.given):]) if self._follows(words) else ""
        if last is None:
            return ""
        n = 0
        while n < min(len(last), len(words)) and _word(last[n]) == _word(words[n]):
            n += 1
        if n <= len(self.given) or not self._follows(words):
            return ""
        return self._give(words[len(self.given): n])

    def final(self, text: str) -> str:
        words = text.split()
        return self._give(words[len(self.given):]) if self._follows(words) else ""

    def _follows(self, words: list[str]) -> bool:
        return len(words) >= len(self.given) and all(_word(a) == _word(b) for a, b in zip(self.given, words))

    def _give(self, words: list[str]) -> str:
        if not words:
            return ""
        lead = " " if self.given else ""
        self.given += words
        return lead + " ".join(words)


def _word(word: str) -> str:
    return re.sub(r"[^\w']", "", word.lower())


_END = re.compile(r"[.!?;:](?=[\s\"')\]]*\s)|\n")
_PHRASE = re.compile(r"[,;:\u2013\u2014](?=[\s\"')\]]*\s)")


class Sentences:
    """Text in pieces as the model writes it; out, whole sentences (or ``longest`` characters
    cut at a space), each the unit a voice speaks.  The answer's first unit ends at its first
    phrase (a comma, a colon, a dash) once that has ``first_words`` words, so the voice can
    start before the first sentence is written."""

    def __init__(self, longest: int = 240, first_words: int = 3) -> None:
        self.longest = longest
        self.first_words = first_words
        self._text = ""
        self._first = True

    def feed(self, piece: str) -> list[str]:
        self._text += piece
        out = []
        while True:
            m = _END.search(self._text)
            if self._first:
                phrase = next((p for p in _PHRASE.finditer(self._text)
                               if len(self._text[: p.end()].split()) >= self.first_words), None)
                if phrase is not None and (m is None or phrase.end() < m.end()):
                    m = phrase
            if m is not None:
                cut = m.end()
            elif len(self._text) > self.longest and " " in self._text[: self.longest]:
                cut = self._text.rindex(" ", 0, self.longest) + 1
            else:
                break
            sentence, self._text = self._text[:cut], self._text[cut:]
            if sentence.strip():
                out.append(sentence)
                self._first = False
        return out

    def flush(self) -> list[str]:
        rest, self._text = self._text, ""
        return [rest] if rest.strip() else []


@attrs.define
class _Said:
    text: str
    start_ms: float
    end_ms: float | None = None  # None: its audio is still going out


class Spoken:
    """What a response's voice has said: each sentence with the span of audio it took, so the
    text heard by ``ms`` into the answer is known.  A point inside a sentence's audio keeps its
    words in proportion (for a sentence whose audio is still going out, to the audio of it sent
    so far); a sentence none of whose audio went out is not kept."""

    def __init__(self) -> None:
        self._said: list[_Said] = []
        self.ms = 0.0  # audio sent so far
        self.cut: float | None = None  # where conversation.item.truncate said the client stopped

    def begin(self, text: str) -> None:
        self._said.append(_Said(text, self.ms))

    def sent(self, ms: float) -> None:
        self.ms += ms

    def end(self) -> None:
        self._said[-1].end_ms = self.ms

    def heard(self, ms: float | None = None) -> str:
        """The text of the audio up to ``ms`` (default: all that was sent)."""
        at = self.ms if ms is None else min(ms, self.ms)
        out = []
        for said in self._said:
            end = said.end_ms if said.end_ms is not None else self.ms
            if at >= end and said.end_ms is not None:
                out.append(said.text)
                continue
            if at > said.start_ms and end > said.start_ms:
                words = said.text.split()
                keep = int(len(words) * (at - said.start_ms) / max(end - said.start_ms, 1e-9))
                if keep:
                    lead = said.text[: len(said.text) - len(said.text.lstrip())]
                    out.append(lead + " ".join(words[:keep]))
            break
        return "".join(out).strip()
