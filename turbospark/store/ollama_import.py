"""Models in Ollama's store, found by their Ollama names and read for import (``ollama:NAME[:TAG]``).

Ollama keeps models under ``$OLLAMA_MODELS`` (else ``~/.ollama/models``, or the Linux system
service's ``/usr/share/ollama/.ollama/models``)::

    manifests/<host>/<namespace>/<model>/<tag>   JSON: config {digest}, layers [{mediaType, digest, size}]
    blobs/sha256-<hex>                           each layer's bytes, named by their digest

``qwen3:0.6b`` is ``registry.ollama.ai/library/qwen3/0.6b``; ``user/model`` is in namespace
``user``; ``host/user/model`` at another host; no tag is ``latest``.  The layers: ``model`` (the
GGUF), ``template`` (a Go template), ``system``, ``params`` (JSON options), ``license``,
``messages``, ``projector`` and ``adapter``.  What the store keeps of them (``apply_layers``):

- the GGUF, converted like any other;
- the template is Go, which the runtime cannot run: the GGUF's own ``tokenizer.chat_template``
  (Jinja) is used; a GGUF without one imports as a completion model, the Go template kept in the
  manifest and reported as not honoured (the family it looks like is named, nothing is guessed);
- ``params``: ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repeat_penalty`` become the
  sampling defaults (``generation_config.json``); each ``stop`` string that is one of the
  tokenizer's special tokens becomes an end-of-sequence id; the rest are recorded as not honoured;
- ``system``: the default system prompt, written into the chat template (used when a request has
  no system message, as Ollama does);
- ``license``: ``LICENSE`` files beside the weights;
- ``projector``: llama.cpp's vision projector file, read as ``--mmproj`` is
  (``store.mmproj_import``; a type not served is said, and the model serves text);
- ``messages`` is not honoured (said so); an ``adapter`` is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from .gguf_errors import ModelImportError

__all__ = ["PREFIX", "OllamaModel", "OllamaName", "apply_layers", "apply_settings", "available", "find", "ollama_root"]

PREFIX = "ollama:"
DEFAULT_HOST = "registry.ollama.ai"
_LAYER = "application/vnd.ollama.image."
#: Ollama's ``params`` -> ``generation_config.json``: what the runtime reads as sampling defaults.
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repeat_penalty": "repetition_penalty"}  # fmt: skip
_FAMILIES = (  # what a Go template looks like, by the markup it writes
    ("<|im_start|>", "ChatML"),
    ("<|start_header_id|>", "Llama 3"),
    ("<start_of_turn>", "Gemma"),
    ("[INST]", "Mistral / Llama 2"),
    ("<|user|>", "Phi-3 / Zephyr"),
)


def ollama_root() -> Path:
    """Ollama's model store: ``$OLLAMA_MODELS``, else the first of ``~/.ollama/models`` and the
    Linux service's ``/usr/share/ollama/.ollama/models`` that exists (else the former)."""
    if env := os.environ.get("OLLAMA_MODELS"):
        return Path(env).expanduser()
    home = Path.home() / ".ollama" / "models"
    service = Path("/usr/share/ollama/.ollama/models")
    return service if not home.is_dir() and service.is_dir() else home


@attrs.frozen
class OllamaName:
    """An Ollama model name, its defaults filled in."""

    model: str
    tag: str = "latest"
    namespace: str = "library"
    host: str = DEFAULT_HOST

    @classmethod
    def parse(cls, text: str) -> OllamaName:
        """``[host/][namespace/]model[:tag]`` (an ``ollama:`` prefix is dropped)."""
        text = text.removeprefix(PREFIX).strip()
        head, slash, last = text.rpartition("/")  # a host's ":port" comes before the last "/"
        model, _, tag = last.partition(":")
        path = f"{head}{slash}{model}"
        parts = path.split("/")
        if not all(parts) or len(parts) > 3 or "@" in text:
            raise ModelImportError(f"{PREFIX}{text}: not an Ollama model name ([host/][namespace/]model[:tag])")
        defaults = [DEFAULT_HOST, "library"][: 3 - len(parts)]
        host, namespace, model = [*defaults, *parts]
        return cls(model=model, tag=tag or "latest", namespace=namespace, host=host)

    def __str__(self) -> str:
        """As Ollama shows it: ``qwen3:0.6b``, ``user/model:latest``, ``host/user/model:tag``."""
        prefix = "" if self.host == DEFAULT_HOST else f"{self.host}/"
        prefix += "" if self.namespace == "library" and not prefix else f"{self.namespace}/"
        return f"{prefix}{self.model}:{self.tag}"

    @property
    def store_name(self) -> str:
        """The name it gets in our store: its Ollama name, lowercased (Ollama's names ignore case),
        ``:latest`` left off; a namespace or host joined with ``-`` (a store name holds no ``/``)."""
        base = str(self).rsplit(":", 1)[0].replace("/", "-").replace(":", "-")
        tag = "" if self.tag.lower() == "latest" else f":{self.tag}"
        return f"{base}{tag}".lower()

    def manifest_path(self, root: Path) -> Path:
        return root / "manifests" / self.host / self.namespace / self.model / self.tag


@attrs.frozen
class OllamaModel:
    """An Ollama model read from its manifest: the GGUF blob and what its other layers say."""

    name: OllamaName
    manifest_digest: str  #: ``sha256:<hex>`` of the manifest file (Ollama's model digest)
    gguf: Path
    gguf_digest: str  #: ``sha256:<hex>``, the blob's name
    template: str | None = None
    system: str | None = None
    params: dict[str, Any] = attrs.field(factory=dict)
    licenses: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()  #: layers that are not honoured, said in words
    projector: Path | None = None  #: the ``projector`` layer's blob (llama.cpp's vision projector file)


def _blob(root: Path, digest: str) -> Path:
    return root / "blobs" / digest.replace(":", "-")


def _find_manifest(root: Path, name: OllamaName) -> Path | None:
    """The manifest file, matched exactly, else ignoring case (Ollama's names ignore case)."""
    exact = name.manifest_path(root)
    if exact.is_file():
        return exact
    folder = root / "manifests"
    for part in (name.host, name.namespace, name.model, name.tag):
        if not folder.is_dir():
            return None
        folder = next((e for e in sorted(folder.iterdir()) if e.name.lower() == part.lower()), None)
        if folder is None:
            return None
    return folder if folder.is_file() else None


def _read_layers(manifest_file: Path) -> tuple[dict[str, Any], str]:
    raw = manifest_file.read_bytes()
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise ModelImportError(f"{manifest_file} is not an Ollama manifest ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
        raise ModelImportError(f"{manifest_file} is not an Ollama manifest (it lists no layers)")
    manifest["layers"] = [layer for layer in manifest["layers"] if isinstance(layer, dict)]
    return manifest, f"sha256:{hashlib.sha256(raw).hexdigest()}"


def _text(root: Path, layer: dict[str, Any]) -> str:
    path = _blob(root, str(layer.get("digest", "")))
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelImportError(f"the Ollama store lacks blob {path.name} ({exc.strerror})") from None


def find(text: str, root: Path | None = None) -> OllamaModel:
    """The model ``text`` (``[ollama:]NAME[:TAG]``) in Ollama's store at ``root``.

    Raises:
        ModelImportError: no such store or model, a blob missing, or a model we cannot import
            (no GGUF layer, an adapter, safetensors tensors).
    """
    root = ollama_root() if root is None else root
    name = OllamaName.parse(text)
    if not (root / "manifests").is_dir():
        raise ModelImportError(f"no Ollama store at {root} (set OLLAMA_MODELS to where Ollama keeps its models)")
    manifest_file = _find_manifest(root, name)
    if manifest_file is None:
        raise ModelImportError(
            f"no Ollama model {str(name)!r} in {root}: `turbospark models list --ollama` shows what is there"
        )
    manifest, digest = _read_layers(manifest_file)
    kinds: dict[str, list[dict[str, Any]]] = {}
    for layer in manifest["layers"]:
        media = str(layer.get("mediaType", "")).split(";")[0].strip().removeprefix(_LAYER)
        kinds.setdefault(media, []).append(layer)
    if "adapter" in kinds:
        raise ModelImportError(f"{name} applies a LoRA adapter to its model, which turbospark cannot apply")
    if "model" not in kinds:
        what = "safetensors tensors" if "tensor" in kinds else "no GGUF model layer"
        raise ModelImportError(f"{name} has {what}: only GGUF-based Ollama models can be imported")
    gguf_digest = str(kinds["model"][0].get("digest", ""))
    gguf = _blob(root, gguf_digest)
    if not gguf.is_file():
        raise ModelImportError(f"the Ollama store lacks {name}'s model blob {gguf.name}")
    params: dict[str, Any] = {}
    if "params" in kinds:
        try:
            params = json.loads(_text(root, kinds["params"][0]))
        except ValueError as exc:
            raise ModelImportError(f"{name}'s params layer is not JSON ({exc})") from None
    default_templates = [t for t in kinds.get("template", []) if "name=" not in str(t.get("mediaType"))]
    ignored = ["the messages layer (preset conversation messages)"] if "messages" in kinds else []
    projector = _blob(root, str(kinds["projector"][0].get("digest", ""))) if "projector" in kinds else None
    if projector is not None and not projector.is_file():
        raise ModelImportError(f"the Ollama store lacks {name}'s projector blob {projector.name}")
    return OllamaModel(
        name=name,
        manifest_digest=digest,
        gguf=gguf,
        gguf_digest=gguf_digest,
        template=_text(root, default_templates[0]) if default_templates else None,
        system=_text(root, kinds["system"][0]) if "system" in kinds else None,
        params=params if isinstance(params, dict) else {},
        licenses=tuple(_text(root, layer) for layer in kinds.get("license", [])),
        ignored=tuple(ignored),
        projector=projector,
    )


@attrs.frozen
class Listed:
    """A model in Ollama's store as ``models list --ollama`` shows it."""

    name: OllamaName
    size: int  #: bytes of its layers
    family: str  #: from its config blob (``model_family``), or ""
    quantization: str  #: ``file_type`` from its config blob, or ""
    problem: str  #: why it cannot be imported, or ""


def _manifests(root: Path) -> Iterator[tuple[OllamaName, Path]]:
    for path in sorted((root / "manifests").glob("*/*/*/*")):
        if path.is_file():
            host, namespace, model, tag = path.relative_to(root / "manifests").parts
            yield OllamaName(model=model, tag=tag, namespace=namespace, host=host), path


def available(root: Path | None = None) -> list[Listed]:
    """Every model in Ollama's store at ``root``, whether it can be imported or not."""
    from .gguf_import import SUPPORTED_ARCHITECTURES  # mlx, which naming a model needs not load

    root = ollama_root() if root is None else root
    out = []
    for name, path in _manifests(root):
        manifest: dict[str, Any] = {}
        config: dict[str, Any] = {}
        try:
            manifest, _ = _read_layers(path)
            config = json.loads(_blob(root, str(manifest.get("config", {}).get("digest", ""))).read_text())
        except (OSError, ValueError, AttributeError, ModelImportError):
            pass
        size = sum(int(layer.get("size", 0)) for layer in manifest.get("layers", []) if isinstance(layer, dict))
        config = config if isinstance(config, dict) else {}
        family = str(config.get("model_family", ""))
        try:
            find(str(name), root)
            problem = ""
        except ModelImportError as exc:
            problem = str(exc)
        if not problem and family and family not in SUPPORTED_ARCHITECTURES:
            problem = f"architecture {family!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)} are)"
        out.append(Listed(name, size, family, str(config.get("file_type", "")), problem))
    return out


def template_family(template: str) -> str | None:
    """The chat format a Go template writes, by its markup (None when it is none of the known)."""
    return next((family for marker, family in _FAMILIES if marker in template), None)


_NOT_HONOURED = {
    "num_ctx": "the runtime uses the model's whole context window",
    "num_predict": "the runtime has no per-model default for max_tokens",
}


def apply_layers(model_dir: Path, model: OllamaModel) -> dict[str, Any]:
    """Write into ``model_dir`` (``model``'s GGUF, converted) what its other layers say that the
    runtime honours; returns the manifest's ``ollama`` record (what was and was not honoured)."""
    honoured, not_honoured = apply_settings(
        model_dir, template=model.template, system=model.system, params=model.params, licenses=model.licenses,
        ignored=model.ignored,
    )
    return {
        "name": str(model.name),
        "manifest_digest": model.manifest_digest,
        "model_digest": model.gguf_digest,
        "template": model.template,
        "system": model.system,
        "params": model.params,
        "honoured": honoured,
        "not_honoured": not_honoured,
    }


def apply_settings(
    model_dir: Path,
    *,
    template: str | None,
    system: str | None,
    params: dict[str, Any],
    licenses: tuple[str, ...] = (),
    ignored: tuple[str, ...] = (),
    merge: bool = False,
) -> tuple[list[str], list[str]]:
    """Write into ``model_dir`` what an Ollama template, system prompt, params and licences
    say that the runtime honours (an imported Ollama model's layers, or a Modelfile's lines);
    what was honoured and what was not, in words.  With ``merge``, the sampling defaults
    already in ``generation_config.json`` (a base model's) stay unless ``params`` sets them."""
    honoured: list[str] = []
    not_honoured = list(ignored)
    tok_path = model_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_path.read_text(encoding="utf-8"))
    chat_template = tok_config.get("chat_template") if isinstance(tok_config.get("chat_template"), str) else None
    if template is not None and chat_template:
        honoured.append("chat template: the GGUF's own (Jinja); Ollama's Go template is kept in the manifest")
    elif template is not None:
        family = template_family(template)
        not_honoured.append(
            f"the Go template{f' ({family})' if family else ''}: a Go template cannot be run and the GGUF "
            "has no Jinja chat template, so the model answers completions only"
        )
    if system is not None and chat_template:
        tok_config["chat_template"] = _with_default_system(chat_template, system)
        tok_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        honoured.append("system: the default system prompt, used when a request has none")
    elif system is not None:
        not_honoured.append("system: without a chat template there is no system turn")

    sampling = {target: params[key] for key, target in _SAMPLING.items()
                if isinstance(params.get(key), (int, float)) and not isinstance(params[key], bool)}  # fmt: skip
    if sampling:
        config_file = model_dir / "generation_config.json"
        if merge and config_file.exists():
            sampling = json.loads(config_file.read_text()) | sampling
        config_file.write_text(json.dumps(sampling, indent=2) + "\n")
        honoured.append("params " + ", ".join(f"{k} {params[k]}" for k in _SAMPLING if _SAMPLING[k] in sampling)
                        + ": sampling defaults")  # fmt: skip
    stops = params.get("stop", [])
    stops = [stops] if isinstance(stops, str) else [s for s in stops if isinstance(s, str)] if isinstance(stops, list) else []
    kept, dropped = _add_stop_tokens(model_dir, stops)
    if kept:
        honoured.append(f"params stop {', '.join(map(repr, kept))}: end-of-sequence tokens")
    if dropped:
        not_honoured.append(f"params stop {', '.join(map(repr, dropped))}: only special tokens can stop generation")
    for key in sorted(set(params) - set(_SAMPLING) - {"stop"}):
        not_honoured.append(f"params {key}: {_NOT_HONOURED.get(key, 'not a sampling default the runtime reads')}")

    for i, text in enumerate(licenses):
        (model_dir / ("LICENSE" if i == 0 else f"LICENSE-{i + 1}")).write_text(text, encoding="utf-8")
    if licenses:
        honoured.append("license: kept beside the weights")
    return honoured, not_honoured


def _with_default_system(template: str, system: str) -> str:
    """``template`` with ``system`` as the first message when a chat has no system message.

    The text is written as a Jinja string of escapes only, so none of its words can be mistaken
    for the template's own markup (the runtime probes the template for tool-call formats).
    """
    literal = "".join(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}" for c in system)
    return (
        "{#- The Ollama model's default system prompt (manifest.json: ollama.system) -#}\n"
        "{%- if not messages or messages[0]['role'] != 'system' -%}\n"
        f"{{%- set messages = [{{'role': 'system', 'content': \"{literal}\"}}] + messages -%}}\n"
        "{%- endif -%}\n" + template
    )


def _add_stop_tokens(model_dir: Path, stops: list[str]) -> tuple[list[str], list[str]]:
    """Add the ``stops`` that are special tokens to ``config.json``'s ``eos_token_id``; the stops
    added (or there already), and those that are not special tokens."""
    if not stops:
        return [], []
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    eos = config.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    kept = [s for s in stops if s in specials]
    for s in kept:
        if specials[s] not in ids:
            ids.append(specials[s])
    if ids:
        config["eos_token_id"] = ids[0] if len(ids) == 1 else ids
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    return kept, [s for s in stops if s not in specials]
