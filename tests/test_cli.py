"""``python -m turbospark serve`` as a user runs it, driven by the official openai SDK."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from turbospark.model.scripted import shipped_tokenizer

TOK = shipped_tokenizer()


def _start(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "turbospark", "serve", "--port", "0", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 60
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.match(r"turbospark listening on (http://\S+)", line):
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError("the server did not say it was listening")


@pytest.fixture
def scripted_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    script = tmp_path / "script.txt"
    script.write_text("Paris is the capital of France.", encoding="utf-8")
    proc, url = _start("--model", "scripted", "--script", str(script), "--events", str(tmp_path / "ev.jsonl"))
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_openai_sdk_streaming_and_not(scripted_server) -> None:
    proc, url = scripted_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_tokens = len(TOK.encode_chat(messages))
    answer = client.chat.completions.create(model="scripted", messages=messages)
    assert answer.choices[0].message.content == "Paris is the capital of France."
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.usage.completion_tokens == len(TOK.encode("Paris is the capital of France.")) + 1

    stream = client.chat.completions.create(
        model="gpt-4o-mini", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Paris is the capital of France."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == prompt_tokens

    models = client.models.list()
    # with every --model scripted, the scripted encoder and audio engines are attached
    assert [m.id for m in models.data] == [
        "scripted", "claude-turbospark-scripted", "scripted-embedding", "scripted-stt", "scripted-tts", "scripted-image"
    ]
    events_file = Path(proc.args[proc.args.index("--events") + 1])
    deadline = time.monotonic() + 10  # the observer writes the file a moment later
    while True:
        kinds = [json.loads(line)["kind"] for line in events_file.read_text().splitlines()]
        if kinds.count("requestFinished") >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert kinds.count("generated") == 2 and kinds.count("requestFinished") == 3
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="scripted", messages=messages, max_tokens=0)
    assert "max_tokens must be greater than 0" in str(err.value)


def test_openai_and_ollama_clients_embed_with_the_scripted_encoder(scripted_server) -> None:
    import numpy as np
    import ollama

    proc, url = scripted_server
    texts = ["The cat sits on the mat.", "A kitten is resting on a rug."]
    expected = []
    for text in texts:
        v = np.array([1.0, 0.1 * len(text.encode()), 0.5, -0.2])
        expected.append(v / np.linalg.norm(v))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    for fmt in (openai.NOT_GIVEN, "float"):  # the SDK asks for base64 by default and decodes it
        r = client.embeddings.create(model="text-embedding-3-small", input=texts, encoding_format=fmt)
        assert r.model == "scripted-embedding"
        assert np.allclose([d.embedding for d in r.data], expected, atol=1e-7)
        assert r.usage.prompt_tokens == sum(len(TOK.encode(t)) for t in texts)
    with pytest.raises(openai.BadRequestError, match="dimensions 5 exceeds"):
        client.embeddings.create(model="any", input="x", dimensions=5)
    embedded = ollama.Client(host=url).embed(model="all-minilm", input=texts)
    assert np.allclose(embedded.embeddings, expected, atol=1e-7)
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=url).embed(model="all-minilm", input=texts, dimensions=0)
    assert refused.value.status_code == 400 and "dimensions must be greater than 0" in refused.value.error


def test_embedding_model_none_attaches_none() -> None:
    proc, url = _start("--model", "scripted", "--embedding-model", "none", "--stt-model", "none", "--tts-model", "none",
                       "--image-model", "none")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["scripted", "claude-turbospark-scripted"]
        assert httpx.get(f"{url}/v1/audio/models").status_code == 404  # no audio, no audio routes
        with pytest.raises(openai.APIStatusError) as no_images:
            client.images.generate(model="scripted-image", prompt="a lighthouse")
        assert no_images.value.status_code == 503 and "no model capable" in no_images.value.message
        with pytest.raises(openai.InternalServerError, match="no model capable"):
            client.embeddings.create(model="any", input="x")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


def test_sigterm_shuts_down_gracefully(scripted_server) -> None:
    proc, url = scripted_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
    # the client keeps its connection open (keep-alive, idle): that holds nothing up
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    assert time.monotonic() - started < 2.5


def test_sigint_during_a_stream_exits_zero(tmp_path: Path) -> None:
    proc, url = _start("--model", "scripted", "--token-delay-ms", "20")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=4000
        )
        chunks = iter(stream)
        next(chunks)
        proc.send_signal(signal.SIGINT)
        # the stream runs on through the grace period, then ends with the documented error
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in chunks:
                pass
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--api-key", ""], "--api-key must not be empty"),
        (["--port", "http"], "expected a port number"),
        (["--max-queue", "0"], "must be at least 1, got 0"),
        (["--max-batch", "0"], "a batch size must be 1-1024, got 0"),
        (["--kv-budget-mb", "lots"], "expected a whole number, got 'lots'"),
        (["--port", "70000"], "a port number must be 0-65535, got 70000"),
        (["--system", "a", "--system-file", "x"], "not allowed with argument"),
        (["--events", "/nonexistent-dir/ev.jsonl"], "--events: cannot write /nonexistent-dir/ev.jsonl"),
        (["--embedding-model"], "expected one argument"),
        (["--model", "scripted", "--draft-model", "x"], "--draft-model drafts for an MLX --model"),
        (["--distributed", "--draft-model", "x"], "--draft-model does not combine with --distributed"),
        (["--write-timeout", "soon"], "--write-timeout"),
    ],
)
def test_bad_flags_exit_2_with_one_clear_line(args: list[str], needle: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "turbospark", "serve", *args], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2
    assert needle in run.stderr
    assert "Traceback" not in run.stderr


def test_help_lists_every_flag() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "turbospark", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0
    for flag in (
        "--host", "--port", "--model", "--api-key", "--system", "--system-file", "--max-queue",
        "--events", "--script", "--token-delay-ms", "--max-batch", "--kv-budget-mb",
        "--embedding-model", "--draft-model", "--write-timeout",
    ):
        assert flag in run.stdout


def test_api_key_from_the_environment(tmp_path: Path) -> None:
    proc, url = _start("--model", "scripted", env={"TURBOSPARK_API_KEY": "k3y"})
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        models = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y").models.list()
        assert models.data[0].id == "scripted"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "scripted", "--embedding-model", "none", "--embedding-model", "scripted"],
         "--embedding-model none cannot be combined"),
        (["--model", "scripted", "--embedding-model", "no-such-encoder"], "unknown model 'no-such-encoder'"),
        (["--model", "scripted", "--image-model", "none", "--image-model", "scripted"],
         "--image-model none cannot be combined"),
        (["--model", "scripted", "--image-model", "no-such-painter"], "unknown image model 'no-such-painter'"),
    ],
)
def test_embedding_model_setup_errors_exit_1(args: list[str], needle: str, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "turbospark", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TURBOSPARK_HOME": str(tmp_path)},
    )
    assert run.returncode == 1
    assert needle in run.stderr and "Traceback" not in run.stderr


def test_a_blank_key_in_the_environment_is_refused() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "turbospark", "serve", "--model", "scripted"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TURBOSPARK_API_KEY": "  "},
    )
    assert run.returncode == 2
    assert "TURBOSPARK_API_KEY is set but blank" in run.stderr


def test_a_port_in_use_is_one_clear_line_before_any_model_loads() -> None:
    """Another server on the port: exit 1 at once with what to do, not a bind traceback after the
    models have loaded."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "turbospark", "serve", "--model", "scripted", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"turbospark: cannot listen on 127.0.0.1:{port}: address already in use (another server there? "
        "--port N picks another port, --port 0 a free one)"
    ]


def test_serve_keeps_torch_out_of_transformers() -> None:
    """Where torch is installed (the tests' reference implementations), ``serve`` imports
    transformers as if it were not: mlx-lm's tokenizers load, torch is never imported, no advice
    about it is printed, and ``importlib.util.find_spec`` is itself again afterwards."""
    pytest.importorskip("torch")
    code = (
        "import importlib.util, sys\n"
        "from turbospark.cli.main import import_mlx_lm_keeping_the_fd_limit, transformers_without_torch\n"
        "transformers_without_torch()\n"
        "import_mlx_lm_keeping_the_fd_limit()\n"
        "from mlx_lm.tokenizer_utils import load\n"
        "from turbospark.model.scripted import DATA_DIR\n"
        "assert load(DATA_DIR).encode('hello world'), 'a tokenizer'\n"
        "print('torch' in sys.modules, importlib.util.find_spec('torch') is not None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False", "True"], done.stdout + done.stderr
    assert "PyTorch" not in done.stderr
