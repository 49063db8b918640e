"""Vision from llama.cpp's files: a GGUF language model and its projector file (``mmproj``), as
llama.cpp's ``convert_hf_to_gguf.py`` writes them from the tiny Idefics3 model of
``tests/vision_models.py`` (the language model converted as the llama it is, the projector with
``--mmproj``).  Imported as a user imports a download (the projector found beside the GGUF, or
named with ``--mmproj``) or from Ollama's store (a ``projector`` layer), the model reads an image
as transformers reads it from the original directory: the same greedy text through the openai
SDK and the Ollama client, the same prompt tokens.  A projector that is not the model's, or the
projector file imported as a model, is refused saying so; one merely lying beside the GGUF is
passed over, and the import says so."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

pytest.importorskip("torch")
pytest.importorskip("mlx_vlm")

import numpy as np  # noqa: E402
import ollama  # noqa: E402
import openai  # noqa: E402
from PIL import Image  # noqa: E402

from turbospark.store.gguf_import import ModelImportError  # noqa: E402
from turbospark.store.store import ModelStore  # noqa: E402

from ._support import import_into  # noqa: E402
from ._support import serve_store as _serve  # noqa: E402
from .model.gguf_fixtures import llama_cpp_converter  # noqa: E402
from .model.test_ollama_import import lay_out  # noqa: E402
from .model.tiny import write_tiny_gguf  # noqa: E402
from .vision_models import reference_generate, tiny_idefics3  # noqa: E402

QUESTION = "What is in this image?"
NEW = 8


def _png(seed: int, size: tuple[int, int] = (48, 40)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _convert(source: Path, out: Path, *more: str) -> None:
    converter = llama_cpp_converter()
    done = subprocess.run([sys.executable, str(converter / "convert_hf_to_gguf.py"), str(source), "--outtype", "f32",
                           "--outfile", str(out), *more], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def _language_model(source: Path, out: Path) -> Path:
    """The Idefics3 directory's language model as the llama checkpoint it is (its tensors renamed
    as llama.cpp's text converter reads them)."""
    from safetensors.numpy import load_file, save_file

    out.mkdir()
    config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config["text_config"], "architectures": ["LlamaForCausalLM"]}))
    weights = load_file(source / "model.safetensors")
    text = {"model." + k.removeprefix("model.text_model."): v for k, v in weights.items() if k.startswith("model.text_model.")}
    save_file({**text, "lm_head.weight": weights["lm_head.weight"]}, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, out / name)
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_idefics3(tmp_path_factory.mktemp("transformers") / "tiny-idefics3")


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory, source: Path) -> Path:
    """A directory as a user's download leaves it: the GGUF and its ``mmproj-`` file beside it."""
    root = tmp_path_factory.mktemp("downloads")
    _convert(_language_model(source, root.parent / "text"), root / "tiny-smolvlm-f32.gguf")
    _convert(source, root / "mmproj-tiny-smolvlm-f32.gguf", "--mmproj")
    return root


@pytest.fixture(scope="module")
def expected(source: Path) -> dict[str, Any]:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(source)
    image = Image.open(io.BytesIO(_png(1))).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return {"text": tok.decode(reference_generate(source, messages, [image], NEW), skip_special_tokens=True)}


async def test_a_download_with_its_projector_reads_images_as_transformers_does(
    nursery: trio.Nursery, tmp_path: Path, downloads: Path, expected: dict[str, Any]
) -> None:
    out = import_into(tmp_path, downloads / "tiny-smolvlm-f32.gguf", "tiny-vlm")  # the projector found beside it
    assert "llama + idefics3 vision" in out
    stored = tmp_path / "models" / "tiny-vlm"
    assert json.loads((stored / "manifest.json").read_text())["vision"] == "idefics3"
    server = await _serve(nursery, tmp_path)
    b64 = base64.b64encode(_png(1)).decode()
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    chat = await sdk.chat.completions.create(model="tiny-vlm", max_tokens=NEW, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                                     {"type": "text", "text": QUESTION}]}])  # fmt: skip
    assert chat.choices[0].message.content == expected["text"]
    assert chat.usage is not None and chat.usage.prompt_tokens == 14 + 5 * 4 + 13  # as from the original directory
    client = ollama.AsyncClient(host=server.url)
    answer = await client.chat(model="tiny-vlm", options={"temperature": 0, "num_predict": NEW},
                               messages=[{"role": "user", "content": QUESTION, "images": [b64]}])  # fmt: skip
    assert answer.message.content == expected["text"]
    shown = await client.show("tiny-vlm")
    assert "vision" in (shown.capabilities or [])


async def test_an_ollama_model_with_a_projector_layer_reads_images(
    nursery: trio.Nursery, tmp_path: Path, downloads: Path, expected: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ollama"
    lay_out(root, "registry.ollama.ai/library/tiny-vlm/latest", downloads / "tiny-smolvlm-f32.gguf",
            projector=(downloads / "mmproj-tiny-smolvlm-f32.gguf").read_bytes())  # fmt: skip
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    model = ModelStore(tmp_path / "home" / "models").import_source("ollama:tiny-vlm", progress=False)
    assert model.manifest["vision"] == "idefics3"
    assert not any("projector" in note for note in model.manifest["ollama"]["not_honoured"])
    server = await _serve(nursery, tmp_path / "home")
    answer = await ollama.AsyncClient(host=server.url).generate(
        model="tiny-vlm", prompt=QUESTION, images=[base64.b64encode(_png(1)).decode()],
        options={"temperature": 0, "num_predict": NEW},
    )
    assert answer.response == expected["text"]


def test_a_projector_that_is_not_the_models(tmp_path: Path, downloads: Path) -> None:
    other = tmp_path / "other" / "tiny-llama.gguf"
    other.parent.mkdir()
    write_tiny_gguf(other)
    projector = downloads / "mmproj-tiny-smolvlm-f32.gguf"
    store = ModelStore(tmp_path / "models")
    # named: its image tokens are missing from this vocabulary; refused, nothing stored
    with pytest.raises(ModelImportError, match=r"has no <image> token|projects onto width"):
        store.import_source(other, projector=projector, progress=False)
    assert store.list() == []
    with pytest.raises(ModelImportError, match="is llama.cpp's vision projector, not a model: .*--mmproj"):
        store.import_source(projector, progress=False)
    with pytest.raises(ModelImportError, match="--mmproj goes with a GGUF file"):
        store.import_source(downloads.parent / "text", projector=projector, progress=False)
    # merely beside it: the model is imported for text, and the import says why images are not read
    shutil.copy(projector, other.parent / projector.name)
    done = subprocess.run([sys.executable, "-m", "turbospark", "models", "import", str(other)], capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "TURBOSPARK_HOME": str(tmp_path / "h")})
    assert done.returncode == 0, done.stderr
    assert "images: not read (mmproj-tiny-smolvlm-f32.gguf" in done.stderr
    assert not (tmp_path / "h" / "models" / "tiny-llama" / "vision").exists()


@pytest.mark.parametrize(("outtype", "stored"), [("f16", "float16"), ("q8_0", "float32")])
async def test_half_and_8_bit_projector_files(
    nursery: trio.Nursery, tmp_path: Path, source: Path, downloads: Path, expected: dict[str, Any], outtype: str,
    stored: str,
) -> None:
    """The projector files users download are float16 or Q8_0: kept in float16, widened from Q8_0."""
    import mlx.core as mx

    projector = tmp_path / f"mmproj-{outtype}.gguf"
    _convert(source, projector, "--mmproj", "--outtype", outtype)
    import_into(tmp_path, downloads / "tiny-smolvlm-f32.gguf", "tiny-vlm", "--mmproj", str(projector))
    weights = mx.load(str(tmp_path / "models" / "tiny-vlm" / "vision" / "weights.safetensors"))
    assert str(weights["vision_model.encoder.layers.0.mlp.fc1.weight"].dtype) == f"mlx.core.{stored}"
    server = await _serve(nursery, tmp_path)
    b64 = base64.b64encode(_png(1)).decode()
    answer = await ollama.AsyncClient(host=server.url).generate(
        model="tiny-vlm", prompt=QUESTION, images=[b64], options={"temperature": 0, "num_predict": NEW})
    assert answer.response == expected["text"]  # the tiny model's margins are wider than their rounding
