"""Derived models: a stored chat model with its own system prompt, parameters, messages and
licence (Ollama's create: a Modelfile, or ``/api/create``), sharing the base's weights.

The new directory holds hard links to the base's weight files (the same bytes on disk, no copy;
a copy only where the file system cannot link) and its own copies of the small files the
settings change: the chat template (``SYSTEM`` as the default system prompt and ``MESSAGE`` lines
as the conversation's opening, written into the Jinja template as an imported Ollama model's
are), ``generation_config.json`` (``PARAMETER`` sampling defaults over the base's), and stop
tokens in ``config.json``.  ``TEMPLATE`` is Go, which the runtime cannot run: it is kept and
printed back, the base's template used.  The manifest is the base's, renamed, with
``parent_model`` and an ``ollama.modelfile`` record that ``/api/show`` prints back.  A derived
model may be the base of another: it inherits what it does not set.

``ADAPTER`` (a LoRA adapter: an mlx-lm adapter directory or a GGUF LoRA) is copied into the
model's ``adapter/`` folder, read first to check it is one; the model loads as its base with it
applied to every request (``cli/attach.load_mlx``, decision 0046).  A model derived from one that
carries an adapter carries it too, unless it names its own.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path
from typing import Any

import attrs

from .directory import StoreDirectory, StoredModel, check_name
from .gguf_errors import ModelImportError
from ..wire.modelfile import ModelSpec
from .ollama_import import apply_settings

__all__ = ["BaseNotFound", "create_derived", "spec_of"]

class BaseNotFound(ModelImportError, LookupError):
    """The model a create names as its base is not in the store."""

    def __init__(self, base: str) -> None:
        super().__init__(f"model '{base}' not found: the base of a new model must be in the store")
        self.base = base


def spec_of(stored: StoredModel) -> ModelSpec | None:
    """The spec that made a derived model (None for any other)."""
    record = stored.manifest.get("ollama", {}).get("modelfile") if isinstance(stored.manifest.get("ollama"), dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("base"), str):
        return None
    messages = record.get("messages") or ()
    return ModelSpec(
        base=record["base"],
        system=record.get("system") if isinstance(record.get("system"), str) else None,
        template=record.get("template") if isinstance(record.get("template"), str) else None,
        parameters=dict(record.get("parameters") or {}),
        licenses=tuple(t for t in record.get("licenses") or () if isinstance(t, str)),
        messages=tuple(m for m in messages if isinstance(m, dict)),
        adapter=record.get("adapter") if isinstance(record.get("adapter"), str) else None,
    )


#: The folder of a derived model that holds the adapter it carries.
ADAPTER_DIR = "adapter"


def _carry(base: StoredModel, spec: ModelSpec, model_dir: Path) -> None:
    """The adapter ``spec`` names (or the base's) into ``model_dir``'s ``adapter/``; a path that
    is not an adapter is the create's ``ModelImportError``."""
    from ..model.mlx_adapters import AdapterError
    from .adapter_files import read_adapter

    target = model_dir / ADAPTER_DIR
    if spec.adapter is None:
        if (base.path / ADAPTER_DIR).is_dir():
            shutil.copytree(base.path / ADAPTER_DIR, target)
        return
    source = Path(spec.adapter).expanduser()
    try:
        read_adapter(source.name, source)
    except AdapterError as exc:
        raise ModelImportError(str(exc)) from None
    target.mkdir()
    if source.is_dir():
        for name in ("adapter_config.json", "adapters.safetensors"):
            shutil.copy2(source / name, target / name)
    else:  # a GGUF LoRA, under a GGUF's name (an uploaded blob has none)
        shutil.copy2(source, target / (source.name if source.suffix == ".gguf" else "adapter.gguf"))


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, target)


def _with_messages(template: str, messages: tuple[dict[str, str], ...]) -> str:
    """``template`` with ``messages`` opening every conversation (after its system message)."""
    literal = json.dumps([{"role": m["role"], "content": m["content"]} for m in messages], ensure_ascii=True)
    return (
        "{#- The model's opening messages (manifest.json: ollama.modelfile.messages) -#}\n"
        f"{{%- set opening = {literal} -%}}\n"
        "{%- if messages and messages[0]['role'] == 'system' -%}\n"
        "{%- set messages = [messages[0]] + opening + messages[1:] -%}\n"
        "{%- else -%}\n"
        "{%- set messages = opening + messages -%}\n"
        "{%- endif -%}\n" + template
    )


def _inherited(base: StoredModel, spec: ModelSpec) -> ModelSpec:
    """``spec`` with what the base (itself derived) set and ``spec`` does not."""
    parent = spec_of(base)
    if parent is None:
        return spec
    return ModelSpec(
        base=spec.base,
        system=spec.system if spec.system is not None else parent.system,
        template=spec.template if spec.template is not None else parent.template,
        parameters={**parent.parameters, **spec.parameters},
        licenses=spec.licenses or parent.licenses,
        messages=spec.messages or parent.messages,
        adapter=spec.adapter if spec.adapter is not None else parent.adapter,
    )


def create_derived(store: StoreDirectory, name: str, spec: ModelSpec, *, in_place: bool = False) -> StoredModel:
    """Make model ``name`` from ``spec`` in ``store`` (replacing a model of that name); the
    store is unchanged when it fails (``BaseNotFound``, or ``ModelImportError`` saying why).
    ``in_place``: ``name`` is the base itself, given its settings (a model just made from
    uploaded files with a Modelfile's ``SYSTEM`` or ``PARAMETER`` lines)."""
    name = check_name(name.removesuffix(":latest"))
    base = store.get(spec.base.removesuffix(":latest"))
    if base is None:
        raise BaseNotFound(spec.base)
    if base.kind != "generation":
        raise ModelImportError(f"'{base.name}' is a {base.kind} model: only chat and completion models can be derived")
    if name == base.name and not in_place:
        raise ModelImportError(f"a model cannot be derived from itself ('{name}')")
    with store.scratch() as work:
        model_dir = work / "model"
        model_dir.mkdir()
        for file in base.path.iterdir():
            if not file.is_file() or file.name == "manifest.json":
                continue
            if file.suffix == ".safetensors":
                _link_or_copy(file, model_dir / file.name)
            else:  # small, and changed below: a link would change the base's too
                shutil.copy2(file, model_dir / file.name)
        honoured, not_honoured = _apply(model_dir, spec)
        # the adapter as the Modelfile /api/show prints names it: its file's (or folder's) name
        named_adapter = attrs.evolve(spec, adapter=Path(spec.adapter).name if spec.adapter else None)
        _carry(base, spec, model_dir)
        if spec.adapter is not None:
            honoured.append(f"adapter: {Path(spec.adapter).name}, applied to every request")
        manifest: dict[str, Any] = dict(base.manifest)
        if not in_place:
            manifest.update(source=f"derived from {base.name}", parent_model=base.name)
        manifest.update(
            name=name,
            created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            ollama={
                "modelfile": attrs.asdict(_inherited(base, named_adapter)),
                "system": spec.system, "template": spec.template, "params": spec.parameters,
                "honoured": honoured, "not_honoured": not_honoured,
            },
        )
        return store.install(model_dir, manifest)


def _apply(model_dir: Path, spec: ModelSpec) -> tuple[list[str], list[str]]:
    tok_path = model_dir / "tokenizer_config.json"
    honoured: list[str] = []
    ignored: list[str] = []
    if spec.messages:
        tok_config = json.loads(tok_path.read_text(encoding="utf-8")) if tok_path.exists() else {}
        if isinstance(tok_config.get("chat_template"), str):
            tok_config["chat_template"] = _with_messages(tok_config["chat_template"], spec.messages)
            tok_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            honoured.append(f"messages: {len(spec.messages)} opening every conversation")
        else:
            ignored.append("messages: without a chat template there are no turns")
    if not tok_path.exists():  # a completion model without a tokenizer config: nothing to template
        tok_path.write_text("{}\n", encoding="utf-8")
    more, not_honoured = apply_settings(
        model_dir, template=spec.template, system=spec.system, params=spec.parameters, licenses=spec.licenses,
        ignored=tuple(ignored), merge=True,
    )
    return honoured + more, not_honoured
