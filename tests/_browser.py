"""A real headless Chromium for the web page's tests: Debian's ``chromium`` (``scripts/setup
--test`` installs it) driven by Playwright, which is pointed at it and never downloads a browser.

``browse(url, drive, ...)`` runs ``drive(page)`` in a fresh browser on a worker thread (Playwright's
sync API must not run on Trio's thread; the server keeps running on it).  Every request the page
makes is recorded, and must go to the server and nowhere else.  ``shot(page, name)`` writes a
screenshot to ``$TURBOSPARK_SCREENSHOTS`` (default ``tests/.screenshots``) for a reviewer.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pytest
import trio

T = TypeVar("T")

SCREENSHOTS = Path(os.environ.get("TURBOSPARK_SCREENSHOTS") or Path(__file__).parent / ".screenshots")


def chromium() -> str | None:
    return os.environ.get("TURBOSPARK_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def skip_reason() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (scripts/setup --test installs it)"
    if chromium() is None:
        return "no chromium on PATH: install Debian's chromium and chromium-driver (scripts/setup --test, as root)"
    return None


def _browser_env() -> dict[str, str]:
    """The tests run with OpenBLAS preloaded for MLX (scripts/test); Chromium crashes with it."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def shot(page: Any, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def _run(url: str, drive: Callable[[Any], T], args: Sequence[str], viewport: dict[str, int],
         permissions: Sequence[str]) -> T:  # fmt: skip
    from playwright.sync_api import sync_playwright

    server = urlsplit(url).netloc
    elsewhere: list[str] = []
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), env=_browser_env(),
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *args])
        try:
            context = browser.new_context(viewport=viewport, permissions=list(permissions))
            page = context.new_page()
            page.set_default_timeout(20_000)

            def seen(request: Any) -> None:
                parts = urlsplit(request.url)
                if parts.scheme not in ("data", "blob") and parts.netloc != server:
                    elsewhere.append(request.url)

            page.on("request", seen)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            result = drive(page)
        finally:
            browser.close()
    assert not elsewhere, f"the page reached beyond the server: {elsewhere}"
    assert not errors, f"the page raised: {errors}"
    return result


async def browse(url: str, drive: Callable[[Any], T], *, args: Sequence[str] = (),
                 viewport: dict[str, int] | None = None, permissions: Sequence[str] = ()) -> T:  # fmt: skip
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    view = viewport or {"width": 1280, "height": 900}
    return await trio.to_thread.run_sync(partial(_run, url, drive, args, view, permissions))
