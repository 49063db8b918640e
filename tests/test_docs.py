"""Every shell and Python example in the README and ``docs/`` runs, against the server its page
assumes, and prints what the page says it prints (``tests/_docs_examples.py`` reads them).

The server is a real ``python -m turbospark serve`` child on the port the page names (8080 unless
it says otherwise), with a model store of its own (``tests/.cache/docs-home``) made of hard links
to the test cache's real models, so ``models rm`` in an example costs nothing.  Shell blocks run in
a scratch directory that has the checkout's ``.venv`` and ``scripts``, with ``.venv/bin`` (and
Claude Code, where a block calls ``claude``) on ``PATH``."""

from __future__ import annotations

import doctest
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from tests._docs_examples import Block, Page, read_page, serve_lines

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MOST_NOT_RUN = 12  # examples shown but not run: few, each with its reason
READY_S = 600  # a default server's first start may convert models
BLOCK_S = 300

_MARK = "\x1e-turbospark-docs-"
_DRIVER = f"""
import contextlib, io, json, sys, traceback
ns = {{"__name__": "__main__"}}
for line in sys.stdin:
    block = json.loads(line)
    out = io.StringIO()
    ok, error = True, None
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(block["code"], block["name"], "exec"), ns)
    except BaseException:
        ok, error = False, traceback.format_exc()
    sys.__stdout__.write({_MARK!r} + json.dumps({{"ok": ok, "out": out.getvalue(), "error": error}}) + "\\n")
    sys.__stdout__.flush()
"""


def _pages() -> list[Page]:
    return [read_page(path) for path in PAGES]


def test_examples_are_marked() -> None:
    """Every page's markers parse; the examples that are not run are few, each says why."""
    pages = _pages()
    runnable = [b for p in pages for b in p.blocks if b.skip is None]
    shown = [b for p in pages for b in p.blocks if b.skip is not None]
    assert len(runnable) >= 30, [b.where() for b in runnable]
    assert len(shown) <= MOST_NOT_RUN, [(b.where(), b.skip) for b in shown]
    assert all(len(b.skip or "") > 10 for b in shown), [(b.where(), b.skip) for b in shown]
    readme = read_page(ROOT / "README.md")
    assert any(_calls_claude(b) and "--bare" in b.code and b.skip is None for b in readme.blocks), (
        "the README's Claude Code command runs")


def test_markers_are_read() -> None:
    text = (
        "<!-- examples: serve --model scripted -->\n"
        "```python\nprint(1)\n```\n\n```text output\n1\n```\n"
        "<!-- not run: it needs a GPU to show anything -->\n```sh\nnvidia-smi\n```\n"
        "```json\n{}\n```\n"
        "<!-- run: serve -->\n```sh\npython -m turbospark serve --port 0  # a server\n```\n"
        "```sh\ncurl http://127.0.0.1:9000/health\n```\n"
    )
    page = read_page(Path("x.md"), text)
    assert page.serve_args == ["--model", "scripted"] and page.port == 9000
    [py, gpu, serve, curl] = page.blocks
    assert (py.language, py.output, py.line) == ("python", "1\n", 2)
    assert gpu.skip == "it needs a GPU to show anything" and gpu.output is None
    assert serve.serve and serve_lines(serve) == [["python", "-m", "turbospark", "serve", "--port", "0"]]
    assert curl.language == "shell" and not curl.serve and curl.skip is None
    with pytest.raises(ValueError, match="needs a reason"):
        read_page(Path("x.md"), "<!-- not run: -->\n```sh\ntrue\n```\n")
    with pytest.raises(ValueError, match="must follow"):
        read_page(Path("x.md"), "```json\n{}\n```\n```text output\n1\n```\n")
    # nothing a reader would copy escapes: other languages, bare fences and indented code are refused
    for hidden in ("```console\n$ ls\n```\n", "```py\nprint(1)\n```\n", "```\nls\n```\n",
                   "Start it:\n\n    python -m turbospark serve\n"):
        with pytest.raises(ValueError, match="never run|neither run"):
            read_page(Path("x.md"), hidden)
    listed = "- a list item\n\n    its second paragraph, indented\n\n| a | table |\n"
    assert read_page(Path("x.md"), listed).blocks == []


# --- running them -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs_home() -> Path:
    """A model store holding the default models (hard links into the test cache)."""
    from tests.realmodels import gemma_store, minilm_store, piper_store, smollm2_native_store, whisper_store

    home = Path(os.environ.get("TURBOSPARK_TEST_HOME", ROOT / "tests" / ".cache")) / "docs-home"
    if home.exists():
        shutil.rmtree(home)
    (home / "models").mkdir(parents=True)
    for stored in (smollm2_native_store(), minilm_store(), whisper_store(), piper_store(), gemma_store()):
        shutil.copytree(stored.path, home / "models" / stored.path.name, copy_function=os.link)
    return home


class _Server:
    """One ``turbospark serve`` child at a time, kept while pages ask for the same one."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.key: tuple[tuple[str, ...], int] | None = None
        self.child: subprocess.Popen[str] | None = None
        self.log: list[str] = []

    def ensure(self, args: list[str], port: int) -> None:
        if self.key == (tuple(args), port) and self.child is not None and self.child.poll() is None:
            return
        self.stop()
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"port {port} is taken: the docs' examples need it for their server")
        self.child, self.log = start_server(
            [str(ROOT / ".venv" / "bin" / "python"), "-m", "turbospark", "serve", *args, "--port", str(port)],
            env=_env(self.home), cwd=ROOT,
        )
        self.key = (tuple(args), port)

    def stop(self) -> None:
        if self.child is not None:
            stop_server(self.child)
        self.child, self.key = None, None


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "TURBOSPARK_HOME": str(home), "PYTHONUNBUFFERED": "1",
            "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}


def start_server(argv: list[str], *, env: dict[str, str], cwd: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """``argv`` started, once it said it is listening; its log lines so far (and to come)."""
    child = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    log: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert child.stderr is not None
        for line in child.stderr:
            log.append(line)
            if "listening on" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(READY_S) or child.poll() is not None:
        stop_server(child)
        pytest.fail(f"{' '.join(argv)} did not start:\n{''.join(log)[-3000:]}")
    return child, log


def stop_server(child: subprocess.Popen[str]) -> int:
    """SIGINT, as Ctrl-C sends it; the status it exits with."""
    if child.poll() is None:
        child.send_signal(signal.SIGINT)
        try:
            return child.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            pytest.fail(f"pid {child.pid} did not stop within 30 s of SIGINT")
    return child.returncode


@pytest.fixture(scope="module")
def server(docs_home: Path):
    serving = _Server(docs_home)
    try:
        yield serving
    finally:
        serving.stop()


def _workdir(tmp: Path) -> Path:
    for name in (".venv", "scripts", "benchmarks"):
        (tmp / name).symlink_to(ROOT / name)
    return tmp


class _Python:
    """One interpreter for a page's Python blocks, run one at a time."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.child = subprocess.Popen([str(ROOT / ".venv" / "bin" / "python"), "-c", _DRIVER], env=env, cwd=cwd,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True)
        self.answers: queue.Queue[dict | None] = queue.Queue()
        self.noise: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.child.stdout is not None
        for line in self.child.stdout:
            if line.startswith(_MARK):
                self.answers.put(json.loads(line[len(_MARK):]))
            else:
                self.noise.append(line)
        self.answers.put(None)

    def run(self, block: Block) -> tuple[bool, str]:
        assert self.child.stdin is not None
        self.child.stdin.write(json.dumps({"code": block.code, "name": block.where()}) + "\n")
        self.child.stdin.flush()
        try:
            answer = self.answers.get(timeout=BLOCK_S)
        except queue.Empty:
            return False, f"no answer within {BLOCK_S} s"
        if answer is None:
            return False, "the interpreter died:\n" + "".join(self.noise)[-3000:]
        return answer["ok"], answer["out"] if answer["ok"] else answer["error"] + answer["out"]

    def close(self) -> None:
        if self.child.poll() is None:
            os.killpg(self.child.pid, signal.SIGKILL)
        self.child.wait()


def _shell(block: Block, env: dict[str, str], cwd: Path) -> tuple[bool, str]:
    try:
        done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=BLOCK_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"no end within {BLOCK_S} s"
    if done.returncode != 0:
        return False, f"exit status {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return True, done.stdout


def _check(block: Block, ok: bool, out: str) -> None:
    assert ok, f"{block.where()} failed:\n{block.code}\n{out}"
    if block.output is not None:
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        assert doctest.OutputChecker().check_output(block.output, out, flags), (
            f"{block.where()} printed\n{out}\nwhere the page shows\n{block.output}"
        )


def _calls_claude(block: Block) -> bool:
    """A shell block that runs Claude Code (``claude`` as a command, after any assignments)."""
    return block.language == "shell" and bool(re.search(r"(?m)(^|\s)claude(\s|$)", block.code.replace("\\\n", " ")))


def _claude_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with Claude Code on ``PATH`` (installed on first use; a skip if npm's registry
    cannot be reached)."""
    from tests.claude_code import _claude

    binary = _claude()
    return {**env, "ANTHROPIC_API_KEY": "unused", "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "HOME": str(binary.parents[2] / "home"),
            "PATH": f"{binary.parent}{os.pathsep}{env['PATH']}"}


_SERVE_BLOCKS = [b for p in _pages() for b in p.blocks if b.serve and b.skip is None]


@pytest.mark.mlx
@pytest.mark.parametrize("block", _SERVE_BLOCKS, ids=[b.where() for b in _SERVE_BLOCKS])
def test_serve_example(block: Block, server: _Server, tmp_path: Path) -> None:
    """Each command that starts a server starts it (it says it is listening) and stops on Ctrl-C."""
    server.stop()  # the port a command names must be free
    cwd = _workdir(tmp_path)
    for words in serve_lines(block):
        child, log = start_server(words, env=_env(server.home), cwd=cwd)
        assert stop_server(child) == 0, "".join(log)[-3000:]


_PAGES = [p for p in _pages() if any(b.skip is None and not b.serve for b in p.blocks)]


@pytest.mark.mlx
@pytest.mark.parametrize("page", _PAGES, ids=[str(p.path.relative_to(ROOT)) for p in _PAGES])
def test_page_examples(page: Page, server: _Server, tmp_path: Path) -> None:
    """The page's examples, in order, against the server it assumes; each succeeds and prints
    what the page shows."""
    server.ensure(page.serve_args, page.port)
    cwd = _workdir(tmp_path)
    env = _env(server.home)
    python: _Python | None = None
    not_run: list[str] = []  # Claude Code's blocks, where npm's registry could not be reached
    try:
        for block in page.blocks:
            if block.skip is not None or block.serve:
                continue
            if block.language == "python":
                python = python or _Python(env, cwd)
                ok, out = python.run(block)
            elif _calls_claude(block):
                try:
                    ok, out = _shell(block, _claude_env(env), cwd)
                except pytest.skip.Exception as skipped:
                    not_run.append(f"{block.where()}: {skipped}")
                    continue
            else:
                ok, out = _shell(block, env, cwd)
            _check(block, ok, out)
    finally:
        if python is not None:
            python.close()
    if not_run:
        pytest.skip("every other example ran; not run: " + "; ".join(not_run))



def test_configuration_page_is_generated() -> None:
    """``docs/configuration.md`` is exactly what the parsers say, and names every variable read."""
    import re

    from turbospark.cli.reference import ENVIRONMENT, TEST_ENVIRONMENT, configuration_page

    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == configuration_page(), "run: .venv/bin/python -m turbospark.cli.reference --write"
    for flag in ("--max-batch", "--keep-alive", "--prompt-cache-dir", "--api-key", "--token-delay-ms"):
        assert f"`{flag}`" in page
    listed = {name for name, _ in ENVIRONMENT + TEST_ENVIRONMENT}
    read = set()
    for folder in ("turbospark", "scripts", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and ".cache" not in path.parts and path.suffix in ("", ".py", ".h", ".cpp", ".sh"):
                read |= set(re.findall(r"TURBOSPARK_[A-Z_]*[A-Z]", path.read_text(encoding="utf-8", errors="replace")))
    assert read <= listed, sorted(read - listed)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    import re

    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_links_between_pages_resolve() -> None:
    """Every relative link in the README and docs/ names a file that exists, and a heading in it."""
    import re

    broken = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), flags=re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200


def test_every_decision_is_linked_from_the_docs() -> None:
    """The docs are the way in to design/: each decision record is linked from some page."""
    linked = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
    records = sorted((ROOT / "design" / "decisions").glob("[0-9][0-9][0-9][0-9]-*.md"))
    assert records
    missing = [r.name for r in records if f"design/decisions/{r.name})" not in linked]
    assert not missing, missing


def test_the_catalogue_table_lists_the_catalogue() -> None:
    from turbospark.store.catalogue import CATALOGUE

    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| `([^`]+)` \| (?:chat|completion|embedding|speech-to-text|text-to-speech) \|", text, re.M)
    assert listed == list(CATALOGUE), listed
