"""Vision as a new user meets it: a tiny random Idefics3 model (and a LLaVA one) written by transformers is imported
with ``turbospark models import``, served from the store, and asked about an image through the
openai SDK (chat and Responses), the anthropic SDK and the Ollama client: the greedy text is
transformers' own ``generate`` on the same image and prompt.  ``/v1/models`` and ``/api/show``
list ``vision``; a bad image (not an image, truncated, too large) is a 400 naming the part, in
each family's shape.  On the model thread (``MlxBackend`` directly): the prompt's ids are the
processor's; image and text requests decode in one batch as each does alone; a request dropped
while its image is encoded stops within one piece; the prefix cache tells images apart."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

pytest.importorskip("torch")
pytest.importorskip("mlx_vlm")

import anthropic  # noqa: E402
import numpy as np  # noqa: E402
import ollama  # noqa: E402
import openai  # noqa: E402
from PIL import Image  # noqa: E402

from turbospark.messages import ChatPrompt  # noqa: E402
from turbospark.model.backend import SamplingParams  # noqa: E402
from turbospark.store.gguf_import import ModelImportError  # noqa: E402
from turbospark.store.store import ModelStore  # noqa: E402
from turbospark.threads.prompt import render_prompt  # noqa: E402

from ._support import import_into  # noqa: E402
from ._support import serve_store as _serve  # noqa: E402
from .vision_models import reference_generate, tiny_idefics3, tiny_llava, png as _png, rgb as _rgb  # noqa: E402

MODEL = "tiny-vlm"
QUESTION = "What is in this image?"
NEW = 8


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Idefics3 directory, as transformers writes it."""
    return tiny_idefics3(tmp_path_factory.mktemp("transformers") / "tiny-idefics3")


@pytest.fixture(scope="module")
def store_home(tmp_path_factory: pytest.TempPathFactory, source: Path) -> Path:
    """A store holding the tiny model, imported the way a user imports one."""
    home = tmp_path_factory.mktemp("home")
    out = import_into(home, source, MODEL, "--dtype", "float32")
    assert MODEL in out and "idefics3" in out
    return home


@pytest.fixture(scope="module")
def expected(source: Path) -> dict[str, Any]:
    """transformers' greedy tokens and text for the question about image 1, and without an image."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(source)
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    ids = reference_generate(source, image, [_rgb(_png(1))], NEW)
    text = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    plain = reference_generate(source, text, [], NEW)
    return {"ids": ids, "text": tok.decode(ids, skip_special_tokens=True),
            "plain_ids": plain, "plain": tok.decode(plain, skip_special_tokens=True)}


async def test_every_sdk_reads_the_image_as_transformers_does(
    nursery: trio.Nursery, store_home: Path, expected: dict[str, Any]
) -> None:
    server = await _serve(nursery, store_home)
    data = _png(1)
    b64 = base64.b64encode(data).decode()
    url = f"data:image/png;base64,{b64}"
    try:
        sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        chat = await sdk.chat.completions.create(model=MODEL, max_tokens=NEW, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}])  # fmt: skip
        assert chat.choices[0].message.content == expected["text"]
        assert chat.usage is not None and chat.usage.prompt_tokens == 14 + 5 * 4 + 13  # text, 5 tiles' tokens, tags
        plain = await sdk.chat.completions.create(model=MODEL, max_tokens=NEW, temperature=0,
                                                  messages=[{"role": "user", "content": QUESTION}])
        assert plain.choices[0].message.content == expected["plain"]

        responses = await sdk.responses.create(model=MODEL, max_output_tokens=NEW, temperature=0, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                         {"type": "input_text", "text": QUESTION}]}])  # fmt: skip
        assert responses.output_text == expected["text"]

        claude = anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0)
        message = await claude.messages.create(model=MODEL, max_tokens=NEW, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                       "data": b64}},
                                         {"type": "text", "text": QUESTION}]}])  # fmt: skip
        assert message.content[0].text == expected["text"]  # type: ignore[union-attr]
        counted = await claude.messages.count_tokens(model=MODEL, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                       "data": b64}},
                                         {"type": "text", "text": QUESTION}]}])  # fmt: skip
        assert counted.input_tokens == chat.usage.prompt_tokens  # its image's tokens included

        client = ollama.AsyncClient(host=server.url)
        answer = await client.chat(model=MODEL, options={"temperature": 0, "num_predict": NEW},
                                   messages=[{"role": "user", "content": QUESTION, "images": [data]}])
        assert answer.message.content == expected["text"]
        generated = await client.generate(model=MODEL, prompt=QUESTION, images=[data],
                                          options={"temperature": 0, "num_predict": NEW})
        assert generated.response == expected["text"]

        shown = await client.show(MODEL)
        assert "vision" in (shown.capabilities or [])
        async with httpx.AsyncClient() as h:
            row = (await h.get(f"{server.url}/v1/models/{MODEL}")).json()
            assert "vision" in row["capabilities"] and row["architecture"] == "idefics3"
            tags = (await h.get(f"{server.url}/api/tags")).json()["models"]
            assert any(t["name"].startswith(MODEL) and "vision" in t.get("capabilities", ["vision"]) for t in tags)
    finally:
        server.stop.set()


async def test_a_bad_image_is_a_400_naming_the_part_in_each_family(nursery: trio.Nursery, store_home: Path) -> None:
    server = await _serve(nursery, store_home)
    not_png = "data:image/png;base64," + base64.b64encode(b"hello, not an image").decode()
    try:
        async with httpx.AsyncClient(timeout=60) as h:
            r = await h.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": not_png}}]}]})  # fmt: skip
            assert r.status_code == 400
            assert r.json()["error"]["message"].startswith("messages[1] image 1: the data is not an image")
            r = await h.post(f"{server.url}/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                           "data": "!!"}}]}]})  # fmt: skip
            assert r.status_code == 400 and r.json()["type"] == "error"
            assert "messages[0] image 1: the image is not valid base64" in r.json()["error"]["message"]
            r = await h.post(f"{server.url}/api/chat", json={"model": MODEL, "stream": False, "messages": [
                {"role": "user", "content": "x", "images": [base64.b64encode(b"GIF89a..").decode()]}]})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"].startswith("messages[0] image 1:")
            big = Image.new("RGB", (8000, 7000))
            out = io.BytesIO()
            big.save(out, format="PNG")
            r = await h.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {
                    "url": "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()}}]}]})  # fmt: skip
            assert r.status_code == 400 and "8000x7000 pixels" in r.json()["error"]["message"]
            # the server keeps serving
            ok = await h.post(f"{server.url}/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        server.stop.set()


async def test_a_truncated_or_too_large_image_is_a_400_naming_the_part_in_each_family(
    nursery: trio.Nursery, store_home: Path
) -> None:
    """A PNG's signature and header (its size known) and a scrap of its pixel data is refused as
    truncated when the request is read, whichever family carries it; a decompression bomb (50.4
    million 1-bit pixels in a few kilobytes) as too large, counted from its header."""
    server = await _serve(nursery, store_home)
    whole = _png(1)
    cut = base64.b64encode(whole[:60]).decode()
    url = f"data:image/png;base64,{cut}"
    bomb = io.BytesIO()
    Image.new("1", (7100, 7100)).save(bomb, format="PNG")
    assert len(bomb.getvalue()) < 10_000
    truncated = "the image could not be decoded; the file is truncated or corrupt"
    try:
        async with httpx.AsyncClient(timeout=60) as h:
            r = await h.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]}]})  # fmt: skip
            assert r.status_code == 400 and list(r.json()) == ["error"]
            assert (r.json()["error"]["type"], r.json()["error"]["param"]) == ("invalid_request_error", "messages")
            assert r.json()["error"]["message"].startswith(f"messages[1] image 1: {truncated}")
            r = await h.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": url}]}]})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"input[0] image 1: {truncated}")
            r = await h.post(f"{server.url}/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                           "data": cut}}]}]})  # fmt: skip
            assert r.status_code == 400 and r.json()["type"] == "error"
            assert r.json()["error"]["message"].startswith(f"messages[0] image 1: {truncated}")
            r = await h.post(f"{server.url}/api/chat", json={"model": MODEL, "stream": False, "messages": [
                {"role": "user", "content": "x", "images": [cut]}]})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"].startswith(f"messages[0] image 1: {truncated}")

            r = await h.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {
                    "url": "data:image/png;base64," + base64.b64encode(bomb.getvalue()).decode()}}]}]})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["message"] == (
                "messages[0] image 1: the image is too large: 7100x7100 pixels, 50,410,000 in all, "
                "over the 50,000,000 an image may have")  # fmt: skip
            # the server keeps serving, images included
            ok = await h.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {
                    "url": "data:image/png;base64," + base64.b64encode(whole).decode()}}]}]})  # fmt: skip
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        server.stop.set()


# --- on the model thread ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(store_home: Path) -> Any:
    from turbospark.model.mlx_backend import MlxBackend

    return MlxBackend(store_home / "models" / MODEL, model_id=MODEL)


def _job(backend: Any, images: list[bytes], question: str = QUESTION) -> tuple[list[int], Any]:
    content = [{"type": "image", "data": d} for d in images] + [{"type": "text", "text": question}]
    prompt = ChatPrompt(({"role": "user", "content": content},))
    assert prompt.images == tuple(images)
    seen = backend.vision.see(list(images)) if images else None
    ids, _ = render_prompt(backend.tokenizer, prompt, expand=seen.expand if seen else str)
    if seen is not None:
        seen.keyed(ids)
    return ids, seen


def _run(backend: Any, jobs: dict[int, tuple[list[int], Any]], steps: int = 200) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {seq: [] for seq in jobs}
    for seq, (ids, seen) in jobs.items():
        backend.insert(seq, ids, SamplingParams(max_tokens=NEW, temperature=0.0), images=seen)
    for _ in range(steps):
        step = backend.step()
        for seq, token in step.tokens.items():
            out[seq] += [token, *step.more.get(seq, ())]
        for seq in [s for s, t in out.items() if len(t) >= NEW]:
            if seq in jobs:
                backend.remove(seq)
                del jobs[seq]
        if not jobs:
            break
    return {seq: tokens[:NEW] for seq, tokens in out.items()}


def test_the_prompt_is_the_processors_and_a_batch_gives_each_its_own_tokens(
    backend: Any, source: Path, expected: dict[str, Any]
) -> None:
    import transformers

    processor = transformers.Idefics3Processor.from_pretrained(source)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    two = [_png(1), _png(2, (30, 20))]
    theirs = processor(text=text, images=[[_rgb(d) for d in two]], return_tensors="np")["input_ids"][0].tolist()
    ours, _ = _job(backend, two)
    assert ours == theirs

    alone = _run(backend, {0: _job(backend, [_png(1)])})[0]
    assert alone == expected["ids"]
    mixed = _run(backend, {1: _job(backend, [_png(1)]), 2: _job(backend, []), 3: _job(backend, [_png(3)]),
                           4: _job(backend, [_png(1)], "Describe it.")})
    assert mixed[1] == expected["ids"] and mixed[2] == expected["plain_ids"]
    assert _run(backend, {5: _job(backend, [_png(3)])})[5] == mixed[3]


def test_a_request_dropped_while_its_image_is_encoded_stops_within_a_piece(backend: Any) -> None:
    backend.vision.tower.features = type(backend.vision.tower.features)()  # nothing cached
    before = backend.vision.pieces_run
    ids, seen = _job(backend, [_png(11), _png(12)])  # 5 tiles each
    backend.insert(7, ids, SamplingParams(max_tokens=NEW, temperature=0.0), images=seen)
    progress = backend.step().progress
    assert backend.vision.pieces_run == before + 1  # a tile's embeddings, no prompt token yet
    assert progress[7].done == progress[7].cached <= ids.index(seen.token_id) and progress[7].total == len(ids)
    backend.remove(7)
    for _ in range(3):
        assert backend.step().tokens == {}
    assert backend.vision.pieces_run == before + 1 and not backend.vision.reading


def test_a_layer_in_parts_reads_the_image_as_the_whole_layer(backend: Any, expected: dict[str, Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer over more than ``PIECE_MACS`` runs as its keys and values, then its tokens in
    groups: the same features to the bit (the same greedy tokens), in more pieces."""
    from turbospark.vision import pieces

    backend.vision.tower.features = type(backend.vision.tower.features)()
    before = backend.vision.pieces_run
    assert _run(backend, {10: _job(backend, [_png(1)])})[10] == expected["ids"]
    whole = backend.vision.pieces_run - before  # 5 tiles: embeddings, 2 layers, projector
    monkeypatch.setattr(pieces, "PIECE_MACS", 5 * 2 * (32 * 32 + 16 * 32 + 32 * 64))  # 5 of a tile's 16 tokens
    backend.vision.tower.features = type(backend.vision.tower.features)()
    before = backend.vision.pieces_run
    assert _run(backend, {11: _job(backend, [_png(1)])})[11] == expected["ids"]
    assert (whole, backend.vision.pieces_run - before) == (5 * 4, 5 * (2 + 2 * (1 + 4)))  # groups of 5, 5, 5, 1


def test_the_prefix_cache_tells_images_apart(backend: Any) -> None:
    first = _job(backend, [_png(21)])
    _run(backend, {8: first})
    first_image = first[0].index(backend.vision.tower.feature_token_id)
    same = _job(backend, [_png(21)])
    assert backend.cached_prefix(same[0], images=same[1]) > first_image + 20  # past the image
    other = _job(backend, [_png(22)])
    assert other[0] == same[0]  # the same ids: only the image differs
    assert backend.cached_prefix(other[0], images=other[1]) <= first_image
    before = backend.vision.pieces_run
    _run(backend, {9: same})
    assert backend.vision.pieces_run == before  # its features were kept by the image's hash


def test_an_unsupported_vision_family_is_refused_by_name(tmp_path: Path) -> None:
    src = tmp_path / "mllama"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "mllama", "vision_config": {}, "text_config": {}}))
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (src / name).write_text("{}")
    store = ModelStore(tmp_path / "models")
    with pytest.raises(ModelImportError, match="vision-language architecture 'mllama' is not supported"):
        store.import_source(src, progress=False)


async def test_the_playground_sends_picked_pasted_and_dropped_images_and_shows_them(
    nursery: trio.Nursery, store_home: Path, expected: dict[str, Any], tmp_path: Path
) -> None:
    from ._browser import browse, shot

    picked = tmp_path / "picked.png"
    picked.write_bytes(_png(1))
    more = base64.b64encode(_png(3)).decode()
    server = await _serve(nursery, store_home)

    def drive(page):  # type: ignore[no-untyped-def]
        page.goto(server.url)
        conv = page.locator('[data-conversation="1"]')
        conv.locator(f".model option[value={MODEL}]").wait_for(state="attached")
        conv.locator(".settings summary").click()
        conv.locator(".model").select_option(MODEL)
        conv.locator(".temperature").fill("0")
        conv.locator(".max-tokens").fill(str(NEW))
        conv.locator(".attach").set_input_files(str(picked))  # the file picker
        conv.locator(".attached img").wait_for()
        conv.locator(".input").fill(QUESTION)
        conv.locator(".send").click()
        answer = conv.locator("li.assistant[data-state=done]")
        answer.wait_for()
        first = (answer.locator(".content").inner_text(), conv.locator("li.user img").count(),
                 conv.locator(".attached img").count())
        # a pasted image and a dropped one, then one of them removed before sending
        page.evaluate("""([b64, target]) => {
            const file = (name) => new File([Uint8Array.from(atob(b64), (c) => c.charCodeAt(0))], name, { type: "image/png" });
            const pasted = new DataTransfer(); pasted.items.add(file("pasted.png"));
            document.querySelector(`${target} .input`).dispatchEvent(
                new ClipboardEvent("paste", { clipboardData: pasted, bubbles: true, cancelable: true }));
            const dropped = new DataTransfer(); dropped.items.add(file("dropped.png")); dropped.items.add(file("second.png"));
            document.querySelector(target).dispatchEvent(new DragEvent("drop", { dataTransfer: dropped, bubbles: true, cancelable: true }));
        }""", [more, '[data-conversation="1"]'])
        page.wait_for_function("() => document.querySelectorAll('[data-conversation=\"1\"] .attached img').length === 3")
        conv.locator('.attached button[aria-label="Remove second.png"]').click()
        conv.locator(".input").fill("And these?")
        conv.locator(".send").click()
        conv.locator("li.assistant[data-state=done]").nth(1).wait_for()
        shot(page, "playground-vision")
        second = conv.locator("li.user").nth(1).locator("img").count()
        return first, second

    try:
        (text, shown, left), second = await browse(server.url, drive)
    finally:
        server.stop.set()
    assert text == expected["text"]  # the page sent the image as the SDKs do
    assert shown == 1 and left == 0 and second == 2


def test_ropes_settings_are_written_where_mlx_lm_reads_them() -> None:
    from turbospark.store.hf_import import legacy_rope

    config = {"text_config": {"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}},
              "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}
    out = legacy_rope(config)
    assert out["text_config"]["rope_theta"] == 1e5 and "rope_scaling" not in out["text_config"]
    assert out["rope_theta"] == 5e5 and out["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0}
    assert legacy_rope({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 2e4}})["rope_theta"] == 1e4


async def test_a_client_that_hangs_up_while_its_images_are_read_stops_them(start_server, store_home: Path) -> None:
    """Over a raw socket on a real Hypercorn: the request's 40 images (200 tiles, 800 pieces) are
    read a piece a step; the client leaves during them; the job ends in phase prefill within a piece, its prompt
    never read, and the model serves the next request."""
    from turbospark.actors.lifecycle import Loadable
    from turbospark.model.mlx_backend import MlxBackend

    from ._support import raw_post, wait_for
    from .test_cancellation import generated_event, metric

    built: list[Any] = []

    def make() -> Any:  # on the model thread: MLX streams are the thread's own
        built.append(MlxBackend(store_home / "models" / MODEL, model_id=MODEL))
        return built[-1]

    lazy = Loadable(id=MODEL, make=make, capabilities=frozenset({"chat", "completion", "vision"}),
                    context_window=2048, size=30 << 20)
    server = await start_server(backends=[], library=[lazy])
    events = server.system.subscribe()
    urls = [f"data:image/png;base64,{base64.b64encode(_png(100 + i)).decode()}" for i in range(40)]
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": QUESTION}]}]}
    sock = await raw_post(server.url, "/v1/chat/completions", body)
    await wait_for(lambda: bool(built) and built[0].vision.pieces_run >= 3, timeout=60)
    await sock.aclose()
    at_close = built[0].vision.pieces_run
    event = await generated_event(events, timeout=30)
    assert event.stop_reason == "Cancelled" and event.phase == "prefill" and event.new_tokens == 0
    assert built[0].vision.pieces_run - at_close <= 2 and built[0].vision.pieces_run < 800  # a piece, and the crossing's
    assert event.prefilled_tokens < event.prompt_tokens // 10 and not built[0].vision.reading
    async with httpx.AsyncClient(timeout=60) as h:
        assert await metric(h, server.url, 'turbospark_cancellations_total{phase="prefill"}') == 1
        r = await h.post(f"{server.url}/v1/chat/completions",
                         json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["usage"]["completion_tokens"] == 2


async def test_images_are_processed_before_the_model_thread_sees_them(start_server, store_home: Path,
                                                                        expected: dict[str, Any]) -> None:
    """The processor's work (PIL and numpy, tens of milliseconds an image) is done in a worker
    thread before the job is queued: the model thread, which decodes the other streams, finds
    the request's images processed; the answer is the same."""
    from turbospark.actors.lifecycle import Loadable
    from turbospark.model.mlx_backend import MlxBackend

    built: list[Any] = []

    def make() -> Any:
        built.append(MlxBackend(store_home / "models" / MODEL, model_id=MODEL))
        return built[-1]

    lazy = Loadable(id=MODEL, make=make, capabilities=frozenset({"chat", "completion", "vision"}),
                    context_window=2048, size=30 << 20)
    server = await start_server(backends=[], library=[lazy])
    url = f"data:image/png;base64,{base64.b64encode(_png(1)).decode()}"
    async with httpx.AsyncClient(timeout=60) as h:
        r = await h.post(f"{server.url}/v1/chat/completions", json={
            "model": MODEL, "max_tokens": NEW, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}]})  # fmt: skip
    assert r.json()["choices"][0]["message"]["content"] == expected["text"]
    assert built[0].vision.seen_ahead == 1 and not built[0].vision._ahead


async def test_a_llava_model_reads_the_image_as_transformers_does(
    nursery: trio.Nursery, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """LLaVA 1.5's layout (transformers 5 writes its tower without ``vision_model``): a CLIP tower,
    the second-to-last layer's patches, the projector; one image is one piece."""
    source = tiny_llava(tmp_path_factory.mktemp("transformers") / "tiny-llava")
    home = tmp_path_factory.mktemp("home")
    assert "llava" in import_into(home, source, "tiny-llava")
    question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    want = reference_generate(source, question, [_rgb(_png(1))], NEW)
    from transformers import PreTrainedTokenizerFast

    text = PreTrainedTokenizerFast.from_pretrained(source).decode(want, skip_special_tokens=True)
    server = await _serve(nursery, home)
    url = f"data:image/png;base64,{base64.b64encode(_png(1)).decode()}"
    try:
        sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        chat = await sdk.chat.completions.create(model="tiny-llava", max_tokens=NEW, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}])  # fmt: skip
        assert chat.choices[0].message.content == text
        assert chat.usage is not None and chat.usage.prompt_tokens == 32  # 16 image tokens
        answer = await ollama.AsyncClient(host=server.url).chat(
            model="tiny-llava", options={"temperature": 0, "num_predict": NEW},
            messages=[{"role": "user", "content": QUESTION, "images": [_png(1)]}])
        assert answer.message.content == text
    finally:
        server.stop.set()


def test_the_mlx_community_layout_imports_and_reads_as_transformers_does(
    source: Path, tmp_path: Path, expected: dict[str, Any]
) -> None:
    """The directory as mlx-vlm's converter writes it: ``language_model.model.*``, the tower's
    tensors without ``model.``, its patch convolution laid out for MLX (channels last)."""
    import shutil

    import mlx.core as mx

    from turbospark.model.mlx_backend import MlxBackend

    mlx_dir = tmp_path / "tiny-idefics3-mlx"
    shutil.copytree(source, mlx_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    renamed = {}
    for key, array in mx.load(str(source / "model.safetensors")).items():
        if key.startswith("model.text_model."):
            key = "language_model.model." + key[len("model.text_model."):]
        elif key.startswith("lm_head."):
            key = "language_model." + key
        else:
            key = key.removeprefix("model.")
            if key.endswith("patch_embedding.weight"):
                array = array.transpose(0, 2, 3, 1)
        renamed[key] = array
    mx.save_safetensors(str(mlx_dir / "model.safetensors"), renamed, {"format": "mlx"})
    store = ModelStore(tmp_path / "models")
    stored = store.import_source(mlx_dir, name="tiny-mlx", dtype="float32", progress=False)
    backend = MlxBackend(stored.path, model_id="tiny-mlx")
    assert _run(backend, {0: _job(backend, [_png(1)])})[0] == expected["ids"]
