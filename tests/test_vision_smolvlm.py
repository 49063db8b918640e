"""SmolVLM2's vision without torch: a tiny random ``SmolVLMForConditionalGeneration`` saved as SmolVLM2's
repositories hold it (``tests/vision_models.tiny_smolvlm2``: ``model_type`` ``smolvlm``, its
processor ``SmolVLMProcessor`` with a ``SmolVLMVideoProcessor``, whose class needs torch and
torchvision) is read with the image processor and the tokenizer alone.  The prompt's ids and the
pixels are transformers' ``SmolVLMProcessor``'s; imported and served by ``python -m turbospark``
in a process where torch and torchvision cannot be imported, it answers an image through the
openai, anthropic and Ollama clients with transformers' own greedy text, the image's tokens
counted; on the model thread a batch of image and text requests gives each transformers' tokens."""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("mlx_vlm")

import anthropic  # noqa: E402
import numpy as np  # noqa: E402
import ollama  # noqa: E402
import openai  # noqa: E402
from PIL import Image  # noqa: E402

from ._support import import_into  # noqa: E402
from .vision_models import _smolvlm_processor, ask, reference_generate, run_jobs, tiny_smolvlm2, png as _png, rgb as _rgb  # noqa: E402

MODEL = "tiny-smolvlm2"
QUESTION = "What is in this image?"
NEW = 8
#: a ``sitecustomize`` that makes torch and torchvision not installed, as on a machine without them:
#: ``import torch`` fails and ``importlib.util.find_spec("torch")`` is None
WITHOUT_TORCH = '''import sys
from importlib.machinery import PathFinder


class _Without(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "torchvision"):
            return None
        return PathFinder.find_spec(name, path, target)


sys.meta_path[:] = [_Without if f is PathFinder else f for f in sys.meta_path]
'''


def _question(images: int = 1) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(images)), {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_smolvlm2(tmp_path_factory.mktemp("transformers") / MODEL)


@pytest.fixture(scope="module")
def expected(source: Path) -> dict[str, Any]:
    processor = _smolvlm_processor(source)
    ids = reference_generate(source, _question(), [_rgb(_png(1))], NEW)
    one = processor.tokenizer.apply_chat_template(_question(), add_generation_prompt=True, tokenize=False)
    return {
        "ids": ids,
        "text": processor.tokenizer.decode(ids, skip_special_tokens=True),
        "prompt_tokens": len(processor(text=one, images=[_rgb(_png(1))], return_tensors="np")["input_ids"][0]),
        "two": reference_generate(source, _question(2), [_rgb(_png(1)), _rgb(_png(2, (16, 40)))], NEW),
        "plain": reference_generate(source, _question(0), [], NEW),
    }


def _reference_inputs(directory: Path, images: list[Image.Image]) -> Any:
    processor = _smolvlm_processor(directory)
    text = processor.tokenizer.apply_chat_template(_question(len(images)), add_generation_prompt=True, tokenize=False)
    return processor(text=text, images=images, return_tensors="np")


@pytest.mark.parametrize("nested", [False, True], ids=["as-smolvlm2-ships", "as-transformers-5-saves"])
def test_the_processor_without_video_gives_smolvlm_processors_ids_and_pixels(
    tmp_path: Path, source: Path, nested: bool
) -> None:
    from turbospark.vision.smolvlm import SmolVLMProcessor

    directory = tiny_smolvlm2(tmp_path / MODEL, nested=True) if nested else source
    images = [_rgb(_png(1)), _rgb(_png(2, (16, 40))), _rgb(_png(3, (40, 16)))]  # tiles 2x2, 1x2, 2x1
    reference = _reference_inputs(directory, images)
    processor = SmolVLMProcessor(directory)
    inputs, replacements = processor.process(images)
    text = processor.tokenizer.apply_chat_template(_question(3), add_generation_prompt=True, tokenize=False)
    parts = text.split(processor.image_token)
    expanded = parts[0] + "".join(r + rest for r, rest in zip(replacements, parts[1:], strict=True))
    ids = processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    assert ids == reference["input_ids"][0].tolist()
    assert (inputs["rows"], inputs["cols"]) == ([[2, 1, 2]], [[2, 2, 1]])
    np.testing.assert_array_equal(inputs["pixel_values"], reference["pixel_values"])
    np.testing.assert_array_equal(inputs["pixel_attention_mask"], reference["pixel_attention_mask"])
    assert processor.image_seq_len == 4 and ids.count(processor.image_token_id) == 4 * (5 + 3 + 3)


@pytest.fixture(scope="module")
def without_torch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a process where torch and torchvision cannot be imported."""
    blocker = tmp_path_factory.mktemp("without-torch")
    (blocker / "sitecustomize.py").write_text(WITHOUT_TORCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(blocker), os.environ.get("PYTHONPATH")) if p)}
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util, transformers\n"
                               "from transformers.utils import is_torch_available, is_torchvision_available\n"
                               "print(importlib.util.find_spec('torch'), is_torch_available(), is_torchvision_available())\n"
                               "import torch"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert probe.stdout.split() == ["None", "False", "False"], probe.stdout + probe.stderr
    assert "ModuleNotFoundError: No module named 'torch'" in probe.stderr
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, source: Path, without_torch: dict[str, str]) -> Iterator[str]:
    """``models import`` and ``serve`` of the SmolVLM2 directory, as a user runs them, without torch."""
    home = tmp_path_factory.mktemp("home")
    env = {**without_torch, "TURBOSPARK_HOME": str(home)}
    done = subprocess.run(
        [sys.executable, "-m", "turbospark", "models", "import", str(source), "--name", MODEL, "--dtype", "float32"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "smolvlm" in done.stdout, done.stdout + done.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "turbospark", "serve", "--port", "0", "--model", MODEL, "--embedding-model", "none",
         "--stt-model", "none", "--tts-model", "none", "--image-model", "none"],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    seen, url, deadline = [], None, time.monotonic() + 180
    for line in proc.stderr:
        seen.append(line)
        if m := re.match(r"turbospark listening on (http://\S+)", line):
            url = m.group(1)
            break
        if time.monotonic() > deadline:
            break
    try:
        assert url is not None, "".join(seen)
        maps = Path(f"/proc/{proc.pid}/maps")
        if maps.exists():  # no torch library in the server's memory
            assert "libtorch" not in maps.read_text()
        yield url
    finally:
        proc.kill()
        proc.wait()


def test_served_without_torch_every_sdk_reads_the_image_as_transformers_does(
    server: str, expected: dict[str, Any]
) -> None:
    data = _png(1)
    b64 = base64.b64encode(data).decode()
    prompt_tokens = expected["prompt_tokens"]
    assert prompt_tokens == 14 + 5 * 4 + 13  # the text, 5 tiles' image tokens, their tags

    sdk = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    chat = sdk.chat.completions.create(model=MODEL, max_tokens=NEW, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                                     {"type": "text", "text": QUESTION}]}])  # fmt: skip
    assert chat.choices[0].message.content == expected["text"]
    assert chat.usage is not None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (prompt_tokens, NEW)

    claude = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
               {"type": "text", "text": QUESTION}]  # fmt: skip
    message = claude.messages.create(model=MODEL, max_tokens=NEW, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": content}])  # type: ignore[list-item]
    assert message.content[0].text == expected["text"]  # type: ignore[union-attr]
    usage = message.usage  # the same prompt again: all but its last token read from the prefix cache
    read = (usage.input_tokens, usage.cache_read_input_tokens or 0, usage.cache_creation_input_tokens or 0)
    assert (sum(read), usage.output_tokens) == (prompt_tokens, NEW)
    counted = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": content}])  # type: ignore[list-item]
    assert counted.input_tokens == prompt_tokens

    client = ollama.Client(host=server)
    answer = client.chat(model=MODEL, options={"temperature": 0, "num_predict": NEW},
                         messages=[{"role": "user", "content": QUESTION, "images": [data]}])
    assert answer.message.content == expected["text"]
    assert (answer.prompt_eval_count, answer.eval_count) == (prompt_tokens, NEW)
    assert "vision" in (client.show(MODEL).capabilities or [])


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory, source: Path) -> Any:
    from turbospark.model.mlx_backend import MlxBackend

    home = tmp_path_factory.mktemp("home")
    assert "smolvlm" in import_into(home, source, MODEL, "--dtype", "float32")
    return MlxBackend(home / "models" / MODEL, model_id=MODEL)


def test_a_batch_of_image_and_text_requests_gives_each_transformers_tokens(
    backend: Any, source: Path, expected: dict[str, Any]
) -> None:
    two = [_png(1), _png(2, (16, 40))]
    assert ask(backend, two, QUESTION)[0] == _reference_inputs(source, [_rgb(d) for d in two])["input_ids"][0].tolist()
    assert run_jobs(backend, {0: ask(backend, [_png(1)], QUESTION)}, NEW)[0] == expected["ids"]
    mixed = run_jobs(backend, {1: ask(backend, two, QUESTION), 2: ask(backend, [], QUESTION)}, NEW)
    assert (mixed[1], mixed[2]) == (expected["two"], expected["plain"])
