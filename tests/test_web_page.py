"""The web page in a real headless Chromium (tests/_browser.py), against in-process servers:
the page at ``/`` for browsers only, the playground streaming and stopping, the live status feed,
the model manager pulling with a progress bar, and the microphone into realtime transcription.
Each test writes a screenshot of its view (tests/.screenshots)."""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import pytest
import trio

from turbospark.audio.engines import ScriptedSpeechToText, ScriptedTextToSpeech
from turbospark.messages import BatchState, Generated
from turbospark.model.scripted import ScriptedBackend

from turbospark.cli.attach import load_mlx
from turbospark.store.catalogue import CATALOGUE
from turbospark.store.shelf import StoreShelf
from turbospark.store.store import ModelStore

from ._browser import browse, shot
from .model.test_store import _tiny_entry, local_index, tiny_gguf  # noqa: F401 (fixtures)
from ._support import wait_for

SCRIPT = "The quick brown fox jumps over the lazy dog. " * 40


async def test_the_page_is_served_to_browsers_and_the_plain_answer_to_everyone_else(start_server, client) -> None:
    server = await start_server(api_key="secret")
    key = {"Authorization": "Bearer secret"}
    assert (await client.get(f"{server.url}/")).status_code == 401  # as before: the key is asked
    plain = await client.get(f"{server.url}/", headers=key)
    assert plain.text == "Ollama is running" and plain.headers["content-type"].startswith("text/plain")
    head = await client.head(f"{server.url}/", headers={"Accept": "text/html", **key})
    assert head.status_code == 200 and head.headers["content-type"].startswith("text/plain")
    page = await client.get(f"{server.url}/", headers={"Accept": "text/html,application/xhtml+xml"})
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert '<script type="module" src="/ui/app.js">' in page.text  # public: the page asks for the key
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    script = await client.get(f"{server.url}/ui/playground.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    for missing in ("/ui/nothing.js", "/ui/..%2Fpage.py"):
        assert (await client.get(f"{server.url}{missing}")).status_code == 404
    # the API behind it keeps its key, and the page its Origin and Host rules
    assert (await client.get(f"{server.url}/status/feed")).status_code == 401
    assert (await client.get(f"{server.url}/api/catalogue")).status_code == 401
    foreign = await client.get(f"{server.url}/", headers={"Accept": "text/html", "Origin": "https://evil.example"})
    assert foreign.status_code == 403
    rebound = await client.get(f"{server.url}/", headers={"Accept": "text/html", "Host": "evil.example"})
    assert rebound.status_code == 403


async def test_the_status_feed_sends_snapshots_that_agree_with_the_metrics(start_server, client) -> None:
    server = await start_server()
    bad = await client.get(f"{server.url}/status/feed?interval=0")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "interval"
    r = await client.post(f"{server.url}/v1/chat/completions", json={
        "model": "scripted", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
    assert r.status_code == 200
    async with client.stream("GET", f"{server.url}/status/feed?interval=0.2") as feed:
        snapshots = []
        async for line in feed.aiter_lines():
            if line.startswith("data: "):
                snapshots.append(json.loads(line[6:]))
                if len(snapshots) == 3:
                    break
    # a feed left open ends by itself when the server begins to shut down
    async with client.stream("GET", f"{server.url}/status/feed?interval=10") as feed:
        lines = feed.aiter_lines()
        assert (await lines.__anext__()).startswith("data: ")
        server.stop.set()
        assert [line async for line in lines] == [""]  # the frame's blank line, then the end
    first = snapshots[0]
    assert first["generated_tokens"] == 5  # seeded from the observer's metrics
    assert first["cancellations"] == {"queued": 0, "prefill": 0, "decode": 0}
    assert [m["model"] for m in first["loaded"]][0] == "scripted"
    assert first["loaded"][0]["expires"] is None and first["loaded"][0]["leases"] == 0
    assert snapshots[1]["at"] > first["at"] and snapshots[2]["requests"] >= first["requests"]


async def test_a_chat_streams_into_side_by_side_conversations(start_server) -> None:
    server = await start_server([ScriptedBackend(script="Hello from the scripted model.", token_delay=0.05)])
    events = server.system.subscribe(buffer=10_000)

    def drive(page):  # type: ignore[no-untyped-def]
        page.goto(server.url)
        page.wait_for_selector('#cancel-counter[data-total]')  # the status feed is live
        conv = page.locator('[data-conversation="1"]')
        assert conv.locator(".model option").first.get_attribute("value") == "scripted"
        conv.locator(".input").fill("Say hello")
        conv.locator(".input").press("Control+Enter")  # the keyboard sends
        answer = conv.locator("li.assistant[data-state=done]")
        answer.wait_for()
        text = answer.locator(".content").inner_text()
        stats = answer.locator(".stats").inner_text()
        page.click("#add-conversation")
        second = page.locator('[data-conversation="2"]')
        assert page.evaluate("document.activeElement.closest('[data-conversation]').dataset.conversation") == "2"
        second.locator(".input").fill("And you?")
        conv.locator(".input").fill("Again?")
        page.click("#ask-all")  # both at once: they decode in one batch
        second.locator("li.assistant[data-state=done]").wait_for()
        conv.locator("li.assistant[data-state=done]").nth(1).wait_for()
        shot(page, "playground")
        return text, stats

    text, stats = await browse(server.url, drive)
    batches = []
    while True:
        try:
            event = events.receive_nowait()
        except trio.WouldBlock:
            break
        if isinstance(event, BatchState):
            batches.append(event.running)
    assert max(batches) == 2
    assert text == "Hello from the scripted model."
    assert "prompt +" in stats and "completion tokens" in stats and "TTFT" in stats and "tok/s" in stats


async def test_reasoning_is_folded_and_tool_calls_are_cards(start_server) -> None:
    script = '<think>Let me look it up.</think><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    server = await start_server([ScriptedBackend(script=script)])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

    def drive(page):  # type: ignore[no-untyped-def]
        page.goto(server.url)
        conv = page.locator('[data-conversation="1"]')
        conv.locator(".settings summary").click()
        conv.locator(".tools").fill(json.dumps(tools))
        conv.locator(".system").fill("You can look up the weather.")
        conv.locator(".input").fill("Weather in Oslo?")
        conv.locator(".send").click()
        answer = conv.locator("li.assistant[data-state=done]")
        answer.wait_for()
        folded = answer.locator("details.reasoning")
        was_open = folded.get_attribute("open")
        folded.locator("summary").click()
        shot(page, "playground-tools")
        return (was_open, folded.inner_text(), answer.locator(".tool-card strong").inner_text(),
                answer.locator(".tool-card code").inner_text())

    was_open, reasoning, name, arguments = await browse(server.url, drive)
    assert was_open is None and reasoning == "Reasoning\nLet me look it up."
    assert name == "get_weather" and json.loads(arguments) == {"city": "Oslo"}


async def test_the_mcp_servers_are_listed_and_the_playground_runs_their_tools(start_server, tmp_path: Path) -> None:
    from .test_mcp import CALL_ADD, demo, marks

    server = await start_server([ScriptedBackend(script=CALL_ADD)], mcp_servers=(demo(tmp_path / "marks"),))

    def drive(page):  # type: ignore[no-untyped-def]
        page.goto(server.url)
        conv = page.locator('[data-conversation="1"]')
        conv.locator(".settings summary").click()
        conv.locator(".mcp-server[value=demo]").check()
        conv.locator(".max-tokens").fill("60")
        conv.locator(".input").fill("What is 2 plus 3?")
        conv.locator(".send").click()
        answer = conv.locator("li.assistant[data-state=done]")
        answer.wait_for()
        card = answer.locator(".mcp-call").first
        shot(page, "playground-mcp")
        ran = (card.locator("strong").inner_text(), card.locator("code").inner_text(), card.locator(".tool-output").inner_text())
        page.click("#tab-models")
        row = page.locator('#mcp-servers tr[data-server="demo"]')
        row.wait_for()
        return ran, row.inner_text()

    (name, arguments, output), row = await browse(server.url, drive)
    assert name == "demo · add" and json.loads(arguments) == {"a": 2, "b": 3} and output == "5"
    assert marks(tmp_path / "marks")[0] == "add 2 3"
    assert row.split("\t")[:3] == ["demo", "stdio", "up"] and "shout" in row


async def test_stop_closes_the_stream_and_the_server_counts_the_cancellation(start_server) -> None:
    backend = ScriptedBackend(script=SCRIPT, token_delay=0.05)
    server = await start_server([backend])
    events = server.system.subscribe()
    steps: list[int] = []

    def drive(page):  # type: ignore[no-untyped-def]
        page.goto(server.url)
        page.wait_for_selector("#cancel-counter[data-total]")
        before = int(page.get_attribute("#cancel-counter", "data-total"))
        conv = page.locator('[data-conversation="1"]')
        conv.locator(".settings summary").click()
        conv.locator(".max-tokens").fill("4000")
        conv.locator(".input").fill("Tell me everything")
        conv.locator(".send").click()
        page.wait_for_function("() => document.querySelector('li.assistant .content').textContent.length > 40")
        steps.append(backend.counters.decode_steps)
        conv.locator(".stop").click()
        page.wait_for_function(f"() => +document.querySelector('#cancel-counter').dataset.total > {before}")
        shown = conv.locator("li.assistant .content").inner_text()
        shot(page, "playground-stopped")
        return before, shown, conv.locator("li.assistant").get_attribute("data-state")

    before, shown, state = await browse(server.url, drive)
    assert before == 0 and state == "stopped"
    assert 40 < len(shown) < len(SCRIPT)
    with trio.fail_after(10):
        async for event in events:
            if isinstance(event, Generated):
                break
    assert event.stop_reason == "Cancelled" and event.phase == "decode"
    assert event.new_tokens < len(backend.tokenizer.encode(SCRIPT))
    settled = backend.counters.decode_steps
    await trio.sleep(0.3)
    assert backend.counters.decode_steps == settled  # decoding stopped


async def test_live_status_and_phone_width(start_server) -> None:
    server = await start_server([ScriptedBackend(script="Short answer.", token_delay=0.02)])

    def drive(page):  # type: ignore[no-untyped-def]
        page.goto(server.url)
        conv = page.locator('[data-conversation="1"]')
        conv.locator(".input").fill("Hi")
        conv.locator(".send").click()
        conv.locator("li.assistant[data-state=done]").wait_for()
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        shot(page, "playground-phone")
        page.focus("#tab-playground")
        page.keyboard.press("ArrowRight")  # tabs move with the arrow keys
        assert page.get_attribute("#tab-status", "aria-selected") == "true"
        assert page.is_visible("#view-status") and not page.is_visible("#view-playground")
        page.wait_for_function("""() => [...document.querySelectorAll('#status-figures div')]
            .some(d => d.dataset.name === 'Tokens generated' && +d.querySelector('dd').textContent >= 3)""")
        rows = page.locator("#status-models tbody tr th").all_inner_texts()
        plots = page.locator(".plot svg polyline").count()
        shot(page, "status-phone")
        # without colour (forced colours, as a high-contrast theme): the selected tab still says so
        page.emulate_media(forced_colors="active")
        marker = page.evaluate("getComputedStyle(document.querySelector('#tab-status'), '::before').content")
        unmarked = page.evaluate("getComputedStyle(document.querySelector('#tab-models'), '::before').content")
        shot(page, "status-forced-colours")
        return overflow, rows, plots, marker, unmarked

    overflow, rows, plots, marker, unmarked = await browse(server.url, drive, viewport={"width": 390, "height": 844})
    assert overflow <= 0  # nothing wider than a phone
    assert "scripted" in rows and plots == 2
    assert marker == '"▸ "' and unmarked in ("none", "normal")


@pytest.mark.mlx  # the pulled GGUF is converted with MLX
async def test_a_pull_moves_the_progress_bar_and_lists_the_model(
    start_server, tmp_path: Path, tiny_gguf: Path, local_index: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(CATALOGUE, "tiny-chat", _tiny_entry(local_index, tiny_gguf))
    shelf = StoreShelf(ModelStore(tmp_path / "models"), load_mlx)
    server = await start_server(library=shelf.loadables, shelf=shelf)
    gguf = tiny_gguf

    def drive(page):  # type: ignore[no-untyped-def]
        page.goto(f"{server.url}/#models")
        page.wait_for_selector("#pull-name option[value=tiny-chat]", state="attached")
        page.select_option("#pull-name", "tiny-chat")
        page.click("#pull-form button[type=submit]")
        page.wait_for_selector('#store-models tr[data-model="tiny-chat"]')
        bar = page.evaluate("(({value, max, dataset}) => [value, max, +dataset.steps])(document.querySelector('#pull-progress'))")
        tiny = page.locator('#store-models tr[data-model="tiny-chat"]')
        row = tiny.inner_text()
        tiny.locator("button.load").click()  # loads, kept 5 minutes
        page.wait_for_selector('#store-models tr[data-model="tiny-chat"] td.state:text("loaded")')
        shot(page, "models")
        page.click("#tab-status")  # its lease's keep-alive counts down
        page.wait_for_selector('#status-models tr:has(th:text("tiny-chat")) td:text-matches("^4:5[0-9] left$")')
        shot(page, "status")
        page.click("#tab-models")
        page.locator('#store-models tr[data-model="tiny-chat"] button.unload').click()  # keep_alive: 0
        page.wait_for_selector('#store-models tr[data-model="tiny-chat"] td.state:text("stored")')
        return bar, row

    (value, maximum, steps), row = await browse(server.url, drive)
    assert steps >= 2 and value == maximum == gguf.stat().st_size  # it moved, and it finished
    assert "completion" in row and "stored" in row


async def test_json_schema_output_in_the_playground_matches_the_schema(start_server) -> None:
    server = await start_server([ScriptedBackend(script="Here you go: not JSON at all")])
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}  # fmt: skip

    def drive(page):  # type: ignore[no-untyped-def]
        page.goto(server.url)
        conv = page.locator('[data-conversation="1"]')
        conv.locator(".settings summary").click()
        conv.locator(".schema").fill(json.dumps(schema))
        conv.locator(".input").fill("Who are you?")
        conv.locator(".send").click()
        answer = conv.locator("li.assistant[data-state=done]")
        answer.wait_for()
        shot(page, "playground-json")
        return answer.locator(".content").inner_text()

    text = await browse(server.url, drive)
    answer = json.loads(text)
    assert set(answer) == {"name"} and isinstance(answer["name"], str)


@pytest.mark.mlx  # the imported GGUFs are converted with MLX
async def test_import_a_file_and_from_ollamas_store_then_delete(
    start_server, tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    from .model.test_ollama_import import lay_out

    lay_out(tmp_path / "ollama", "registry.ollama.ai/library/tiny/1b", tiny_gguf)
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    store = ModelStore(tmp_path / "models")
    shelf = StoreShelf(store, load_mlx)
    server = await start_server(library=shelf.loadables, shelf=shelf)

    def drive(page):  # type: ignore[no-untyped-def]
        page.on("dialog", lambda dialog: dialog.accept())  # "Delete … from the store?"
        page.goto(f"{server.url}/#models")
        page.set_input_files("#import-file", str(tiny_gguf))
        assert page.input_value("#import-file-name") == "tiny-chat.q4_0"  # named after the file
        page.fill("#import-file-name", "from-file")
        page.click("#import-file-form button[type=submit]")
        page.wait_for_selector('#store-models tr[data-model="from-file"]')
        page.wait_for_selector('#import-status:text("Imported from-file.")')
        steps = page.evaluate("+document.querySelector('#import-progress').dataset.steps")
        page.wait_for_selector("#import-ollama option[value='ollama:tiny:1b']", state="attached")
        page.click("#import-ollama-form button[type=submit]")
        page.wait_for_selector('#store-models tr[data-model="tiny:1b"]')
        shot(page, "models-import")
        page.locator('#store-models tr[data-model="from-file"] button.delete').click()
        page.wait_for_selector('#store-models tr[data-model="from-file"]', state="detached")
        return steps, page.inner_text("#models-message")

    steps, message = await browse(server.url, drive)
    assert steps >= 1 and message == "from-file deleted"
    assert sorted(m.name for m in store.list()) == ["tiny:1b"]


def _tone_wav(path: Path, seconds: float = 3.0, rate: int = 48000) -> Path:
    t = np.arange(int(seconds * rate)) / rate
    samples = (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return path


@pytest.mark.parametrize("key", [None, "s3cret key/with+symbols"], ids=["open", "api-key"])
async def test_the_microphone_is_transcribed_and_an_answer_spoken(start_server, tmp_path: Path, key: str | None) -> None:
    stt = ScriptedSpeechToText()
    server = await start_server(audio=[stt, ScriptedTextToSpeech()], **({"api_key": key} if key else {}))
    wav = _tone_wav(tmp_path / "voice.wav")
    args = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={wav}"]

    def drive(page):  # type: ignore[no-untyped-def]
        page.goto(f"{server.url}/#mic")
        if key:
            page.wait_for_selector("#key-dialog[open]")
            page.fill("#key-input", key)
            page.keyboard.press("Enter")
        page.wait_for_selector("#stt-model option[value=scripted-stt]", state="attached")
        partials: list[str] = []
        page.expose_function("heardPartial", lambda text: partials.append(text))
        page.evaluate("""() => new MutationObserver(() => window.heardPartial(document.querySelector('#partial').textContent))
            .observe(document.querySelector('#partial'), {childList: true, characterData: true, subtree: true})""")
        page.click("#record")
        page.wait_for_selector("#record[aria-pressed=true]")
        page.wait_for_timeout(1500)  # speak for a while
        page.click("#record")
        final = page.locator("#finals li").first
        final.wait_for()
        page.fill("#speak-text", "Hello there")
        page.click("#speak")
        page.wait_for_selector("#speech[data-spoken]", state="attached")
        page.wait_for_function("() => document.querySelector('#speech').duration > 0")
        shot(page, f"microphone-{'key' if key else 'open'}")
        stored = page.evaluate("sessionStorage.getItem('turbospark.apiKey')")
        return final.inner_text(), page.evaluate("document.querySelector('#speech').duration"), stored, partials

    text, duration, stored, partials = await browse(server.url, drive, args=args, permissions=["microphone"])
    assert text.startswith("Scripted transcript of ") and text.endswith(" s of audio.")
    assert stt.calls and sum(stt.calls) > 0
    assert any(p.startswith("Scripted transcript of ") for p in partials)  # hypotheses while it spoke
    assert duration == pytest.approx(len("Hello there") * 0.05, abs=0.05)
    assert stored == key


def _turns_wav(path: Path, rate: int = 16000) -> Path:
    """1.5 s of a loud tone (speech, to server VAD), then 3 s of silence; Chromium's fake
    microphone plays it in a loop, so a turn ends, and the next begins over the answer."""
    t = np.arange(int(1.5 * rate)) / rate
    tone = 0.4 * np.sin(2 * np.pi * 220 * t)
    samples = np.concatenate([tone, np.zeros(3 * rate)])
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return path


async def test_a_conversation_is_heard_answered_aloud_and_interrupted(start_server, tmp_path: Path) -> None:
    """The Microphone view's conversation: the page talks to /v1/realtime as OpenAI's clients do."""
    backend = ScriptedBackend(token_delay=0.03)  # an endless answer, paced
    server = await start_server(backends=[backend], audio=[ScriptedSpeechToText(), ScriptedTextToSpeech()])
    wav = _turns_wav(tmp_path / "turns.wav")
    args = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={wav}"]

    def drive(page):  # type: ignore[no-untyped-def]
        page.goto(f"{server.url}/#mic")
        page.click("#talk")
        page.wait_for_selector("#talk[aria-pressed=true]")
        page.wait_for_selector('#talk-log li[data-role=user]', timeout=20_000)
        # the microphone loops its file from wherever it is: wait for an answer that was spoken
        # before the next turn's speech interrupted it
        page.wait_for_function("""() => [...document.querySelectorAll('#talk-log li[data-status=cancelled]')]
            .some(li => li.querySelector('span').textContent.trim() !== '(interrupted)')""", timeout=45_000)
        shot(page, "conversation")
        # the page told the server how much of the answer it played (conversation.item.truncate)
        page.wait_for_selector("#talk-log li[data-role=assistant][data-truncated-ms]", timeout=10_000)
        truncated = page.eval_on_selector_all("#talk-log li[data-truncated-ms]", "items => items.map(li => +li.dataset.truncatedMs)")
        lines = page.eval_on_selector_all("#talk-log li", "items => items.map(li => [li.dataset.role, li.textContent])")
        seconds = float(page.eval_on_selector("#talk-log", "ol => ol.dataset.audioSeconds || '0'"))
        page.click("#talk")
        page.wait_for_selector("#talk[aria-pressed=false]")
        return lines, seconds, truncated

    lines, seconds, truncated = await browse(server.url, drive, args=args, permissions=["microphone"])
    assert truncated and all(0 <= ms <= seconds * 1000 for ms in truncated), (truncated, seconds)
    user = [text for role, text in lines if role == "user"]
    answers = [text for role, text in lines if role == "assistant"]
    assert user and user[0].startswith("You: Scripted transcript of ")
    heard = [a for a in answers if a.endswith("(interrupted)") and a != "Answer:  (interrupted)"]
    assert heard and heard[0].startswith("Answer: The quick brown fox")
    assert seconds > 0  # the answer was heard before it was interrupted


@pytest.mark.mlx  # Whisper tiny.en on MLX hears Piper's voice through Chromium's fake microphone
async def test_the_real_whisper_model_transcribes_speech_from_the_microphone(nursery: trio.Nursery, tmp_path: Path) -> None:
    pytest.importorskip("mlx_whisper")
    pytest.importorskip("piper")
    import httpx

    from turbospark.audio import wav as wavfile
    from turbospark.audio.engines import AudioSpec
    from turbospark.audio.speech import PiperTextToSpeech
    from turbospark.audio.whisper import WhisperSpeechToText
    from turbospark.config import Settings
    from turbospark.server import serve

    from .realmodels import piper_store, whisper_store

    stt, tts = whisper_store(), piper_store()
    specs = [
        AudioSpec(stt.name, "speech_to_text", lambda: WhisperSpeechToText(stt.path, model_id=stt.name)),
        AudioSpec(tts.name, "text_to_speech", lambda: PiperTextToSpeech(tts.path, model_id=tts.name)),
    ]
    settings = Settings(host="127.0.0.1", port=0, graceful_timeout=1.0, models=("scripted",))
    server = await nursery.start(serve, settings, specs)
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(f"{server.url}/v1/audio/speech", json={
            "model": tts.name, "input": "The quick brown fox jumps over the lazy dog.", "response_format": "wav"})
    samples, rate = wavfile.read(r.content)
    speech = np.concatenate([np.zeros(rate // 2), samples, np.zeros(2 * rate)])  # then a pause (it loops)
    path = tmp_path / "speech.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(speech, -1, 1) * 32767).astype("<i2").tobytes())
    args = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={path}"]

    def drive(page):  # type: ignore[no-untyped-def]
        page.goto(f"{server.url}/#mic")
        page.wait_for_selector(f"#stt-model option[value='{stt.name}']", state="attached")
        page.click("#record")
        page.wait_for_selector("#finals li:has-text('fox')", timeout=60_000)  # a pause commits it
        page.click("#record")
        page.wait_for_selector("#record[aria-pressed=false]", timeout=60_000)
        shot(page, "microphone-whisper")
        return page.locator("#finals li").all_inner_texts()

    finals = await browse(server.url, drive, args=args, permissions=["microphone"])
    heard = next(t for t in finals if "fox" in t.lower())
    assert "quick brown fox" in heard.lower() and "lazy dog" in heard.lower()
    server.stop.set()
