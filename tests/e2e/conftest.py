"""The user's whole path: the real server, the real canvas in headless Chromium, our workflows.

Runs when COMFYUI_DIR names a ComfyUI checkout (as tests/upstream) and Chromium and Playwright
are there; otherwise every case is reported skipped with the reason, except where
E2E_REQUIRED=1 (CI) makes a missing piece a failure. E2E_ARTIFACTS=DIR keeps each workflow's
video and canvas screenshot, and session.json, in DIR.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import comfyui_server
from tests.e2e import canvas
from tests.upstream.conftest import upstream  # noqa: F401  (fixture: upstream importable, on the CPU)

HERE = Path(__file__).resolve().parent


def missing_piece() -> str | None:
    if not os.environ.get("COMFYUI_DIR"):
        return "COMFYUI_DIR is not set: the e2e suite needs a ComfyUI checkout (see the README, 'Supported ComfyUI')"
    if canvas.chromium_path() is None:
        return "no chromium on PATH (Debian: apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright; it drives the system chromium)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = missing_piece()
    if reason is None:
        return
    ours = [item for item in items if HERE in Path(str(item.fspath)).resolve().parents]
    if ours and os.environ.get("E2E_REQUIRED") == "1":
        raise pytest.UsageError(f"E2E_REQUIRED=1 but {reason}")
    for item in ours:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Path:
    path = os.environ.get("E2E_ARTIFACTS")
    out = Path(path) if path else tmp_path_factory.mktemp("e2e-artifacts")
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="session")
def comfyui(upstream, tmp_path_factory):  # noqa: F811
    """One server for the session: this project installed, then the try-out (the tiny models
    under the released names and its node in custom_nodes/). With ComfyUI's classic cache (the last prompt's
    node outputs only): its default RAM-pressure cache keeps every earlier prompt's outputs
    until RAM runs short, so the server's RSS would grow with each prompt by design and hide a
    leak of ours."""
    from comfy.multidevice.cli.tryout import install
    root = tmp_path_factory.mktemp("e2e-server")
    tree = comfyui_server.installed_copy(upstream.tree, root)
    install(tree)
    running = comfyui_server.start(tree, root, args=("--cache-classic",))
    try:
        yield running
    finally:
        comfyui_server.stop(running)


@pytest.fixture(scope="session")
def chromium():
    """One headless chromium for the session: Playwright's sync API starts once per thread (a
    second `sync_playwright()` while one runs fails), so every test's pages come from this one."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = canvas.launch(p)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="session")
def browser(chromium, comfyui):
    return chromium


@pytest.fixture(scope="session")
def page(browser, comfyui):
    return canvas.open_canvas(browser, comfyui.url)
