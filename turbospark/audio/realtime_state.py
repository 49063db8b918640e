"""OpenAI's Realtime API (GA): what a session holds, without I/O: its configuration as
``session.created``/``session.updated`` show it, and the conversation's items.

- ``SessionConfig``: ``update`` checks a ``session.update`` (unknown keys and wrong types are one
  ``RequestInvalid``) and merges it (an explicit ``null`` clears a field: ``turn_detection: null``
  is push-to-talk).
- ``check_response``: ``response.create``'s ``response``.
- ``Conversation``: items in order (``message``, ``function_call``, ``function_call_output``),
  what ``conversation.item.create|delete|retrieve|truncate`` act on, and the chat messages the
  model reads.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from ..errors import RequestInvalid
from ..turns.chat import tool_call
from ..wire.codec import structure
from ..wire.realtime import AudioOutput, RealtimeSession, ResponseParams
from .realtime_api import OUTPUT_RATE, Invalid, new_id

__all__ = ["Conversation", "ResponseParams", "SessionConfig", "check_items", "check_response", "voice_name"]

# --- the session's configuration ------------------------------------------------------------
# The GA shapes a client may send in session.update (and response.create), checked by the one
# converter: every key the API defines is accepted; the ones not honoured are kept and shown.


#: What the server shows in a session but a client may not set (echoed back, they are dropped).
_READ_ONLY = ("id", "object", "expires_at", "client_secret")
#: Objects of the session that may not be null (their fields may).
_OBJECTS = (("audio",), ("audio", "input"), ("audio", "output"))


def _output_checks(output: AudioOutput | None, where: str) -> None:
    if output is None:
        return
    voice = output.voice
    if voice is not None and not isinstance(voice, str) and not (
            isinstance(voice, dict) and isinstance(voice.get("id"), str)):
        raise RequestInvalid(f"{where}.voice must be a voice's name or {{\"id\": ...}}", param=f"{where}.voice")
    if output.speed is not None and not 0.25 <= output.speed <= 4.0:
        raise RequestInvalid(f"{where}.speed must be between 0.25 and 4", param=f"{where}.speed")


def voice_name(voice: Any) -> str | None:
    """A session's or response's voice as a name (a custom voice's id: the model's default)."""
    return voice if isinstance(voice, str) else None


def _merge(into: dict[str, Any], given: Mapping[str, Any]) -> None:
    for key, value in given.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


@attrs.define
class SessionConfig:
    """The session as the client sees it (a dict in GA's shape), and the choices read from it."""

    kind: Literal["realtime", "transcription"]
    data: dict[str, Any]

    @classmethod
    def new(cls, kind: Literal["realtime", "transcription"], *, model: str, voice: str | None,
            stt_model: str | None, session_id: str) -> SessionConfig:
        detection = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                     "silence_duration_ms": 500, "create_response": kind == "realtime",
                     "interrupt_response": kind == "realtime", "idle_timeout_ms": None}
        audio_input = {"format": {"type": "audio/pcm", "rate": OUTPUT_RATE},
                       "transcription": {"model": stt_model, "language": None, "prompt": ""},
                       "noise_reduction": None, "turn_detection": detection}
        if kind == "transcription":
            data = {"type": "transcription", "id": session_id, "object": "realtime.transcription_session",
                    "audio": {"input": audio_input}, "include": []}
            return cls(kind, data)
        data = {
            "type": "realtime", "id": session_id, "object": "realtime.session", "model": model,
            "output_modalities": ["audio"] if voice is not None else ["text"],
            "instructions": "", "tools": [], "tool_choice": "auto", "max_output_tokens": "inf",
            "audio": {"input": audio_input,
                      "output": {"format": {"type": "audio/pcm", "rate": OUTPUT_RATE}, "voice": voice, "speed": 1.0}},
            "tracing": None, "truncation": "auto", "prompt": None, "include": [],
        }
        return cls(kind, data)

    def update(self, given: Any) -> None:
        """Check and merge a ``session.update``'s ``session``: all of it, or (refused) none of it.
        Keys the API defines that change nothing here are kept and shown (decision 0029)."""
        if not isinstance(given, dict):
            raise RequestInvalid("session must be an object", param="session")
        given = {k: v for k, v in given.items() if k not in _READ_ONLY}
        for path in _OBJECTS:
            node: Any = given
            for key in path[:-1]:
                node = node.get(key) if isinstance(node, dict) else None
            if isinstance(node, dict) and path[-1] in node and node[path[-1]] is None:
                raise RequestInvalid(f"session.{'.'.join(path)} must be an object, not null",
                                     param=f"session.{'.'.join(path)}")
        checked = structure(given, RealtimeSession)
        if checked.type is not None and checked.type != self.kind:
            raise RequestInvalid(f"session.type cannot change from '{self.kind}' to '{checked.type}'",
                                 param="session.type")
        if self.kind == "transcription":
            allowed = {"type", "audio", "include"}
            if extra := sorted(set(given) - allowed):
                raise RequestInvalid(f"a transcription session takes no {', '.join(extra)}", param="session")
        fmt = (checked.audio and checked.audio.input and checked.audio.input.format)
        if fmt is not None and fmt.type == "audio/pcm" and fmt.rate not in (None, OUTPUT_RATE):
            raise RequestInvalid("audio/pcm is 24000 Hz", param="session.audio.input.format.rate")
        _check_common(checked, "session")
        _output_checks(checked.audio and checked.audio.output, "session.audio.output")
        merged = copy.deepcopy(self.data)
        _merge(merged, {k: v for k, v in given.items() if k != "type"})
        self.data = merged

    # --- what the session asks for -------------------------------------------------------------

    def _input(self) -> dict[str, Any]:
        return self.data["audio"]["input"]

    @property
    def input_format(self) -> str:
        return (self._input().get("format") or {}).get("type") or "audio/pcm"

    @property
    def output_format(self) -> str:
        out = self.data["audio"].get("output") or {}
        return (out.get("format") or {}).get("type") or "audio/pcm"

    @property
    def turn_detection(self) -> dict[str, Any] | None:
        return self._input().get("turn_detection")

    @property
    def language(self) -> str | None:
        return (self._input().get("transcription") or {}).get("language")

    @property
    def transcribes(self) -> bool:
        return self.kind == "transcription" or bool(self._input().get("transcription"))

    @property
    def voice(self) -> str | None:
        return voice_name((self.data["audio"].get("output") or {}).get("voice"))

    @property
    def speed(self) -> float:
        return float((self.data["audio"].get("output") or {}).get("speed") or 1.0)


def _check_common(checked: Any, where: str) -> None:
    budget = checked.max_output_tokens
    if budget is not None and budget != "inf" and (
            not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= 4096):
        raise RequestInvalid(f"{where}.max_output_tokens must be a whole number from 1 to 4096, or 'inf'",
                             param=f"{where}.max_output_tokens")
    choice = checked.tool_choice
    if choice is not None and choice not in ("auto", "none", "required") and not (
            isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str)):
        raise RequestInvalid(f"{where}.tool_choice must be auto, none, required or "
                             '{"type": "function", "name": ...}', param=f"{where}.tool_choice")
    if checked.temperature is not None and not 0 <= checked.temperature <= 2:
        raise RequestInvalid(f"{where}.temperature must be between 0 and 2", param=f"{where}.temperature")


def check_response(given: Any) -> ResponseParams:
    checked = structure(given if given is not None else {}, ResponseParams)
    _check_common(checked, "response")
    _output_checks(checked.audio and checked.audio.output, "response.audio.output")
    return checked



# --- the conversation -----------------------------------------------------------------------

_ROLES = ("user", "assistant", "system")
_PARTS = {"user": ("input_text", "input_audio"), "system": ("input_text",),
          "assistant": ("output_text", "output_audio", "text", "audio")}


def _check_item(item: Any) -> dict[str, Any]:
    """A client's item (``conversation.item.create``, ``response.create``'s ``input``), checked
    and in the shape the server shows items in."""
    if not isinstance(item, Mapping):
        raise RequestInvalid("item must be an object", param="item")
    kind = item.get("type")
    out: dict[str, Any] = {"id": item.get("id") or new_id("item"), "object": "realtime.item", "type": kind}
    if not isinstance(out["id"], str) or len(out["id"]) > 64:
        raise RequestInvalid("item.id must be a string of at most 64 characters", param="item.id")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise RequestInvalid(f"item.role must be one of {', '.join(_ROLES)}, got {role!r}", param="item.role")
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise RequestInvalid("item.content must be a non-empty array of parts", param="item.content")
        parts = []
        for i, part in enumerate(content):
            ptype = part.get("type") if isinstance(part, Mapping) else None
            if ptype not in _PARTS[role]:
                raise RequestInvalid(f"item.content[{i}].type must be one of {', '.join(_PARTS[role])} for "
                                     f"a {role} message, got {ptype!r}", param="item.content")
            if ptype in ("input_text", "output_text", "text"):
                if not isinstance(part.get("text"), str):
                    raise RequestInvalid(f"item.content[{i}].text must be a string", param="item.content")
                parts.append({"type": "output_text" if role == "assistant" else "input_text", "text": part["text"]})
            elif ptype == "input_audio":
                transcript = part.get("transcript")
                if transcript is None:
                    raise RequestInvalid(f"item.content[{i}]: an input_audio part needs its transcript here "
                                         "(send audio with input_audio_buffer.append)", param="item.content")
                if not isinstance(transcript, str):
                    raise RequestInvalid(f"item.content[{i}].transcript must be a string", param="item.content")
                parts.append({"type": "input_audio", "transcript": transcript})
            else:
                transcript = part.get("transcript")
                if not isinstance(transcript, str):
                    raise RequestInvalid(f"item.content[{i}].transcript must be a string", param="item.content")
                parts.append({"type": "output_audio", "transcript": transcript})
        out |= {"status": "completed", "role": role, "content": parts}
    elif kind == "function_call":
        for key in ("name", "call_id", "arguments"):
            if not isinstance(item.get(key), str):
                raise RequestInvalid(f"item.{key} must be a string for a function_call", param=f"item.{key}")
        out |= {"status": "completed", "name": item["name"], "call_id": item["call_id"], "arguments": item["arguments"]}
    elif kind == "function_call_output":
        for key in ("call_id", "output"):
            if not isinstance(item.get(key), str):
                raise RequestInvalid(f"item.{key} must be a string for a function_call_output", param=f"item.{key}")
        out |= {"status": "completed", "call_id": item["call_id"], "output": item["output"]}
    else:
        raise RequestInvalid(f"item.type must be message, function_call or function_call_output, got {kind!r}",
                             param="item.type")
    return out


def _chars(item: Mapping[str, Any]) -> int:
    return sum(len(part.get("text") or part.get("transcript") or "") for part in item.get("content", ())) + len(
        item.get("arguments", "")) + len(item.get("output", ""))


class Conversation:
    """The session's items in order; ``MAX_ITEMS`` and ``MAX_CHARS`` of text at most (the oldest
    go first)."""

    MAX_ITEMS = 1024
    MAX_CHARS = 1 << 20

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def _index(self, item_id: str) -> int:
        for i, item in enumerate(self.items):
            if item["id"] == item_id:
                return i
        raise Invalid(f"Item with item_id not found: {item_id}", param="item_id", code="item_not_found")

    def last_id(self) -> str | None:
        return self.items[-1]["id"] if self.items else None

    def add(self, item: dict[str, Any], previous_item_id: str | None = None) -> str | None:
        """Insert ``item`` after ``previous_item_id`` (``root``: first; default: last); the id
        of the item it follows."""
        if any(existing["id"] == item["id"] for existing in self.items):
            raise RequestInvalid(f"an item with id {item['id']} is already in the conversation", param="item.id")
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            at = self._index(previous_item_id) + 1
        self.items.insert(at, item)
        while len(self.items) > 1 and (len(self.items) > self.MAX_ITEMS
                                       or sum(map(_chars, self.items)) > self.MAX_CHARS):
            del self.items[0]
            at -= 1
        return self.items[at - 1]["id"] if at > 0 else None

    def add_input_audio(self, item_id: str) -> tuple[dict[str, Any], str | None]:
        """The user item committed audio becomes (its transcript to come), last; under another id
        where the client took the one ``speech_started`` announced."""
        if any(existing["id"] == item_id for existing in self.items):
            item_id = new_id("item")
        item = {"id": item_id, "object": "realtime.item", "type": "message", "status": "completed",
                "role": "user", "content": [{"type": "input_audio", "transcript": None}]}
        return item, self.add(item)

    def truncate(self, message: Mapping[str, Any], spoken: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
        """``conversation.item.truncate``: an assistant item with audio (``spoken``: what each one
        said, ``Spoken``) keeps the words of its first ``audio_end_ms``; the item, and that."""
        item = self.get(message.get("item_id"))
        end, index = message.get("audio_end_ms"), message.get("content_index", 0)
        if not isinstance(end, int) or isinstance(end, bool) or end < 0:
            raise RequestInvalid("audio_end_ms must be a whole number of milliseconds", param="audio_end_ms")
        said = spoken.get(item["id"])
        if item.get("role") != "assistant" or said is None or index != 0:
            raise RequestInvalid("only an assistant message with audio can be truncated", param="item_id")
        if end > said.ms:
            raise RequestInvalid(f"audio_end_ms {end} is past the item's audio ({said.ms:.0f} ms)", param="audio_end_ms")
        said.cut = end
        item["content"] = [{"type": "output_audio", "transcript": said.heard(end)}]  # (it may still be speaking)
        return item, end

    def create(self, given: Any, previous_item_id: Any = None) -> tuple[dict[str, Any], str | None]:
        if previous_item_id is not None and not isinstance(previous_item_id, str):
            raise RequestInvalid("previous_item_id must be a string", param="previous_item_id")
        item = _check_item(given)
        return item, self.add(item, previous_item_id)

    def get(self, item_id: Any) -> dict[str, Any]:
        if not isinstance(item_id, str):
            raise RequestInvalid("item_id must be a string", param="item_id")
        return self.items[self._index(item_id)]

    def delete(self, item_id: Any) -> None:
        self.get(item_id)
        del self.items[self._index(item_id)]

    def messages(self, items: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The items as the chat messages the model reads (function calls as an assistant's
        ``tool_calls``, outputs as ``tool`` messages)."""
        out: list[dict[str, Any]] = []
        for item in self.items if items is None else items:
            kind = item["type"]
            if kind == "message":
                text = "".join(
                    part.get("text") or part.get("transcript") or "" for part in item["content"]
                ).strip()
                if text:
                    out.append({"role": item["role"], "content": text})
            elif kind == "function_call":
                call = tool_call({"id": item["call_id"], "function": {"name": item["name"],
                                                                        "arguments": item["arguments"]}})
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        return out


def check_items(given: Any) -> list[dict[str, Any]]:
    """``response.create``'s ``input``: items (or ``item_reference``s, resolved by the caller)."""
    if not isinstance(given, list):
        raise RequestInvalid("response.input must be an array of items", param="response.input")
    return [item if isinstance(item, Mapping) and item.get("type") == "item_reference" else _check_item(item)
            for item in given]
