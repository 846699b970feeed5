"""The try-out as the README tells a user to run it, on a pristine tree: COMFYUI_DIR copied and the
pack installed by our installer, nothing else. `minimax_h3_parallel.py tryout --comfyui TREE` with
the tree's Python, then the server, which logs the TRY-OUT line; one of the pack's templates,
opened and run from the canvas at 4 CPU cards made small as the README says, must succeed with
a video of the asked size. Then the server stops, `--remove` runs, and the tree must be byte for
byte what it was before the try-out.

Left out of that comparison, because any start of ComfyUI writes them, try-out or not: `output/`
(the run's video), `user/` (ComfyUI's settings, database and the frontend's workflow files),
`temp/` (previews), every `__pycache__/` folder (Python's bytecode of the modules the server and
the command imported), and the empty folder `input/3d/` (upstream's Load3D node makes it when
the page asks for the node list; a file in it would still count). The try-out's node folder is
not among them: it was not in the tree before, so any of it left after the removal (its own
`__pycache__/` too) shows.
On v0.33.0 the node refuses sequence parallel (test_install_ways.py checks that), so this skips.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from comfy.multidevice.tryout import node
from tests import comfyui_server
from tests.e2e import canvas
from tests.e2e.test_workflows import CARDS, FRAMES, make_small, read_video, run_and_wait, saved_video, SIZE, workflow
from tests.helpers import file_hashes

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = "ref2va_8steps_lora"  # the README's first template: LoRA, reference images, both VAEs
RUNTIME_OUTPUT = ("output", "user", "temp")  # top-level folders every server start writes
MADE_BY_THE_PAGE = "input/3d/"  # an empty folder: Load3D's schema makes it for the node list
pytestmark = pytest.mark.timeout(900)


def runtime_output(relative: str) -> bool:
    parts = relative.split("/")
    return parts[0] in RUNTIME_OUTPUT or "__pycache__" in parts


def tryout(tree: Path, root: Path, *extra: str) -> subprocess.CompletedProcess:
    """The command as the README writes it, with the tree's Python (the stand-ins loaded first,
    as in the server: this CPU Python has no usable torchvision)."""
    return subprocess.run([sys.executable, str(REPO / "minimax_h3_parallel.py"), "tryout", "--comfyui", str(tree),
                           *extra], capture_output=True, text=True, timeout=600, env=comfyui_server.process_env(root),
                          cwd=REPO)


def test_the_try_out_installs_runs_a_template_at_4_cards_and_removes_itself(upstream, chromium, tmp_path,
                                                                          record_property):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_install_ways.py checks that)")
    tree = comfyui_server.installed_copy(upstream.tree, tmp_path)
    assert not (tree / "custom_nodes" / node.FOLDER).exists()  # the installer brings no try-out
    before = file_hashes(tree, skip=runtime_output)

    start = time.monotonic()
    made = tryout(tree, tmp_path)
    prepare_s = time.monotonic() - start
    assert made.returncode == 0, made.stdout + made.stderr
    remove_line = made.stdout.strip().splitlines()[-1].strip()
    assert remove_line.endswith("--remove") and "TRY-OUT" in made.stdout

    server = comfyui_server.start(tree, tmp_path, args=("--cache-classic",))
    try:
        assert f"TRY-OUT: tiny random weights, not the model; remove with {remove_line}" in server.log_text()
        board = canvas.open_canvas(chromium, server.url)
        try:
            board.load(workflow(TEMPLATE))
            assert board.errors() == [], f"{TEMPLATE} opens with errors on the canvas"
            make_small(board, CARDS)
            run = run_and_wait(board, server)
        finally:
            board.page.close()
        assert run.status == "execution_success", (run.error(), server.log_text()[-3000:])
        assert read_video(saved_video(server, run))["frames"].shape == (FRAMES, SIZE, SIZE, 3)
        assert f"MultiNPUParallelConfig: {CARDS} card(s) cpu" in server.log_text()
    finally:
        comfyui_server.stop(server)

    removed = tryout(tree, tmp_path, "--remove")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    after = file_hashes(tree, skip=runtime_output)
    if MADE_BY_THE_PAGE not in before:
        after.pop(MADE_BY_THE_PAGE, None)
    assert after == before, {"added": sorted(set(after) - set(before)), "gone": sorted(set(before) - set(after)),
                             "changed": sorted(k for k in set(before) & set(after) if before[k] != after[k])}
    record_property("prepare_s", round(prepare_s, 1))
    record_property("template_run_s", round(run.seconds, 1))
    print(f"try-out: prepared in {prepare_s:.1f} s; {TEMPLATE} at {CARDS} CPU cards ran in {run.seconds:.1f} s")
