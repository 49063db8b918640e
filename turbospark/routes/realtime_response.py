"""One response of a ``/v1/realtime`` session (``routes/realtime.py``): the chat turn's events
as Realtime events, and the voice beside it speaking the answer sentence by sentence.

The session runs ``Run.turn`` inside the response's cancel scope and ``Run.finish`` after it, so
a cancelled answer (barge-in, ``response.cancel``) still closes its items and says
``response.done``.  The turn's reply channels and each sentence's audio work are entered in exit
stacks inside that scope: cancelling it stops the decode within a step and the voice at its next
chunk.
"""

from __future__ import annotations

import base64
import logging
from contextlib import ExitStack, aclosing
from typing import Any

import attrs
import trio

from ..audio.engines import check_voice
from ..audio.messages import Chunk, Synthesize, WorkFailed
from ..audio.realtime_api import bytes_per_second, encode_audio, error_event, event, new_id
from ..audio.realtime_text import Sentences, Spoken
from ..audio.realtime_state import voice_name
from ..errors import GenerationFailed, RequestInvalid, TurboSparkError
from ..messages import ChatPrompt, Started
from ..turns.sampling import sampling
from ..turns.structured import function_tools, grammar_for, select_tools
from ..turns.turn_events import ArgumentsDelta, CallEnd, CallStart, Error, Finish, Text, Usage
from ..web.app import system
from ..wire.openai import MAX_TOOLS
from ._audio import receive, submit
from ._generation import Context
from ._turn import TurnPlan, open_turn

__all__ = ["Response", "Run", "chat_tools", "respond"]

log = logging.getLogger("turbospark")


def chat_tools(flat: Any, choice: Any) -> tuple[tuple[dict[str, Any], ...], bool]:
    """A session's or response's ``tools`` (the Realtime API's flat shape) and ``tool_choice``,
    checked as chat checks its tools (at most ``MAX_TOOLS``, names, schemas): the tools in
    play, in chat's shape, and whether a call is required."""
    flat = flat or []
    if not isinstance(flat, list):
        raise RequestInvalid("tools must be an array", param="tools")
    if len(flat) > MAX_TOOLS:
        raise RequestInvalid(f"at most {MAX_TOOLS} tools, not {len(flat)}", param="tools")
    nested = []
    for i, tool in enumerate(flat):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestInvalid(f"tools[{i}]: only function tools are supported", param="tools")
        nested.append({"type": "function", "function": {k: v for k, v in tool.items()
                                                        if k in ("name", "description", "parameters")}})
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return select_tools(function_tools(nested), choice)


@attrs.define
class Response:
    """The response in progress: cancelling ``scope`` ends it; ``reason`` says why."""

    id: str
    scope: trio.CancelScope
    audio: bool
    reason: str = "client_cancelled"
    voice: str | None = None  # this response's voice and output format (response.audio.output)
    fmt: str = "audio/pcm"



class Run:
    """One response: the chat turn's events as Realtime events, the voice beside it."""

    def __init__(self, session: Any, response: Response, shape: dict[str, Any], keep: bool) -> None:
        self.s, self.response, self.shape, self.keep = session, response, shape, keep
        self.output: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the assistant message item, once text came
        self.text = ""
        self.spoken = Spoken()
        self.calls: dict[int, dict[str, Any]] = {}
        self.usage: Usage | None = None
        self.failed: TurboSparkError | None = None
        self.cancelled = False
        self.finished_reason: str | None = None

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"response_id": self.response.id, "item_id": item["id"], "output_index": self.output.index(item)}

    async def _add(self, item: dict[str, Any]) -> None:
        self.output.append(item)
        await self.s.emit(event("response.output_item.added", response_id=self.response.id,
                                output_index=len(self.output) - 1, item=item))
        if self.keep:
            previous = self.s.conversation.add(item)
            await self.s.emit(event("conversation.item.added", previous_item_id=previous, item=item))

    async def turn(self, params: Any, items: Any, max_tokens: Any) -> None:
        s, cfg = self.s, self.s.config.data
        instructions = params.instructions if params.instructions is not None else cfg.get("instructions")
        for transcribed in list(s.pending.values()):  # the user's last words, heard in full
            await transcribed.wait()
        messages = s.conversation.messages(items)
        if instructions:
            messages = [{"role": "system", "content": instructions}, *messages]
        elif s.settings.system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": s.settings.system_prompt}, *messages]
        if not messages:
            raise RequestInvalid("the conversation is empty: add an item or speak first", param="response")
        tools, required = chat_tools(params.tools if params.tools is not None else cfg.get("tools"),
                                     params.tool_choice if params.tool_choice is not None else cfg.get("tool_choice"))
        parallel = (params.parallel_tool_calls if params.parallel_tool_calls is not None
                    else cfg.get("parallel_tool_calls")) is not False
        grammar = grammar_for(tools=tools, call_required=required, parallel=parallel)
        budget = max_tokens if isinstance(max_tokens, int) else s.chat.context_window
        temperature = params.temperature if params.temperature is not None else cfg.get("temperature")
        sampling_params = sampling(s.chat.sampling_defaults, {"temperature": temperature},
                                   max_tokens=budget, grammar=grammar)
        plan = TurnPlan(s.chat.id, ChatPrompt(tuple(messages), tools, {}), sampling_params,
                        call_required=required, parallel=parallel, clamp=True)
        started: list[Started] = []
        with ExitStack() as scope:  # the turn's reply channels: closing them stops the decode
            turn = await open_turn(plan, request_id=-1, guardrails=s.settings.guardrails,
                                   on_started=started.append, context=Context(system(), scope))
            if started:
                left = s.chat.context_window - started[0].prompt_tokens
                await s.emit(event("rate_limits.updated", rate_limits=[
                    {"name": "tokens", "limit": s.chat.context_window, "remaining": max(left, 0), "reset_seconds": 0}]))
            async with trio.open_nursery() as voice, aclosing(turn.events()) as events:
                sentences_send, sentences_recv = trio.open_memory_channel[str](1024)
                if self.response.audio:
                    voice.start_soon(self.speak, sentences_recv, voice.cancel_scope)
                with sentences_send:
                    splitter = Sentences()
                    async for ev in events:
                        if isinstance(ev, Error):  # kept, and raised outside the nursery
                            self.failed = ev.error
                            break
                        if isinstance(ev, Text):
                            await self.say(ev.text)
                            for sentence in splitter.feed(ev.text):
                                await sentences_send.send(sentence)
                        elif isinstance(ev, CallStart):
                            item = {"id": new_id("item"), "object": "realtime.item", "type": "function_call",
                                    "status": "in_progress", "name": ev.name, "call_id": ev.id, "arguments": ""}
                            self.calls[ev.index] = item
                            await self._add(item)
                        elif isinstance(ev, ArgumentsDelta):
                            item = self.calls[ev.index]
                            item["arguments"] += ev.text
                            await s.emit(event("response.function_call_arguments.delta", **self._where(item),
                                               call_id=item["call_id"], delta=ev.text))
                        elif isinstance(ev, CallEnd):
                            item = self.calls[ev.call.index]
                            item["arguments"], item["status"] = ev.call.arguments, "completed"
                            await s.emit(event("response.function_call_arguments.done", **self._where(item),
                                               call_id=item["call_id"], name=item["name"], arguments=item["arguments"]))
                            await s.emit(event("response.output_item.done", response_id=self.response.id,
                                               output_index=self.output.index(item), item=item))
                            if self.keep:
                                await s.emit(event("conversation.item.done", previous_item_id=None, item=item))
                        elif isinstance(ev, Finish):
                            self.finished_reason = ev.reason
                        elif isinstance(ev, Usage):
                            self.usage = ev
                    for sentence in [] if self.failed else splitter.flush():
                        await sentences_send.send(sentence)
        if self.failed is not None:
            raise self.failed

    async def say(self, piece: str) -> None:
        """A piece of the answer's text: the message item opens with the first one."""
        if self.message is None:
            self.message = {"id": new_id("item"), "object": "realtime.item", "type": "message",
                            "status": "in_progress", "role": "assistant", "content": []}
            await self._add(self.message)
            if self.response.audio:
                self.s.spoken[self.message["id"]] = self.spoken  # truncate may come while it speaks
            part = {"type": "audio", "transcript": ""} if self.response.audio else {"type": "text", "text": ""}
            await self.s.emit(event("response.content_part.added", **self._where(self.message),
                                    content_index=0, part=part))
        self.text += piece
        kind = "response.output_audio_transcript.delta" if self.response.audio else "response.output_text.delta"
        await self.s.emit(event(kind, **self._where(self.message), content_index=0, delta=piece))

    async def speak(self, sentences: trio.MemoryReceiveChannel[str], voice: trio.CancelScope) -> None:
        """Each sentence through the voice, its audio out as ``response.output_audio.delta``; a
        failure is kept as the response's and ends the turn (``voice``: the scope of both)."""
        try:
            await self._speak(sentences)
        except TurboSparkError as exc:
            self.failed = exc
            voice.cancel()

    async def _speak(self, sentences: trio.MemoryReceiveChannel[str]) -> None:
        s, fmt = self.s, self.response.fmt
        async for sentence in sentences:
            self.spoken.begin(sentence)
            with ExitStack() as scope:  # the voice's work: closed with the response's scope
                recv = await submit(scope, request_id=-1, model=s.voice.id, endpoint="realtime",
                                    args=Synthesize(sentence.strip(), check_voice(s.voice.voices, self.response.voice),
                                                    min(2.0, max(0.5, s.config.speed))))
                while True:
                    reply = await receive(recv)
                    if isinstance(reply, Chunk):
                        audio = encode_audio(reply.pcm, s.voice.sample_rate, fmt)
                        assert self.message is not None
                        await s.emit(event("response.output_audio.delta", **self._where(self.message),
                                           content_index=0, delta=base64.b64encode(audio).decode()))
                        self.spoken.sent(len(audio) * 1000 / bytes_per_second(fmt))
                    elif isinstance(reply, WorkFailed):
                        raise reply.error
                    else:
                        break
            self.spoken.end()

    async def finish(self) -> None:
        """The response's closing events: its items done (a cancelled answer keeps the text of
        the audio that went out), then ``response.done``."""
        s = self.s
        status = "cancelled" if self.cancelled else "failed" if self.failed else (
            "incomplete" if self.finished_reason == "length" else "completed")
        if self.message is not None:
            m = self.message
            where = self._where(m)
            if self.response.audio:
                heard = (self.spoken.heard(self.spoken.cut) if self.spoken.cut is not None
                         else self.spoken.heard() if self.cancelled else self.text)
                part = {"type": "audio", "transcript": heard}
                if not self.cancelled:
                    await s.emit(event("response.output_audio.done", **where, content_index=0))
                await s.emit(event("response.output_audio_transcript.done", **where, content_index=0, transcript=heard))
                m["content"] = [{"type": "output_audio", "transcript": heard}]
            else:
                part = {"type": "text", "text": self.text}
                await s.emit(event("response.output_text.done", **where, content_index=0, text=self.text))
                m["content"] = [{"type": "output_text", "text": self.text}]
            await s.emit(event("response.content_part.done", **where, content_index=0, part=part))
            m["status"] = "incomplete" if status != "completed" else "completed"
            await s.emit(event("response.output_item.done", response_id=self.response.id,
                               output_index=where["output_index"], item=m))
            if self.keep:
                await s.emit(event("conversation.item.done", previous_item_id=None, item=m))
        for item in self.calls.values():  # a call cut short is closed too
            if item["status"] != "completed":
                item["status"] = "incomplete"
                await s.emit(event("response.output_item.done", response_id=self.response.id,
                                   output_index=self.output.index(item), item=item))
                if self.keep:
                    await s.emit(event("conversation.item.done", previous_item_id=None, item=item))
        details = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": self.response.reason}
        elif status == "failed" and self.failed is not None:
            details = {"type": "failed", "error": {"type": self.failed.type, "code": getattr(self.failed, "code", None),
                                                   "message": self.failed.message}}
        elif status == "incomplete":
            details = {"type": "incomplete", "reason": "max_output_tokens"}
        u = self.usage
        usage = None if u is None else {
            "total_tokens": u.prompt_tokens + u.completion_tokens, "input_tokens": u.prompt_tokens,
            "output_tokens": u.completion_tokens,
            "input_token_details": {"cached_tokens": u.cached_tokens, "text_tokens": u.prompt_tokens,
                                    "audio_tokens": 0, "image_tokens": 0},
            "output_token_details": {"text_tokens": u.completion_tokens, "audio_tokens": 0},
        }
        await s.emit(event("response.done", response={**self.shape, "status": status, "status_details": details,
                                                       "output": self.output, "usage": usage}))


async def respond(self: Any, response: Response, params: Any, items: Any, modalities: list[str]) -> None:
    """The session's response: ``response.created``, the run in the response's scope, its closing
    events whatever ended it, then the answer a turn that ended meanwhile asked for."""
    cfg = self.config.data
    into_conversation = params.conversation != "none"
    max_tokens = params.max_output_tokens if params.max_output_tokens is not None else cfg.get("max_output_tokens")
    out = params.audio.output if params.audio is not None else None
    out_fmt = out.format.type if out is not None and out.format is not None else self.config.output_format
    response.fmt = out_fmt
    response.voice = voice_name(out.voice) if out is not None and out.voice is not None else self.config.voice
    if response.voice is not None and self.voice is not None:
        response.voice = check_voice(self.voice.voices, response.voice)
    shape = {"id": response.id, "object": "realtime.response", "conversation_id":
             cfg["id"].replace("sess", "conv") if into_conversation else None,
             "output_modalities": modalities, "max_output_tokens": max_tokens or "inf",
             "audio": {"output": {"format": {"type": out_fmt, **({"rate": 24000} if out_fmt == "audio/pcm" else {})},
                                  "voice": response.voice}},
             "metadata": params.metadata, "output": [], "usage": None, "status_details": None}
    await self.emit(event("response.created", response={**shape, "status": "in_progress"}))
    run = Run(self, response, shape, into_conversation)
    with response.scope:
        try:
            await run.turn(params, items, max_tokens)
        except TurboSparkError as exc:
            run.failed = exc
        except Exception:  # a bug: this response fails with an id the log shows; the session goes on
            run.failed = GenerationFailed.new("the response failed")
            log.exception("realtime session %s: %s", cfg["id"], run.failed.message)
    if response.scope.cancelled_caught:
        run.cancelled = True
    await run.finish()
    if self.response is response:
        self.response = None
    if self.answer_next and self.response is None:
        self.answer_next = False
        try:
            await self.start_response({})
        except TurboSparkError as exc:
            await self.emit(error_event(exc))
