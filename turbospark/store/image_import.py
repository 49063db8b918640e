"""Image pipelines into the store: a Diffusers directory, as written by ``save_pretrained``.

A pipeline directory has ``model_index.json`` (its ``_class_name`` says which pipeline) and one
folder per component.  A Z-Image pipeline (``ZImagePipeline``, or its image-to-image twin) needs
``transformer/``, ``text_encoder/``, ``tokenizer/``, ``vae/`` and ``scheduler/``; they are copied
as they are (their safetensors are what MLX loads, in their stored float type), with the
scheduler's options and the text encoder's kind checked first, so a pipeline this server cannot
run is refused at import with what is wrong, not at its first request.  The model is stored with
``kind`` ``text-to-image``.  Quantizing an image pipeline is not offered (``q8``/``q4`` refused).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from .directory import StoreDirectory, StoredModel
from .gguf_import import ModelImportError
from .hashing import hash_files
from .manifest import new_manifest
from .progress import Progress

__all__ = ["IMAGE_KIND", "import_pipeline", "is_pipeline", "pipeline_sha256"]

IMAGE_KIND = "text-to-image"
_PIPELINES = {"ZImagePipeline": "z-image", "ZImageImg2ImgPipeline": "z-image"}
_COMPONENTS = ("transformer", "text_encoder", "tokenizer", "vae", "scheduler")
_SCHEDULER_REFUSED = (
    "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "shift_terminal", "stochastic_sampling",
    "invert_sigmas",
)  # fmt: skip


def is_pipeline(path: Path) -> bool:
    return (path / "model_index.json").is_file()


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelImportError(f"{path} cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelImportError(f"{path} is not a JSON object")
    return data


def check_pipeline(src: Path) -> str:
    """The architecture of the pipeline in ``src``, or why this server cannot run it."""
    index = _json(src / "model_index.json")
    name = index.get("_class_name")
    if name not in _PIPELINES:
        supported = ", ".join(sorted(_PIPELINES))
        raise ModelImportError(f"{src}: a {name!r} pipeline is not supported (supported: {supported})")
    missing = [c for c in _COMPONENTS if not (src / c).is_dir()]
    if missing:
        raise ModelImportError(f"{src} is not a whole {name} directory: missing {', '.join(missing)}/")
    for component in ("transformer", "text_encoder", "vae"):
        if not any((src / component).glob("*.safetensors")):
            raise ModelImportError(f"{src / component} has no .safetensors weights")
    scheduler = _json(src / "scheduler" / "scheduler_config.json")
    if scheduler.get("_class_name") != "FlowMatchEulerDiscreteScheduler":
        raise ModelImportError(f"{src}: scheduler {scheduler.get('_class_name')!r} is not supported")
    for key in _SCHEDULER_REFUSED:
        if scheduler.get(key):
            raise ModelImportError(f"{src}: the scheduler's {key} is not supported")
    encoder = _json(src / "text_encoder" / "config.json")
    if encoder.get("model_type") != "qwen3":
        raise ModelImportError(f"{src}: a {encoder.get('model_type')!r} text encoder is not supported (only qwen3)")
    return _PIPELINES[name]


def _files(src: Path) -> list[Path]:
    return sorted(
        p for c in _COMPONENTS for p in (src / c).rglob("*") if p.is_file() and ".cache" not in p.parts
    ) + [src / "model_index.json"]


def pipeline_sha256(src: Path, progress: Progress) -> str:
    """A digest of the pipeline's files: each one's path under ``src`` and content digest."""
    digest = hashlib.sha256()
    for f in _files(src):
        rel = f.relative_to(src).as_posix()
        digest.update(f"{rel}\0{hash_files([f], progress=progress, desc=rel)}\n".encode())
    return digest.hexdigest()


def import_pipeline(store: StoreDirectory, src: Path, *, name: str, label: str, dtype: str,
                    progress: Progress) -> StoredModel:  # fmt: skip
    """Copy the pipeline in ``src`` into ``store`` as model ``name``."""
    if dtype in ("q8", "q4"):
        raise ModelImportError(f"an image pipeline is stored in its own float types, not {dtype}")
    architecture = check_pipeline(src)
    sha256 = pipeline_sha256(src, progress)
    with store.scratch() as work:
        model_dir = work / "model"
        for f in progress.each(_files(src), desc="copying", unit="file"):
            target = model_dir / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
        manifest = new_manifest(
            name=name, source=label, sha256=sha256, fmt="diffusers", architecture=architecture, dtype="native",
            context_length=None, kind=IMAGE_KIND,
        )  # fmt: skip
        return store.install(model_dir, manifest)
