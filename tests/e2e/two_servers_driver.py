"""Server A of tests/e2e/test_two_servers.py, run inside its network namespace: a real ComfyUI
server whose node adds the ranks of server B (COMFYUI_MULTI_DEVICE_REMOTE_RANKS), driven
through its HTTP API from inside the namespace, line by line on stdout:

  READY                       the server answers: start server B's join command now
  EXACT <levels>              a prompt at 2 cards here + 2 ranks on B against 1 card (seed 7)
  KILL-NOW                    a 40-step prompt over the 4 ranks is sampling: kill a rank on B
  FAILED <seconds> <message>  that prompt's end, seconds after KILL-NOW, and its error
  EXACT <levels>              the next prompt (B's ranks back by themselves) against 1 card
  DONE

Exits non-zero on anything unexpected (the reason on stderr).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this repository, for tests.*; not for the server

import numpy as np  # noqa: E402

from tests import comfyui_server  # noqa: E402
from tests.comfyui_server import request  # noqa: E402
from tests.e2e.test_install_ways import error_text, run_prompt, saved_frames, t2va_prompt  # noqa: E402
from tests.e2e.test_workers import wait_for_end  # noqa: E402


def say(*words):
    print(*words, flush=True)


def prompt(prefix: str, seed: int, cards: int, steps: int = 2) -> dict:
    out = t2va_prompt(cards, prefix)
    out["8"]["inputs"].update(seed=seed, steps=steps)
    return out  # dit_ranks auto: processes, as other servers' ranks are set


def levels(tree: Path, prefix: str, reference: str) -> float:
    return float(np.abs(saved_frames(tree, prefix) - saved_frames(tree, reference)).max())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", type=Path, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--rendezvous", required=True)
    parser.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args()
    env = {"COMFYUI_MULTI_DEVICE_REMOTE_RANKS": "2", "COMFYUI_MULTI_DEVICE_RENDEZVOUS": args.rendezvous,
           "COMFYUI_MULTI_DEVICE_TIMEOUT_S": f"{args.timeout:g}"}
    server = comfyui_server.start(args.tree, args.root, env=env, args=("--cache-classic",))
    try:
        say("READY")
        for prefix, seed, cards in (("one_card_7", 7, 1), ("two_servers", 7, 2)):
            entry = run_prompt(server, prompt(prefix, seed, cards))
            if entry["status"]["status_str"] != "success":
                raise RuntimeError(f"{prefix}: {error_text(entry)}\n{server.log_text()[-3000:]}")
        say("EXACT", levels(args.tree, "two_servers", "one_card_7"))

        status, answer = request(f"{server.url}/prompt", {"prompt": prompt("killed", 8, 2, steps=40)})
        if status != 200:
            raise RuntimeError(f"the 40-step prompt was refused: {answer}")
        deadline = time.monotonic() + 120
        while not re.search(r"\b[1-9]\d*/40\b", server.log_text()):  # the sampler's progress bar
            if time.monotonic() > deadline:
                raise RuntimeError(f"the 40-step prompt did not start sampling:\n{server.log_text()[-3000:]}")
            time.sleep(0.1)
        say("KILL-NOW")
        cue = time.monotonic()
        entry = wait_for_end(server, answer["prompt_id"], timeout_s=args.timeout + 60)
        if entry["status"]["status_str"] != "error":
            raise RuntimeError(f"the prompt with a killed rank ended {entry['status']['status_str']}")
        say("FAILED", round(time.monotonic() - cue, 1), " ".join(error_text(entry).split()))

        for prefix, seed, cards in (("back", 9, 2), ("one_card_9", 9, 1)):
            entry = run_prompt(server, prompt(prefix, seed, cards))
            if entry["status"]["status_str"] != "success":
                raise RuntimeError(f"{prefix}: {error_text(entry)}\n{server.log_text()[-3000:]}")
        say("EXACT", levels(args.tree, "back", "one_card_9"))
        say("DONE")
        return 0
    finally:
        comfyui_server.stop(server)  # its log stays in root/comfyui.log


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:
        say("ERROR", " ".join(str(exc).split())[:3000])
        raise
