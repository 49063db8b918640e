"""Mistral 3's vision as a user meets it: a tiny random ``Mistral3ForConditionalGeneration`` written
by transformers (``tests/vision_models.tiny_mistral3``: a Pixtral tower reading a 40x64 image at
48x64 in 8x8 patches, merged 2x2 into 3 rows of 4 tokens) is imported with ``turbospark models
import`` and asked about an image through the openai, anthropic and Ollama clients: the greedy
text is transformers' own ``generate``.  On the model thread: the prompt's ids are what
transformers' processor writes (rows of ``[IMG]``, ``[IMG_BREAK]`` between them, ``[IMG_END]``
last); a batch of image and text requests, images of two shapes among them, gives each its own
tokens; layers in parts read the image as whole ones."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import trio

pytest.importorskip("torch")
pytest.importorskip("mlx_vlm")

import anthropic  # noqa: E402
import numpy as np  # noqa: E402
import ollama  # noqa: E402
import openai  # noqa: E402
from PIL import Image  # noqa: E402

from ._support import import_into  # noqa: E402
from ._support import serve_store as _serve  # noqa: E402
from .vision_models import _pixtral_inputs, ask, reference_generate, run_jobs, tiny_mistral3, png, rgb as _rgb  # noqa: E402

MODEL = "tiny-mistral3"
QUESTION = "What is in this image?"
NEW = 8
WIDE, TALL = (40, 64), (64, 40)  # (height, width)


def _png(seed: int, size: tuple[int, int] = WIDE) -> bytes:
    return png(seed, size)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_mistral3(tmp_path_factory.mktemp("transformers") / MODEL)


@pytest.fixture(scope="module")
def store_home(tmp_path_factory: pytest.TempPathFactory, source: Path) -> Path:
    home = tmp_path_factory.mktemp("home")
    assert "mistral3" in import_into(home, source, MODEL, "--dtype", "float32")
    return home


def _question(images: int = 1) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(images)), {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def expected(source: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    two = [_rgb(_png(1)), _rgb(_png(2, TALL))]
    return {
        "ids": reference_generate(source, _question(), [_rgb(_png(1))], NEW),
        "two": reference_generate(source, _question(2), two, NEW),
        "plain": reference_generate(source, _question(0), [], NEW),
        "other": reference_generate(source, _question(), [_rgb(_png(3))], NEW),
        "prompt": _pixtral_inputs(source, _question(2), two)["input_ids"][0].tolist(),
        "decode": AutoTokenizer.from_pretrained(source).decode,
    }


async def test_every_sdk_reads_the_image_as_transformers_does(
    nursery: trio.Nursery, store_home: Path, expected: dict[str, Any]
) -> None:
    server = await _serve(nursery, store_home)
    b64 = base64.b64encode(_png(1)).decode()
    text = expected["decode"](expected["ids"], skip_special_tokens=True)
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    chat = await sdk.chat.completions.create(model=MODEL, max_tokens=NEW, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                                     {"type": "text", "text": QUESTION}]}])  # fmt: skip
    assert chat.choices[0].message.content == text
    assert chat.usage is not None and chat.usage.prompt_tokens == 24  # 12 image tokens, 2 breaks, the end
    claude = anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0)
    message = await claude.messages.create(model=MODEL, max_tokens=NEW, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": b64}},
                                     {"type": "text", "text": QUESTION}]}])  # fmt: skip
    assert message.content[0].text == text  # type: ignore[union-attr]
    counted = await claude.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": b64}},
                                     {"type": "text", "text": QUESTION}]}])  # fmt: skip
    assert counted.input_tokens == 24
    client = ollama.AsyncClient(host=server.url)
    answer = await client.chat(model=MODEL, options={"temperature": 0, "num_predict": NEW},
                               messages=[{"role": "user", "content": QUESTION, "images": [b64]}])
    assert answer.message.content == text
    assert "vision" in ((await client.show(MODEL)).capabilities or [])
    server.stop.set()


@pytest.fixture(scope="module")
def backend(store_home: Path) -> Any:
    from turbospark.model.mlx_backend import MlxBackend

    return MlxBackend(store_home / "models" / MODEL, model_id=MODEL)


def test_the_prompt_is_the_processors_and_a_batch_gives_each_its_own_tokens(
    backend: Any, expected: dict[str, Any]
) -> None:
    assert ask(backend, [_png(1), _png(2, TALL)], QUESTION)[0] == expected["prompt"]
    assert run_jobs(backend, {0: ask(backend, [_png(1)], QUESTION)}, NEW)[0] == expected["ids"]
    mixed = run_jobs(backend, {1: ask(backend, [_png(1), _png(2, TALL)], QUESTION), 2: ask(backend, [], QUESTION),
                               3: ask(backend, [_png(3)], QUESTION)}, NEW)  # fmt: skip
    assert (mixed[1], mixed[2], mixed[3]) == (expected["two"], expected["plain"], expected["other"])


def test_layers_in_parts_read_the_image_as_whole_ones(backend: Any, expected: dict[str, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer over more than ``PIECE_MACS`` runs as the q, k and v of groups of its 48 patches,
    then groups' attention and MLP: the same greedy tokens, in more pieces."""
    from turbospark.vision import pieces

    backend.vision.tower.features = type(backend.vision.tower.features)()
    before = backend.vision.pieces_run
    assert run_jobs(backend, {10: ask(backend, [_png(1)], QUESTION)}, NEW)[10] == expected["ids"]
    assert backend.vision.pieces_run - before == 4  # the embeddings, 2 layers, the projector
    monkeypatch.setattr(pieces, "PIECE_MACS", 40_000)
    backend.vision.tower.features = type(backend.vision.tower.features)()
    before = backend.vision.pieces_run
    assert run_jobs(backend, {11: ask(backend, [_png(1)], QUESTION)}, NEW)[11] == expected["ids"]
    assert backend.vision.pieces_run - before > 2 + 2 * 4


def test_mlx_communitys_layout_loads(tmp_path: Path, source: Path, expected: dict[str, Any]) -> None:
    """The same model as mlx-vlm converts it (mlx-community's layout: its names, the patch
    convolution's weight laid out for MLX, the processor's config nested): transformers' tokens."""
    from mlx_vlm import convert

    from turbospark.model.mlx_backend import MlxBackend

    convert(str(source), mlx_path=str(tmp_path / "mlx"))
    assert "mistral3" in import_into(tmp_path / "home", tmp_path / "mlx", "mlx")
    backend = MlxBackend(tmp_path / "home" / "models" / "mlx", model_id="mlx")
    assert run_jobs(backend, {0: ask(backend, [_png(1)], QUESTION)}, NEW)[0] == expected["ids"]
