"""Qwen2-VL's and Qwen2.5-VL's vision as a user meets it: tiny random models written by transformers
(``tests/vision_models.tiny_qwen2_vl``: a 40x48 image read as 4x6 patches, 2x3 tokens; Qwen2.5-VL's
first layer in windows of 2x2 tokens) are imported with ``turbospark models import`` and asked
about an image through the openai, anthropic and Ollama clients: the greedy text is transformers'
own ``generate``, whose RoPE places an image's tokens by row and column.  On the model thread: the
prompt's ids are the processor's; a batch of image and text requests gives each its own tokens;
layers in parts read the image as whole ones; the positions are transformers'; a prompt read with
other positions shares no KV."""

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

from turbospark.model.backend import SamplingParams  # noqa: E402
from turbospark.vision.qwen import mrope_positions, windows  # noqa: E402

from ._support import import_into  # noqa: E402
from ._support import serve_store as _serve  # noqa: E402
from .vision_models import _qwen_processor, as_qwen_repository, ask, reference_generate, run_jobs, tiny_qwen2_vl, png, rgb as _rgb  # noqa: E402

MODEL = "tiny-qwen-vl"
QUESTION = "What is in this image?"
NEW = 8
FAMILY = {"2": "qwen2_vl", "2.5": "qwen2_5_vl"}


def _png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    return png(seed, size)


@pytest.fixture(scope="module", params=["2", "2.5"], ids=["qwen2-vl", "qwen2.5-vl"])
def version(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, version: str) -> Path:
    return tiny_qwen2_vl(tmp_path_factory.mktemp("transformers") / MODEL, version=version)


@pytest.fixture(scope="module")
def store_home(tmp_path_factory: pytest.TempPathFactory, source: Path, version: str) -> Path:
    home = tmp_path_factory.mktemp("home")
    assert FAMILY[version] in import_into(home, source, MODEL, "--dtype", "float32")
    return home


def _question(images: int = 1, text: str = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(images)), {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def expected(source: Path, version: str) -> dict[str, Any]:
    name = {"2": "Qwen2VLProcessor", "2.5": "Qwen2_5_VLProcessor"}[version]
    processor = _qwen_processor(source, name)
    two = processor.apply_chat_template(_question(2), add_generation_prompt=True)
    return {
        "ids": reference_generate(source, _question(), [_rgb(_png(1))], NEW),
        "two": reference_generate(source, _question(2), [_rgb(_png(1)), _rgb(_png(2))], NEW),
        "plain": reference_generate(source, _question(0), [], NEW),
        "other": reference_generate(source, _question(), [_rgb(_png(3))], NEW),
        "prompt": processor(text=two, images=[_rgb(_png(1)), _rgb(_png(2))], return_tensors="np"),
        "decode": processor.tokenizer.decode,
    }


async def test_every_sdk_reads_the_image_as_transformers_does(
    nursery: trio.Nursery, store_home: Path, expected: dict[str, Any], version: str
) -> None:
    server = await _serve(nursery, store_home)
    b64 = base64.b64encode(_png(1)).decode()
    text = expected["decode"](expected["ids"], skip_special_tokens=True)
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    chat = await sdk.chat.completions.create(model=MODEL, max_tokens=NEW, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                                     {"type": "text", "text": QUESTION}]}])  # fmt: skip
    assert chat.choices[0].message.content == text
    # <|vision_start|>, 2x3 image tokens, <|vision_end|> among the prompt's tokens
    assert chat.usage is not None and chat.usage.prompt_tokens == 23
    claude = anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0)
    message = await claude.messages.create(model=MODEL, max_tokens=NEW, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": b64}},
                                     {"type": "text", "text": QUESTION}]}])  # fmt: skip
    assert message.content[0].text == text  # type: ignore[union-attr]
    client = ollama.AsyncClient(host=server.url)
    answer = await client.chat(model=MODEL, options={"temperature": 0, "num_predict": NEW},
                               messages=[{"role": "user", "content": QUESTION, "images": [b64]}])
    assert answer.message.content == text
    shown = await client.show(MODEL)
    assert "vision" in (shown.capabilities or [])
    server.stop.set()


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
    assert _job(backend, [_png(1), _png(2)])[0] == expected["prompt"]["input_ids"][0].tolist()
    assert _run(backend, {0: _job(backend, [_png(1)])})[0] == expected["ids"]
    mixed = _run(backend, {1: _job(backend, [_png(1), _png(2)]), 2: _job(backend, []), 3: _job(backend, [_png(3)])})
    assert (mixed[1], mixed[2], mixed[3]) == (expected["two"], expected["plain"], expected["other"])


def test_an_image_prompt_read_in_the_streams_pass_gives_the_same_tokens(store_home: Path, expected: dict[str, Any],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """While a stream decodes, an image request's prompt chunks are read in the stream's own
    forward pass, at their multimodal positions: the same tokens for both."""
    from turbospark.model.mlx_backend import MlxBackend

    backend = MlxBackend(store_home / "models" / MODEL, model_id=MODEL)  # its prefix cache empty
    monkeypatch.setattr(backend.pacer, "size", lambda decoding: 4)  # chunks of 4: several before the last
    out: dict[int, list[int]] = {30: [], 31: []}
    backend.insert(30, ask(backend, [], QUESTION)[0], SamplingParams(max_tokens=40, temperature=0.0))
    for _ in range(3):
        out[30] += backend.step().tokens.values()
    ids, seen = ask(backend, [_png(1)], QUESTION)
    backend.insert(31, ids, SamplingParams(max_tokens=NEW, temperature=0.0), images=seen)
    before = backend.vision.chunks_in_step
    for _ in range(200):
        step = backend.step()
        for seq, token in step.tokens.items():
            out[seq] += [token, *step.more.get(seq, ())]
        if len(out[30]) >= NEW and len(out[31]) >= NEW:
            break
    backend.remove(30)
    backend.remove(31)
    assert backend.vision.chunks_in_step - before >= 3
    assert (out[30][:NEW], out[31][:NEW]) == (expected["plain"], expected["ids"])


def test_layers_in_parts_read_the_image_as_whole_ones(backend: Any, expected: dict[str, Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer over more than ``PIECE_MACS`` runs as the q, k and v of groups of rows, then the
    rows' attention (within each window, for Qwen2.5-VL's) and MLP: the same greedy tokens."""
    from turbospark.vision import pieces

    backend.vision.tower.features = type(backend.vision.tower.features)()
    before = backend.vision.pieces_run
    assert _run(backend, {10: _job(backend, [_png(1)])})[10] == expected["ids"]
    assert backend.vision.pieces_run - before == 4  # the embeddings, 2 layers, the merger
    monkeypatch.setattr(pieces, "PIECE_MACS", 20_000)  # some 5 rows of 24
    backend.vision.tower.features = type(backend.vision.tower.features)()
    before = backend.vision.pieces_run
    assert _run(backend, {11: _job(backend, [_png(1)])})[11] == expected["ids"]
    assert backend.vision.pieces_run - before > 2 + 2 * 8


def test_the_positions_are_transformers_and_another_shift_shares_no_kv(
    backend: Any, source: Path, expected: dict[str, Any]
) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    ids, seen = _job(backend, [_png(1), _png(2)])
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    inputs = expected["prompt"]
    theirs, delta = model.model.get_rope_index(torch.tensor(inputs["input_ids"]),
                                               torch.tensor(inputs["mm_token_type_ids"]),
                                               image_grid_thw=torch.tensor(inputs["image_grid_thw"]))  # fmt: skip
    ours = mrope_positions(len(ids), seen.at, list(seen.prepared.grids))
    assert ours.tolist() == theirs[:, 0].tolist()
    assert (seen.positions - ours).ravel().tolist() == [-int(delta)] * ours.size  # the last is len(ids) - 1
    # a text prompt read at plain positions: the same text before an image is not its prefix
    text = _job(backend, [], QUESTION)
    _run(backend, {20: text})
    again = _job(backend, [_png(1)], asked_first=True)
    assert again[0][:9] == text[0][:9] and backend.cached_prefix(text[0]) >= 9
    assert backend.cached_prefix(again[0], images=again[1]) < 9  # (3: an earlier image prompt's, of the same shift)
    _run(backend, {21: again})
    follow = _job(backend, [_png(1)], asked_first=True)  # the same image, so the same shift: a hit past it
    assert backend.cached_prefix(follow[0], images=follow[1]) > int(follow[1].at[-1])


def _first_tokens(home: Path, name: str) -> list[int]:
    from turbospark.model.mlx_backend import MlxBackend

    backend = MlxBackend(home / "models" / name, model_id=name)
    return _run(backend, {0: _job(backend, [_png(1)])})[0]


def _mlx_vlm_greedy(directory: Path, ids: list[int]) -> list[int]:
    """mlx-vlm's own model on ``directory``, greedy, one token at a time (its RoPE's deltas its
    own), with MLX's own ``mx.fast`` functions (not the kernels' that a served model put in place)."""
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.models.cache import make_prompt_cache
    from transformers import Qwen2VLImageProcessorPil

    from turbospark.kernels import ops as kernels

    model, _ = load(str(directory))
    pixels = Qwen2VLImageProcessorPil.from_pretrained(directory)(images=[_rgb(_png(1))], return_tensors="np")
    cache = make_prompt_cache(model.language_model)
    out: list[int] = []
    with kernels.mlx_own_ops():
        logits = model(mx.array(ids)[None], pixel_values=mx.array(pixels["pixel_values"]), cache=cache,
                       image_grid_thw=mx.array(pixels["image_grid_thw"])).logits[0, -1]  # fmt: skip
        while len(out) < NEW:
            out.append(int(mx.argmax(logits)))
            logits = model.language_model(mx.array([[out[-1]]]), cache=cache).logits[0, -1]
    return out


def test_qwens_own_layout_and_mlx_communitys_load(tmp_path: Path, source: Path, backend: Any,
                                                  expected: dict[str, Any]) -> None:
    """The same model as Qwen's repositories lay it out (its language model's settings at the
    top), and as mlx-vlm converts it (mlx-community's layout): in float32, transformers' tokens;
    in 4 bits (mlx-community's usual), mlx-vlm's own greedy tokens, with x kept in float32 in the
    kernels' products and a float32 KV cache (their rounding apart, decisions 0028 and 0035)."""
    from mlx_vlm import convert

    from turbospark.kernels import ops as kernels

    ids = _job(backend, [_png(1)])[0]
    repository = as_qwen_repository(source, tmp_path / "repository")
    home = tmp_path / "home"
    convert(str(repository), mlx_path=str(tmp_path / "mlx"))
    convert(str(repository), mlx_path=str(tmp_path / "mlx-4bit"), quantize=True, q_bits=4, q_group_size=32)
    assert "float32" in import_into(home, repository, "repository", "--dtype", "float32")
    import_into(home, tmp_path / "mlx", "mlx")
    assert "native" in import_into(home, tmp_path / "mlx-4bit", "mlx-4bit")  # kept in 4 bits
    assert _first_tokens(home, "repository") == _first_tokens(home, "mlx") == expected["ids"]
    exact = kernels.native is None or not kernels.native.activations_in_8_bits()
    half = kernels.kv_half()
    try:
        if not exact:
            kernels.native.set_activations_in_8_bits(False)
        kernels.set_kv_half(False)
        assert _first_tokens(home, "mlx-4bit") == _mlx_vlm_greedy(tmp_path / "mlx-4bit", ids)
    finally:
        kernels.set_kv_half(half)
        if not exact:
            kernels.native.set_activations_in_8_bits(True)


def test_windows_are_mlx_vlms() -> None:
    """Qwen2.5-VL's windows, as mlx-vlm's tower orders them, for grids that divide and that do not."""
    import mlx.core as mx
    from mlx_vlm.models.qwen2_5_vl.config import VisionConfig
    from mlx_vlm.models.qwen2_5_vl.vision import VisionModel

    tower = VisionModel(VisionConfig(depth=1, hidden_size=8, out_hidden_size=8, intermediate_size=8, num_heads=2,
                                     patch_size=8, window_size=32))  # fmt: skip
    for rows, cols in [(2, 3), (4, 4), (3, 5), (1, 1)]:
        index, cu = tower.get_window_index(mx.array([[1, rows * 2, cols * 2]]))
        order, counts = windows(rows, cols, 2)
        bounds = sorted(set(np.asarray(cu).tolist()))
        assert order.tolist() == np.asarray(index).tolist()
        assert np.diff(bounds).tolist() == [c * 4 for c in counts]
