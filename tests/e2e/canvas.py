"""Driving ComfyUI's real frontend (the page `main.py` serves) in headless Chromium, as a user.

Playwright from the registry drives Debian's `chromium` (no browser download). What the page
offers that these helpers use: `window.app.loadGraphData(workflow)` opens a UI workflow as
File > Open does, `app.graph` holds the canvas' nodes and their widgets, `app.queuePrompt`
is what the Run button calls (the frontend turns the graph into a prompt itself), and
`app.api` relays the server's websocket events (progress, executing, errors).
"""

from __future__ import annotations

import re
import shutil
import time

CHROMIUM_NAMES = ("chromium", "chromium-browser")
ERROR_MARKERS = re.compile(r"(\d+ errors? found|Errors detected|Missing Models|Missing Node|missing node)", re.I)
EVENTS = ("progress", "executing", "executed", "execution_start", "execution_error", "execution_success",
          "execution_interrupted", "progress_state", "progress_text")


def chromium_path() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def launch(playwright):
    """Debian's chromium, headless, under Playwright's sync API object `playwright`."""
    return playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                      args=["--no-sandbox", "--disable-gpu"])


def open_canvas(browser, url: str) -> Canvas:
    """A new page of `browser` on the frontend at `url`, loaded and listening to its events."""
    board = Canvas(browser.new_page(viewport={"width": 1600, "height": 1000}), url)
    board.open()
    return board


class Canvas:
    """One browser page on the server's frontend."""

    def __init__(self, page, url: str):
        self.page = page
        self.url = url

    def open(self) -> None:
        self.page.goto(self.url + "/")
        self.page.wait_for_function("window.app && window.app.graph && window.app.api", timeout=120_000)
        time.sleep(1.0)
        self.page.keyboard.press("Escape")  # the Templates dialog that opens on a first visit
        self.page.evaluate("""(names) => {
            window.__events = [];
            for (const name of names) app.api.addEventListener(name, e => window.__events.push([name, e.detail]));
        }""", list(EVENTS))

    def load(self, workflow: dict) -> None:
        self.page.evaluate("async (wf) => { await window.app.loadGraphData(wf); }", workflow)
        time.sleep(1.5)  # the frontend validates the graph right after it loads

    def errors(self) -> list[str]:
        """What the canvas reports as errors after a load: the lines of its error panel (empty
        when the page shows none)."""
        text = self.page.evaluate("document.body.innerText")
        if not ERROR_MARKERS.search(text):
            return []
        details = self.page.get_by_text("View details")
        if details.count():
            details.first.click()
            time.sleep(0.5)
            text = self.page.evaluate("document.body.innerText")
        start = max(text.find("Errors detected"), 0)
        return [line for line in text[start:start + 2000].splitlines() if line.strip()]

    def shown_error(self) -> str:
        """The page's text after opening the details of the error it shows (a failed run)."""
        details = self.page.get_by_text("View details")
        if details.count():
            details.last.click()
            time.sleep(0.5)
        return self.page.evaluate("document.body.innerText")

    def nodes(self) -> list[dict]:
        return self.page.evaluate("""() => app.graph.nodes.map(n => ({
            id: n.id, type: n.type, pos: [n.pos[0], n.pos[1]], size: [n.size[0], n.size[1]],
            widgets: Object.fromEntries((n.widgets || []).map(w => [w.name, w.value]))}))""")

    def set_widgets(self, node_type: str, values: dict) -> int:
        """Set widgets on every node of `node_type` as a user would; returns how many nodes."""
        return self.page.evaluate("""([type, values]) => {
            let count = 0;
            for (const n of app.graph.nodes) {
                if (n.type !== type) continue;
                for (const [name, value] of Object.entries(values)) {
                    const w = (n.widgets || []).find(w => w.name === name);
                    if (!w) throw new Error(`${type} has no widget ${name}`);
                    w.value = value;
                    if (w.callback) w.callback(value);
                }
                count += 1;
            }
            app.graph.setDirtyCanvas(true, true);
            return count;
        }""", [node_type, values])

    def run(self) -> None:
        """Press Run: the frontend converts the graph to a prompt and queues it."""
        self.page.evaluate("window.__events = []")
        self.page.evaluate("async () => { await app.queuePrompt(0, 1); }")

    def events(self) -> list:
        return self.page.evaluate("window.__events")

    def screenshot(self, path, around: str = "MultiNPUParallelConfig", scale: float = 0.8) -> None:
        """The canvas around the first node of type `around`, at a scale where its widgets read."""
        self.page.evaluate("""([type, scale]) => {
            const node = app.graph.nodes.find(n => n.type === type);
            const ds = app.canvas.ds;
            ds.scale = scale;
            if (node) {
                const [w, h] = [app.canvas.canvas.width / scale, app.canvas.canvas.height / scale];
                ds.offset[0] = -node.pos[0] + w / 2 - node.size[0] / 2;
                ds.offset[1] = -node.pos[1] + h / 2 - node.size[1] / 2;
            }
            app.graph.setDirtyCanvas(true, true);
        }""", [around, scale])
        time.sleep(0.5)
        self.page.screenshot(path=str(path))
