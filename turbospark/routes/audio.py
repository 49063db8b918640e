"""The audio HTTP routes (registered only when an audio model is attached):

- ``POST /v1/audio/transcriptions`` (multipart, or a raw WAV body with the options in the query;
  ``stream=true``: NDJSON segments; ``async=true``: a job), ``POST /v1/audio/translations`` (501);
- ``POST /v1/audio/speech`` (WAV, PCM, or chunked PCM with ``stream``);
- ``POST /v1/audio/generate`` (music: the reference's validation and jobs; no package carries
  music weights, so without a music model it is the model-not-found error);
- ``GET/DELETE /v1/audio/jobs/{id}``, ``GET /v1/audio/jobs/{id}/result``;
- ``GET/POST /v1/audio/models``, ``DELETE /v1/audio/models/{id}``: the loaded audio models; load
  one of the catalogue's and keep it (the resolver pins it), unload one (409 while requests or
  jobs use it).

The order of checks is the original server's: options, then the model (unknown: 404, wrong task:
400; a stored model not loaded yet loads, through the resolver), and only then is the audio
decoded (on a worker thread: resampling a long upload is seconds of CPU).  A request holds its
model until it ends; an async job holds it until the job ends.  Audio bodies may be 128 MiB.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from functools import partial
from typing import Any

import trio
from quart import Blueprint, Response, g, request

from ..audio import wav
from ..audio.engines import check_voice
from ..audio.messages import (
    AudioInfo,
    AudioRequest,
    Chunk,
    DeleteJob,
    GetJob,
    ResolveAudio,
    StartJob,
    Synthesize,
    Transcribe,
    WorkDone,
    WorkFailed,
)
from ..audio.wire import (
    RAW_AUDIO_TYPES,
    Transcript,
    TranscriptionOptions,
    Unsupported,
    UnsupportedMedia,
    check_duration,
    check_generate,
    check_speech,
    render_transcript,
    transcription_options,
)
from ..web.bodies import read_json
from ..actors.audio import Conflict, HeldJob
from ..actors.lifecycle import FOREVER, loadable_for
from ..errors import ModelNotFound, NotFound, RequestInvalid, ShuttingDown, TurboSparkError
from ..messages import RequestRouted
from ..web.app import json_response, request_scope, system
from ._audio import ask, receive, resolve_audio, submit

_KIND = {"speech_to_text": "speech-to-text", "text_to_speech": "text-to-speech"}

blueprint = Blueprint("audio", __name__)

_ENDPOINTS = {
    ("POST", "/v1/audio/transcriptions"): "transcriptions",
    ("POST", "/v1/audio/speech"): "speech",
    ("POST", "/v1/audio/generate"): "generate",
    ("POST", "/v1/audio/models"): "models_load",
    ("DELETE", "/v1/audio/models/<path:model_id>"): "models_unload",
}


@blueprint.after_request
async def _count(response: Response) -> Response:
    rule = request.url_rule.rule if request.url_rule is not None else ""
    endpoint = _ENDPOINTS.get((request.method, rule))
    record = g.get("record")
    if endpoint and record is not None:
        system().emit(AudioRequest(endpoint, response.status_code, time.monotonic() - record.began))
    return response


# --- transcription -----------------------------------------------------------------------------


async def _upload() -> tuple[dict[str, str], bytes]:
    """The options and the audio bytes of a transcription request."""
    ctype = (request.mimetype or "").lower()
    if ctype == "multipart/form-data":
        form = await request.form
        files = await request.files
        fields = {k: form[k] for k in form}
        parts = [f for key in files for f in files.getlist(key)]
        for key in files:
            if key != "file":
                raise RequestInvalid(f'the field "{key}" is not supported by this server', param=key)
        options = transcription_options(fields)
        if len(parts) != 1:
            raise RequestInvalid("send exactly one file part (the audio)", param="file")
        return {**fields, "model": options.model}, parts[0].read()
    if ctype not in RAW_AUDIO_TYPES:
        raise UnsupportedMedia(
            f'content type "{ctype}" is not supported; send multipart/form-data or a WAV body (audio/wav)'
        )
    fields = {k: request.args[k] for k in request.args}
    transcription_options(fields)
    return fields, await request.get_data()


def _decode(data: bytes) -> Any:
    try:
        audio = wav.decode(data)
    except wav.NotWav as exc:
        raise UnsupportedMedia(str(exc)) from None
    except wav.AudioInvalid as exc:
        raise RequestInvalid(str(exc), param="file") from None
    check_duration(len(audio), wav.SAMPLE_RATE)
    return audio


@blueprint.post("/v1/audio/transcriptions")
async def transcriptions() -> Response:
    fields, data = await _upload()
    opts: TranscriptionOptions = transcription_options(fields)
    info: AudioInfo = await resolve_audio(opts.model, "speech_to_text")
    system().emit(RequestRouted(g.record.id, opts.model, info.id, opts.stream))
    if not data:
        raise RequestInvalid("the audio file is empty", param="file")
    audio = await trio.to_thread.run_sync(_decode, data, abandon_on_cancel=True)
    args = Transcribe(audio, opts.language)
    if opts.run_async:
        return await _start_job("transcription", info.id, "transcriptions", args,
                                partial(_render_transcript, opts.response_format))  # fmt: skip
    recv = await submit(request_scope(), request_id=g.record.id, model=info.id, endpoint="transcriptions", args=args)
    if opts.stream:
        return _ndjson(_segments(info.id, recv))
    reply = await receive(recv)
    if isinstance(reply, WorkFailed):
        raise reply.error
    assert isinstance(reply, WorkDone) and reply.transcript is not None
    body, content_type = render_transcript(reply.transcript, opts.response_format)
    return Response(body, content_type=content_type)


def _render_transcript(fmt: str, transcript: Transcript) -> tuple[bytes, str]:
    return render_transcript(transcript, fmt)


async def _segments(model: str, recv: trio.MemoryReceiveChannel[Any]) -> AsyncIterator[dict[str, Any]]:
    yield {"type": "start", "model": model}
    try:
        reply = await receive(recv)
    except TurboSparkError as exc:
        reply = WorkFailed(exc)
    if isinstance(reply, WorkFailed):
        yield {"type": "error", "error": {"status": reply.error.status, "message": reply.error.message}}
        return
    t = reply.transcript
    for i, s in enumerate(t.segments):
        yield {"type": "segment", "id": i, "start": s.start, "end": s.end, "text": s.text}
    yield {"type": "complete", "text": t.text, "language": t.language, "duration": t.duration}


def _ndjson(events: AsyncIterator[dict[str, Any]]) -> Response:
    async def body() -> AsyncIterator[bytes]:
        async for event in events:
            yield (json.dumps(event, ensure_ascii=False) + "\n").encode()

    response = Response(body(), content_type="application/x-ndjson")
    response.headers["Cache-Control"] = "no-cache"
    response.timeout = None
    return response


@blueprint.post("/v1/audio/translations")
async def translations() -> Response:
    raise Unsupported("audio translation is unsupported; use /v1/audio/transcriptions")


# --- speech ----------------------------------------------------------------------------------------


@blueprint.post("/v1/audio/speech")
async def speech() -> Response:
    req = check_speech(await read_json())
    info: AudioInfo = await resolve_audio(req.model, "text_to_speech")
    system().emit(RequestRouted(g.record.id, req.model, info.id, req.stream))
    voice = check_voice(info.voices, req.voice)
    args = Synthesize(req.input, voice, req.speed)
    recv = await submit(request_scope(), request_id=g.record.id, model=info.id, endpoint="speech", args=args)
    headers = {"x-audio-sample-rate": str(info.sample_rate)}
    first = await receive(recv)  # awaited before committing to 200
    if isinstance(first, WorkFailed):
        raise first.error
    if req.stream:
        async def body() -> AsyncIterator[bytes]:
            message: Any = first
            while isinstance(message, Chunk):
                yield message.pcm
                try:
                    message = await recv.receive()
                except trio.EndOfChannel:
                    return  # a later failure truncates the body
        response = Response(body(), content_type="audio/pcm", headers=headers)
        response.timeout = None
        return response
    pcm: list[bytes] = []
    message: Any = first
    while isinstance(message, Chunk):
        pcm.append(message.pcm)
        message = await receive(recv)
    if isinstance(message, WorkFailed):
        raise message.error
    data = b"".join(pcm)
    if req.response_format == "wav":
        return Response(wav.encode(data, info.sample_rate), content_type="audio/wav", headers=headers)
    return Response(data, content_type="audio/pcm", headers=headers)


# --- music ------------------------------------------------------------------------------------------


@blueprint.post("/v1/audio/generate")
async def generate() -> Response:
    req = check_generate(await read_json())
    await ask(partial(ResolveAudio, req.model, "music_generation"))
    # No music engine exists to reach this point (no package carries music weights).
    raise Unsupported("music generation has no engine on this server")


# --- jobs -------------------------------------------------------------------------------------------


async def _start_job(kind: str, model: str, endpoint: Any, args: Any, render: Any) -> Response:
    """Start an async job on ``model``, which it holds (its own lease) until the job ends."""
    from ..audio.messages import AudioWork

    sys_ = system()
    inbox = sys_.audio
    assert inbox is not None
    held = ExitStack()  # the job's lease; the audio actor closes it when the job ends
    sent = False
    try:
        task = "text_to_speech" if endpoint == "speech" else "speech_to_text"
        await sys_.lease(model, task, exact=True, scope=held)  # loaded: the request holds it
        never_used, _ = trio.open_memory_channel[Any](0)  # replaced by the job's own channel
        work = AudioWork(g.record.id, model, endpoint, args, never_used, trio.current_time())
        reply_send, reply_recv = trio.open_memory_channel[Any](1)
        with reply_recv:
            await inbox.send(HeldJob(StartJob(kind, work, render, reply_send), held.close))
            sent = True
            job = await reply_recv.receive()
    except (trio.ClosedResourceError, trio.BrokenResourceError, trio.EndOfChannel):
        raise ShuttingDown() from None
    finally:
        if not sent:
            held.close()
    if isinstance(job, TurboSparkError):
        raise job
    job_id = job["id"]
    return json_response(
        {"job_id": job_id, "id": job_id, "object": "audio.job", "status": job["status"],
         "poll_url": f"/v1/audio/jobs/{job_id}"},
        202,
    )  # fmt: skip


@blueprint.get("/v1/audio/jobs/<job_id>")
async def get_job(job_id: str) -> Response:
    return json_response(await ask(partial(GetJob, job_id, "describe")))


@blueprint.get("/v1/audio/jobs/<job_id>/result")
async def job_result(job_id: str) -> Response:
    body, content_type = await ask(partial(GetJob, job_id, "result"))
    return Response(body, content_type=content_type)


@blueprint.delete("/v1/audio/jobs/<job_id>")
async def delete_job(job_id: str) -> Response:
    return json_response(await ask(partial(DeleteJob, job_id)))


# --- models -----------------------------------------------------------------------------------------


def audio_row(info: AudioInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "display_name": info.id,
        "object": "model",
        "created": info.created,
        "owned_by": "turbospark",
        "task": info.task,
        "capabilities": [info.task],
    }


@blueprint.get("/v1/audio/models")
async def list_audio_models() -> Response:
    loaded = [m.entry.audio for m in await system().running() if m.entry.audio is not None]
    return json_response({"object": "list", "data": [audio_row(i) for i in loaded]})


@blueprint.post("/v1/audio/models")
async def load_audio_model() -> Response:
    body = await read_json()
    if not isinstance(body, dict):
        raise RequestInvalid("the request body must be a JSON object")
    for key in body:
        if key not in ("model_id", "model"):
            raise RequestInvalid(f'the field "{key}" is not supported by this server', param=key)
    alias = body.get("model_id", body.get("model"))
    if not isinstance(alias, str) or not alias.strip():
        raise RequestInvalid("model_id must name an audio model", param="model_id")
    alias = alias.strip()
    sys_ = system()
    make_spec = sys_.audio_catalogue.get(alias)
    if make_spec is None:
        raise NotFound(
            f"no audio model called '{alias}': attach one of {', '.join(sorted(sys_.audio_catalogue)) or 'none'}",
            param="model", code="model_not_found",
        )  # fmt: skip
    try:
        spec = await trio.to_thread.run_sync(make_spec)  # a catalogue model is pulled first
    except TurboSparkError:
        raise
    except Exception as exc:
        raise TurboSparkError(f"cannot attach '{alias}': {exc}") from None
    await sys_.adopt(loadable_for(spec, _KIND[spec.task]))  # type: ignore[arg-type]
    grant = await sys_.lease(spec.id, spec.task, keep_alive=FOREVER, exact=True)
    return json_response(audio_row(grant.entry.audio), 201)


@blueprint.delete("/v1/audio/models/<path:model_id>")
async def unload_audio_model(model_id: str) -> Response:
    loaded = {m.entry.id: m for m in await system().running() if m.entry.audio is not None}
    model = loaded.get(model_id)
    if model is None:
        raise ModelNotFound(model_id, [])
    if model.requests:
        raise Conflict(f"model '{model_id}' has running jobs or requests; cancel them first")
    await system().unload(model_id)
    return json_response({"id": model_id, "deleted": True})
