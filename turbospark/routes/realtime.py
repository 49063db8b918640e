"""``GET /v1/realtime`` (WebSocket): OpenAI's Realtime API, GA event names.

``?model=ID`` opens a conversation: speech in (server VAD, or push-to-talk with
``turn_detection: null``), transcribed by the speech-to-text model, answered by the chat model in
the shared batch (instructions, function tools with the chat guardrails, ``tool_choice``,
``temperature``, ``max_output_tokens``), spoken sentence by sentence by the voice as the text
arrives (``audio/pcm`` at 24 kHz, or G.711), or text only where ``output_modalities`` says so.
``?intent=transcription`` opens a transcription session.  What needs no I/O is in
``audio/realtime_api.py`` and ``audio/realtime_state.py``; this handler carries it out:

    handler (Quart-Trio cancels it when the client hangs up)
    ├── writer         server events out, in order; a client that takes none of them for
    │                  --write-timeout seconds is closed, never buffered for
    ├── reader         client events in (the handler's own loop): the session, the buffer, items
    ├── transcriber    committed audio, in order: transcribe, then answer if VAD committed it
    ├── early × ≤1     the turn's transcription, begun at VAD's pause (``realtime_transcription.py``)
    ├── hypothesis × ≤1  a transcription session's turn so far, while the speaker talks
    └── response × ≤1  the chat turn, and the voice speaking its sentences (a task beside it)

Barge-in (speech while a response runs, with ``interrupt_response``) and ``response.cancel``
cancel the response's scope (``realtime_response.py``).  A session holds leases on its models
until the socket closes.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from typing import Any

import trio
from quart import Blueprint, websocket

from ..audio.engines import check_voice
from ..audio.realtime_api import (
    InputBuffer, Invalid, SpeechPaused, SpeechResumed, SpeechStarted, TurnDetector, decode_audio, error_event,
    event, for_detection, new_id,
)
from ..audio.realtime_text import Agreement, Spoken
from ..audio.realtime_state import Conversation, SessionConfig, check_items, check_response
from ..audio.wav import SAMPLE_RATE
from ..errors import GenerationFailed, RequestInvalid, TurboSparkError
from ..web.app import system
from ..wire.codec import parse_json
from ._audio import resolve_audio
from .audio_realtime import _limits, _vad_detector, observed, session_slot
from .realtime_response import Response, chat_tools, respond
from .realtime_transcription import Transcription, Turn, hypothesis, hypothesize, transcribe

blueprint = Blueprint("realtime", __name__)
log = logging.getLogger("turbospark")

_KEYS = {"model", "intent"}
EVENTS_WAITING = 256  # server events queued for a slow reader before the producers wait
COMMITS_WAITING = 64
MAX_BUFFERED_SECONDS = 300.0  # audio buffered, and audio committed and waiting for its transcript
IDLE_FACTOR = 10  # a conversation may sit idle 10x the transcription socket's limit (10 min by default)
_OPENAI_STT, _OPENAI_TTS = "whisper-1", "tts-1"  # reach the only (or loaded) model of the task


@blueprint.websocket("/v1/realtime")
async def realtime() -> None:
    await observed(_open)


async def _open() -> None:
    args = websocket.args
    for key in args:
        if key not in _KEYS:
            raise RequestInvalid(f'the query parameter "{key}" is not supported', param=key)
    intent = args.get("intent") or "conversation"
    if intent not in ("conversation", "transcription"):
        raise RequestInvalid(f'intent must be transcription, not "{intent}"', param="intent")
    sys_ = system()
    with session_slot(_limits()), ExitStack() as held:  # the session's leases on its models, until it closes
        stt = await _optional(resolve_audio(_OPENAI_STT, "speech_to_text", scope=held))
        if intent == "transcription":
            if stt is None:
                raise RequestInvalid("no speech-to-text model is attached", param="intent")
            chat, voice = None, None
        else:
            chat = (await sys_.lease(args.get("model") or None, "chat", scope=held)).entry
            voice = await _optional(resolve_audio(_OPENAI_TTS, "text_to_speech", scope=held))
        protocol = "realtime" if "realtime" in websocket.requested_subprotocols else None
        await websocket.accept(subprotocol=protocol)
        kind = "transcription" if intent == "transcription" else "realtime"
        config = SessionConfig.new(
            kind, model=chat.id if chat else "", voice=voice.voices[0] if voice else None,
            stt_model=stt.id if stt else None, session_id=new_id("sess"),
        )
        await _Session(config, chat, stt, voice).run()


async def _optional(resolving: Any) -> Any:
    try:
        return await resolving
    except TurboSparkError:
        return None


class _Session:
    def __init__(self, config: SessionConfig, chat: Any, stt: Any, voice: Any) -> None:
        self.config, self.chat, self.stt, self.voice = config, chat, stt, voice
        self.conversation = Conversation()
        self.settings = system().settings
        self.out_send, self.out_recv = trio.open_memory_channel[dict[str, Any]](EVENTS_WAITING)
        self.commits_send, self.commits_recv = trio.open_memory_channel[Turn](COMMITS_WAITING)
        self.buffer = InputBuffer()
        self.audio_ms = 0  # audio received since the session began
        self.detector = self._detector()
        self.early: Transcription | None = None  # the turn's, begun at VAD's pause
        self.hypothesis: Transcription | None = None  # a transcription session's turn so far
        self.hypothesis_ms = 0  # the audio_ms it began at
        self.agreement = Agreement()  # the words the turn's hypotheses gave
        self.next_item = new_id("item")  # the user item the audio being spoken will become
        self.response: Response | None = None
        self.spoken: dict[str, Spoken] = {}  # assistant audio items, for truncate
        self.pending: dict[str, trio.Event] = {}  # committed audio not yet transcribed, by item
        self.queued = 0  # samples committed and waiting for their transcription
        self.answer_next = False  # a turn ended while a response ran: answer it after
        self.nursery: trio.Nursery | None = None

    # --- plumbing ------------------------------------------------------------------------------

    async def emit(self, message: dict[str, Any]) -> None:
        await self.out_send.send(message)

    async def writer(self) -> None:
        async for message in self.out_recv:
            with trio.move_on_after(self.settings.write_timeout) as stuck:
                await websocket.send(json.dumps(message, ensure_ascii=False))
            if stuck.cancelled_caught:
                log.info("realtime session %s: the client took nothing for %g s; closing",
                         self.config.data["id"], self.settings.write_timeout)
                assert self.nursery is not None
                self.nursery.cancel_scope.cancel()
                return

    def _detector(self) -> TurnDetector | None:
        detection, is_speech = self.config.turn_detection, _vad_detector()
        if detection is None or is_speech is None:
            return None
        return TurnDetector(is_speech, silence_duration_ms=int(detection.get("silence_duration_ms") or 500),
                            prefix_padding_ms=int(detection.get("prefix_padding_ms") or 300),
                            start_ms=self.audio_ms)

    async def run(self) -> None:
        limits = self.settings
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self.writer)
            nursery.start_soon(self.transcriber)
            await self.emit(event("session.created", session=self.config.data))
            idle_s = IDLE_FACTOR * limits.realtime_idle_seconds
            with trio.move_on_after(limits.realtime_max_seconds) as deadline:
                while True:
                    with trio.move_on_after(idle_s) as idle:
                        data = await websocket.receive()
                    if idle.cancelled_caught and (self.response is not None or self.pending):
                        continue  # the server is still answering: that is not the client idling
                    if idle.cancelled_caught:
                        await self.emit(error_event(RequestInvalid(f"idle timeout: no client event for {idle_s:g} s")))
                        break
                    await self.dispatch(data)
            if deadline.cancelled_caught:
                await self.emit(error_event(RequestInvalid(f"session time limit of {limits.realtime_max_seconds:g} s reached")))
            if self.response is not None:
                self.response.scope.cancel()
            self.commits_send.close()
            with trio.move_on_after(2):
                while self.out_recv.statistics().current_buffer_used:  # what is queued goes out
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        await websocket.close(1000)

    async def dispatch(self, data: str | bytes) -> None:
        event_id = None
        try:
            if isinstance(data, bytes):
                raise RequestInvalid("send client events as JSON text frames", param="type")
            message = parse_json(data.encode())
            if not isinstance(message, dict) or not isinstance(message.get("type"), str):
                raise RequestInvalid("a client event is a JSON object with a type", param="type")
            event_id = message.get("event_id") if isinstance(message.get("event_id"), str) else None
            kind = message["type"]
            if kind not in _EVENTS or (self.config.kind == "transcription" and kind not in _TRANSCRIPTION):
                raise Invalid(f"Invalid value: '{kind}'", param="type", code="invalid_value")
            await getattr(self, kind.replace(".", "_"))(message)
        except TurboSparkError as exc:
            await self.emit(error_event(exc, event_id))
        except Exception:  # a bug: logged with an id the client sees; the session goes on
            failure = GenerationFailed.new("the event could not be handled")
            log.exception("realtime session %s: %s", self.config.data["id"], failure.message)
            await self.emit(error_event(failure, event_id))

    # --- session ------------------------------------------------------------------------------

    async def session_update(self, message: dict[str, Any]) -> None:
        session = message.get("session")
        if not isinstance(session, dict):
            raise RequestInvalid("session must be an object", param="session")
        output = (session.get("audio") or {}).get("output") if isinstance(session.get("audio"), dict) else None
        if isinstance(output, dict) and isinstance(output.get("voice"), str) and self.voice is not None:
            check_voice(self.voice.voices, output["voice"])
        if session.get("output_modalities") == ["audio"] and self.voice is None:
            raise RequestInvalid("no text-to-speech model is attached: output_modalities must be ['text']",
                                 param="session.output_modalities")
        if "tools" in session or "tool_choice" in session:  # refused now, not at the next response
            chat_tools(session.get("tools", self.config.data.get("tools")),
                       session.get("tool_choice", self.config.data.get("tool_choice")))
        detection = self.config.turn_detection
        self.config.update(session)
        if self.config.turn_detection != detection:  # a turn in progress survives other updates
            self.detector = self._detector()
            self.drop_early()
        await self.emit(event("session.updated", session=self.config.data))

    # --- input audio --------------------------------------------------------------------------

    async def input_audio_buffer_append(self, message: dict[str, Any]) -> None:
        audio, rate = decode_audio(message.get("audio"), self.config.input_format)
        if self.buffer.seconds + audio.size / rate > MAX_BUFFERED_SECONDS:
            raise RequestInvalid(f"more than {MAX_BUFFERED_SECONDS:g} s of audio buffered; commit more often",
                                 param="audio")
        self.buffer.append(audio, rate)
        self.audio_ms += audio.size * 1000 // rate
        if self.detector is None:
            return
        for change in self.detector.feed(for_detection(audio, rate)):
            if isinstance(change, SpeechStarted):
                detection = self.config.turn_detection or {}
                if self.response is not None and detection.get("interrupt_response", True):
                    self.response.reason = "turn_detected"
                    self.response.scope.cancel()  # barge-in, before an event can wait for room
                await self.emit(event("input_audio_buffer.speech_started", audio_start_ms=change.audio_start_ms,
                                      item_id=self.next_item))
                self.hypothesis_ms = self.audio_ms
            elif isinstance(change, SpeechPaused):
                self.drop_hypothesis()
                self.begin_early()
            elif isinstance(change, SpeechResumed):
                self.drop_early()
            else:
                await self.emit(event("input_audio_buffer.speech_stopped", audio_end_ms=change.audio_end_ms,
                                      item_id=self.next_item))
                await self.commit_buffer(auto=True)
        if not self.detector.speaking:  # silence before speech is no turn's: let it go
            self.buffer.trim(self.detector.lookback_ms() / 1000)
        elif self.config.kind == "transcription" and self.detector.silent_ms == 0:  # not in a pause
            hypothesis(self)

    async def input_audio_buffer_commit(self, message: dict[str, Any]) -> None:
        await self.commit_buffer(auto=False)

    async def commit_buffer(self, *, auto: bool) -> None:
        if self.buffer.seconds < 0.1:
            raise Invalid(
                f"Error committing input audio buffer: buffer too small. Expected at least 100ms of audio, "
                f"but buffer only has {self.buffer.seconds * 1000:.2f}ms of audio.",
                code="input_audio_buffer_commit_empty")
        if self.stt is None:
            raise RequestInvalid("no speech-to-text model is attached: send text items instead", param="type")
        if self.queued / SAMPLE_RATE + self.buffer.seconds > MAX_BUFFERED_SECONDS:
            raise RequestInvalid(f"more than {MAX_BUFFERED_SECONDS:g} s of committed audio wait for their "
                                 "transcription; wait for them", param="type")
        item_id, self.next_item = self.next_item, new_id("item")
        previous = self.conversation.last_id()
        item: dict[str, Any] = {}
        if self.config.kind == "realtime":
            item, previous = self.conversation.add_input_audio(item_id)
            item_id = item["id"]
        if not auto:  # the client's commit: its whole audio is transcribed
            self.drop_early()
        early, self.early = self.early, None
        self.drop_hypothesis()
        agreement, self.agreement = self.agreement, Agreement()
        audio = self.buffer.take()
        self.queued += audio.size
        self.pending[item_id] = trio.Event()
        await self.emit(event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id))
        if self.config.kind == "realtime":
            await self.emit(event("conversation.item.added", previous_item_id=previous, item=item))
        await self.commits_send.send(Turn(item_id, audio, auto, early, agreement))

    def begin_early(self) -> None:
        """At VAD's pause: transcribe the turn so far while VAD waits out the silence."""
        self.drop_early()
        if self.stt is not None and self.nursery is not None:
            audio = self.buffer.peek()
            self.early = Transcription()
            if self.config.kind == "transcription":  # a hypothesis too: its words go out at once
                self.nursery.start_soon(hypothesize, self, self.early, audio, self.agreement, self.next_item, True)
            else:
                self.nursery.start_soon(self.early.run, self.stt.id, audio, self.config.language)

    def drop_early(self) -> None:
        if self.early is not None:
            self.early.cancel()
            self.early = None

    def drop_hypothesis(self) -> None:
        if self.hypothesis is not None:
            self.hypothesis.cancel()
            self.hypothesis = None

    async def input_audio_buffer_clear(self, message: dict[str, Any]) -> None:
        self.drop_early()
        self.drop_hypothesis()
        self.agreement = Agreement()
        self.buffer.take()
        if self.detector is not None:
            self.detector.reset()
        await self.emit(event("input_audio_buffer.cleared"))

    async def transcriber(self) -> None:
        async for turn in self.commits_recv:
            item_id, audio = turn.item_id, turn.audio
            try:
                await transcribe(self, turn)
            except TurboSparkError as exc:
                await self.emit(error_event(exc))
            except Exception:  # a bug: this item's transcription fails, logged; the session goes on
                failure = GenerationFailed.new("the transcription failed")
                log.exception("realtime session %s: %s", self.config.data["id"], failure.message)
                await self.emit(error_event(failure))
            finally:
                self.queued -= audio.size
                if (done := self.pending.pop(item_id, None)) is not None:
                    done.set()

    # --- items --------------------------------------------------------------------------------

    async def conversation_item_create(self, message: dict[str, Any]) -> None:
        item, previous = self.conversation.create(message.get("item"), message.get("previous_item_id"))
        await self.emit(event("conversation.item.added", previous_item_id=previous, item=item))
        await self.emit(event("conversation.item.done", previous_item_id=previous, item=item))

    async def conversation_item_delete(self, message: dict[str, Any]) -> None:
        self.conversation.delete(message.get("item_id"))
        self.spoken.pop(message["item_id"], None)
        await self.emit(event("conversation.item.deleted", item_id=message["item_id"]))

    async def conversation_item_retrieve(self, message: dict[str, Any]) -> None:
        await self.emit(event("conversation.item.retrieved", item=self.conversation.get(message.get("item_id"))))

    async def conversation_item_truncate(self, message: dict[str, Any]) -> None:
        item, end = self.conversation.truncate(message, self.spoken)
        await self.emit(event("conversation.item.truncated", item_id=item["id"], content_index=0, audio_end_ms=end))

    # --- responses ----------------------------------------------------------------------------

    async def response_create(self, message: dict[str, Any]) -> None:
        if self.response is not None:
            raise Invalid(
                f"Conversation already has an active response in progress: {self.response.id}. Wait until "
                "the response is finished before creating a new one.", code="conversation_already_has_active_response")
        await self.start_response(message.get("response"))

    async def response_cancel(self, message: dict[str, Any]) -> None:
        wanted = message.get("response_id")
        if self.response is None or (wanted is not None and wanted != self.response.id):
            raise Invalid("Cancellation failed: no active response found", code="response_cancel_not_active")
        self.response.reason = "client_cancelled"
        self.response.scope.cancel()

    async def start_response(self, given: Any) -> None:
        params = check_response(given)
        modalities = params.output_modalities or self.config.data.get("output_modalities") or ["text"]
        if "audio" in modalities and self.voice is None:
            raise RequestInvalid("no text-to-speech model is attached: output_modalities must be ['text']",
                                 param="response.output_modalities")
        items = None
        if params.input is not None:
            items = []
            for item in check_items(params.input):
                items.append(self.conversation.get(item.get("id")) if item.get("type") == "item_reference" else item)
        response = Response(new_id("resp"), trio.CancelScope(), "audio" in modalities)
        self.response = response
        assert self.nursery is not None
        self.nursery.start_soon(respond, self, response, params, items, modalities)


#: Client events, each handled by the method of its name (dots as underscores).
_EVENTS = frozenset({"session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                     "input_audio_buffer.clear", "conversation.item.create", "conversation.item.delete",
                     "conversation.item.retrieve", "conversation.item.truncate", "response.create",
                     "response.cancel"})
_TRANSCRIPTION = {"session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear"}
