"""Gemma 3's vision as a user meets it: a tiny random ``Gemma3ForConditionalGeneration`` written by
transformers (``tests/vision_models.py``: sliding windows of 8 on three layers of four, an image
read into 4 tokens) is imported with ``turbospark models import`` and asked about an image through
the openai, anthropic and Ollama clients: the greedy text is transformers' own ``generate``, whose
image tokens attend to each other both ways while the prompt is read.  On the model thread: the
prompt's ids are the processor's; a batch of image and text requests gives each its own tokens;
a prompt chunk never cuts an image's tokens apart, whatever the chunk size."""

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

from turbospark.model.mlx_vision import Seen  # noqa: E402
from turbospark.vision.tower import Prepared  # noqa: E402

from ._support import import_into  # noqa: E402
from ._support import serve_store as _serve  # noqa: E402
from .vision_models import ask, reference_generate, run_jobs, tiny_gemma3, png, rgb as _rgb  # noqa: E402

MODEL = "tiny-gemma3"
QUESTION = "What is in this image?"
NEW = 8


def _png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    return png(seed, size)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma3(tmp_path_factory.mktemp("transformers") / "tiny-gemma3")


@pytest.fixture(scope="module")
def store_home(tmp_path_factory: pytest.TempPathFactory, source: Path) -> Path:
    home = tmp_path_factory.mktemp("home")
    assert "gemma3" in import_into(home, source, MODEL, "--dtype", "float32")
    return home


def _question(images: int = 1, text: str = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def expected(source: Path) -> dict[str, Any]:
    from transformers import Gemma3Processor

    processor = Gemma3Processor.from_pretrained(source)
    two = processor.apply_chat_template(_question(2), add_generation_prompt=True)
    return {
        "ids": reference_generate(source, _question(), [_rgb(_png(1))], NEW),
        "plain": reference_generate(source, _question(0), [], NEW),
        "other": reference_generate(source, _question(), [_rgb(_png(3))], NEW),
        "prompt": processor(text=two, images=[[_rgb(_png(1)), _rgb(_png(2))]], return_tensors="np")["input_ids"][0].tolist(),
        "decode": processor.tokenizer.decode,
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
    assert chat.usage is not None and chat.usage.prompt_tokens == 23  # <start_of_image>, 4 image tokens, <end_of_image>
    claude = anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0)
    message = await claude.messages.create(model=MODEL, max_tokens=NEW, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": b64}},
                                     {"type": "text", "text": QUESTION}]}])  # fmt: skip
    assert message.content[0].text == text  # type: ignore[union-attr]
    answer = await ollama.AsyncClient(host=server.url).chat(
        model=MODEL, options={"temperature": 0, "num_predict": NEW},
        messages=[{"role": "user", "content": QUESTION, "images": [b64]}])
    assert answer.message.content == text
    models = await sdk.models.list()
    assert any(m.id == MODEL for m in models.data)


@pytest.fixture(scope="module")
def backend(store_home: Path) -> Any:
    from turbospark.model.mlx_backend import MlxBackend

    return MlxBackend(store_home / "models" / MODEL, model_id=MODEL)


def _job(backend: Any, images: list[bytes], question: str = QUESTION, *, asked_first: bool = False
         ) -> tuple[list[int], Any]:
    return ask(backend, images, question, asked_first=asked_first)


def _run(backend: Any, jobs: dict[int, tuple[list[int], Any]]) -> dict[int, list[int]]:
    return run_jobs(backend, jobs, NEW)


def test_the_prompt_is_the_processors_and_a_batch_gives_each_its_own_tokens(
    backend: Any, expected: dict[str, Any]
) -> None:
    assert _job(backend, [_png(1), _png(2)])[0] == expected["prompt"]
    assert _run(backend, {0: _job(backend, [_png(1)])})[0] == expected["ids"]
    mixed = _run(backend, {1: _job(backend, [_png(1)]), 2: _job(backend, []), 3: _job(backend, [_png(3)])})
    assert (mixed[1], mixed[2], mixed[3]) == (expected["ids"], expected["plain"], expected["other"])


def test_a_prompt_chunk_never_cuts_an_image_apart(store_home: Path, expected: dict[str, Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 2 tokens: each chunk that would end inside an image's 4 tokens runs to its end."""
    from turbospark.model.mlx_backend import MlxBackend

    backend = MlxBackend(store_home / "models" / MODEL, model_id=MODEL)  # its prefix cache empty
    ids, seen = _job(backend, [_png(1)])
    advance, cuts = backend.vision.advance, []
    monkeypatch.setattr(backend.vision, "advance", lambda chunk, fuse=False: (
        cuts.append(backend.vision.reading[4].at) if 4 in backend.vision.reading else None, advance(2, fuse=fuse))[1])
    assert _run(backend, {4: (ids, seen)})[4] == expected["ids"]
    image = seen.at.tolist()  # the chunks began at 0, 2, 4, then past the image's 4 tokens at 5-8
    assert image == [5, 6, 7, 8] and sorted(set(cuts))[:5] == [0, 2, 4, 9, 11]


def test_where_an_image_is_in_a_prompt() -> None:
    """``images_at``: each position's image; ``past_image``: a chunk's end moved past an image's
    last token when it would cut that image apart."""
    prepared = Prepared(("<b><s><s><s><e>", "<b><s><s><e>"), ("a" * 64, "b" * 64), (), {})
    seen = Seen(prepared, "<b>", "<s>", 9)
    seen.at = np.array([3, 4, 5, 10, 11])  # image 0 at 3-5, image 1 at 10-11
    assert seen.images_at(2, 12).tolist() == [-1, 0, 0, 0, -1, -1, -1, -1, 1, 1]
    assert seen.images_at(4, 11).tolist() == [0, 0, -1, -1, -1, -1, 1]
    assert [seen.past_image(end) for end in (3, 4, 5, 6, 10, 11, 12)] == [3, 6, 6, 6, 10, 12, 12]
