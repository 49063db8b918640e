"""A ``/v1/realtime`` session's transcriptions (``routes/realtime.py``): one of its audio as a
value the session can start before it needs it, a committed turn's, and a transcription
session's hypotheses while the speaker talks.

Server VAD commits a turn after ``silence_duration_ms`` of silence (500 ms by default), but the
words are all there once the speaker pauses: at ``SpeechPaused`` (``EARLY_MS`` of silence) the
session starts a ``Transcription`` of the audio so far, and the commit that follows uses its
transcript instead of starting one; speech before the commit (``SpeechResumed``) cancels it
(decision 0045).  Cancelling ``scope`` closes the work's reply channel: the speech-to-text
thread drops it at its next step.

In a transcription session (``?intent=transcription``) with server VAD, a hypothesis of the turn
so far is transcribed every ``HYPOTHESIS_MS`` of audio while the speaker talks (one at a time,
none during a pause), decoded from the words given so far; the words two in a row agree on go out
at once as ``conversation.item.input_audio_transcription.delta`` events of the item the turn will
become (``Agreement``), and all of the pause's early transcription's (the speaker's words are whole
there).  The committed turn's delta is the rest of its transcript.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any

import attrs
import numpy as np
import trio

from ..audio.messages import Transcribe, WorkDone, WorkFailed
from ..audio.realtime_api import event
from ..audio.realtime_text import Agreement
from ..audio.wav import SAMPLE_RATE
from ..errors import GenerationFailed, RequestInvalid, TurboSparkError
from ._audio import receive, submit

__all__ = ["HYPOTHESIS_MS", "Transcription", "Turn", "hypothesis", "hypothesize", "transcribe"]

log = logging.getLogger("turbospark")

#: ms of a transcription session's audio between hypotheses of the turn being spoken
HYPOTHESIS_MS = 200


@attrs.define(eq=False)
class Transcription:
    """A transcription of a session's audio: ``run`` it (in a task, or awaited); ``reply``
    waits for it and gives the work's answer."""

    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    done: trio.Event = attrs.field(factory=trio.Event)
    answer: WorkDone | WorkFailed | None = None

    async def run(self, model: str, audio: np.ndarray, language: str | None, prefix: str = "") -> None:
        try:
            with self.scope, ExitStack() as scope:  # leaving it closes the work's reply channel
                recv = await submit(scope, request_id=-1, model=model, endpoint="realtime",
                                    args=Transcribe(audio, language, prefix))
                reply = await receive(recv)
                self.answer = reply if isinstance(reply, WorkDone | WorkFailed) else None
        except TurboSparkError as exc:
            self.answer = WorkFailed(exc)
        except Exception:  # a bug: this transcription fails, logged; the session goes on
            self.answer = WorkFailed(GenerationFailed.new("the transcription failed"))
            log.exception("realtime transcription: %s", self.answer.error.message)
        finally:
            self.done.set()

    def cancel(self) -> None:
        self.scope.cancel()

    async def reply(self) -> WorkDone | WorkFailed:
        await self.done.wait()
        if isinstance(self.answer, WorkDone) and self.answer.transcript is not None:
            return self.answer
        if isinstance(self.answer, WorkFailed):
            return self.answer
        return WorkFailed(GenerationFailed.new("transcription failed"))


@attrs.frozen(eq=False)
class Turn:
    """A committed turn: its item, its audio, whether VAD committed it, the transcription begun at
    its pause and the words its hypotheses gave."""

    item_id: str
    audio: np.ndarray
    auto: bool
    early: Transcription | None = None
    agreement: Agreement | None = None


def hypothesis(s: Any) -> None:
    """While a transcription session's speaker talks: a hypothesis of the turn so far, where
    ``HYPOTHESIS_MS`` of audio came since the last and none is under way."""
    if s.hypothesis is not None or s.stt is None or s.audio_ms - s.hypothesis_ms < HYPOTHESIS_MS:
        return
    s.hypothesis_ms = s.audio_ms
    s.hypothesis = Transcription()
    s.nursery.start_soon(hypothesize, s, s.hypothesis, s.buffer.peek(), s.agreement, s.next_item)


async def hypothesize(s: Any, work: Transcription, audio: np.ndarray, agreement: Agreement, item_id: str,
                      settled: bool = False) -> None:
    """``work`` run on ``audio`` as a hypothesis of the turn ``item_id``, decoded from the words
    given so far: the words it and the one before agree on go out at once, or all of them where it
    is ``settled`` (the pause's early transcription)."""
    await work.run(s.stt.id, audio, s.config.language, agreement.prefix)
    if s.hypothesis is work:
        s.hypothesis = None
    answer = work.answer
    if work.scope.cancel_called or not isinstance(answer, WorkDone) or answer.transcript is None:
        return  # the turn was committed, paused or cleared meanwhile
    if delta := agreement.hypothesis(answer.transcript.text, settled):
        await s.emit(event("conversation.item.input_audio_transcription.delta", item_id=item_id,
                           content_index=0, delta=delta))


async def transcribe(s: Any, turn: Turn) -> None:
    """A session's (``s``) committed turn: its transcript (the one begun at VAD's pause, where
    that one succeeded), its events, and the answer VAD asks for."""
    item_id, audio, auto, early = turn.item_id, turn.audio, turn.auto, turn.early
    reply = await early.reply() if early is not None else None
    if not isinstance(reply, WorkDone):
        whole = Transcription()
        given = turn.agreement.prefix if turn.agreement is not None and s.config.kind == "transcription" else ""
        await whole.run(s.stt.id, audio, s.config.language, given)
        reply = await whole.reply()
    if isinstance(reply, WorkFailed):
        await s.emit(event("conversation.item.input_audio_transcription.failed", item_id=item_id,
                           content_index=0, error={"type": "transcription_error", "code": None,
                                                   "message": reply.error.message, "param": None}))
        return
    text = reply.transcript.text.strip()
    if s.config.transcribes:  # the model reads the transcript either way
        given = turn.agreement is not None and turn.agreement.given
        if delta := turn.agreement.final(text) if given else text:  # type: ignore[union-attr]
            await s.emit(event("conversation.item.input_audio_transcription.delta", item_id=item_id,
                               content_index=0, delta=delta))
        await s.emit(event("conversation.item.input_audio_transcription.completed", item_id=item_id,
                           content_index=0, transcript=text,
                           usage={"type": "duration", "seconds": round(audio.size / SAMPLE_RATE, 3)}))
    if s.config.kind != "realtime":
        return
    try:
        item = s.conversation.get(item_id)
    except RequestInvalid:
        return  # deleted meanwhile
    if item.get("role") != "user" or [p.get("type") for p in item.get("content", ())] != ["input_audio"]:
        return  # deleted and replaced by another item of the same id
    item["content"][0]["transcript"] = text
    await s.emit(event("conversation.item.done", previous_item_id=None, item=item))
    detection = s.config.turn_detection or {}
    if auto and detection.get("create_response", True):
        if s.response is None:
            await s.start_response({})
        else:
            s.answer_next = True  # once the response running now (not interrupted) ends
