#!/usr/bin/env python3
"""The workflows' real length on CPU ranks: one sampling step of a tiny H3 DiT at 1344x768, 15 s
(109,952 tokens), through upstream's loader and `comfy.sample.sample`, at 1 card and at W CPU
ranks set up as the MultiNPUParallelConfig node sets up the DiT. Each run is its own process
(its peak RSS is the figure); the runs go one after the other, never side by side.

    COMFYUI_DIR=TREE python bench/bench_real_length.py [--seconds 15] [--cards 4]

Needs a Python with the tree's requirements (and comfy-kitchen: the DiT is the e2e suite's tiny
pruned int8 ConvRot file). Prints per run the peak RSS and the seconds, the 1-card vs W-rank
relative difference of the sampled latents, and the JSON summary on the last line.
Baseline: the same step on 1 card (upstream's own attention sizing, nothing shared).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
FPS = 24
GIB = 2 ** 30


def import_upstream():
    tree = os.environ.get("COMFYUI_DIR")
    if not tree:
        raise SystemExit("COMFYUI_DIR is not set: name a ComfyUI checkout with MiniMax-H3")
    sys.path.append(tree)  # after this repository: comfy.multidevice stays ours
    from tests.upstream import standins
    standins.install()  # torchvision/torchaudio stand-ins (never called on these paths)
    import comfy.cli_args
    comfy.cli_args.args.cpu = True


def frames_for(seconds: float) -> int:
    """H3's valid lengths are 17k+5 frames: the first one at or above `seconds` at 24 fps."""
    k = max(0, -(-(round(seconds * FPS) - 5) // 17))
    return 17 * k + 5


def make_file(path: str) -> None:
    import safetensors.torch
    from comfy.multidevice.tryout.models import dit_state_dict
    state = dit_state_dict(1)
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, path)


def run_one(path: str, cards: int, width: int, height: int, frames: int, out: str) -> dict:
    import torch
    import comfy.sample
    import comfy.sd
    from comfy_extras import nodes_minimax_h3
    from comfy.multidevice.comm.group import SequenceParallelCoordinator
    from comfy.multidevice.roles.dit import sequence_parallel_dit
    from comfy.multidevice.tryout.models import DIT

    model = comfy.sd.load_diffusion_model(path)
    latent = nodes_minimax_h3._empty_av_latent(width, height, frames)[0]["samples"]
    text = torch.randn(1, 64, DIT["text_dim"], generator=torch.Generator().manual_seed(3))
    positive = [[text, {}]]
    coordinator = None
    if cards > 1:
        coordinator = SequenceParallelCoordinator(["cpu"] * cards, backend="peer", timeout_s=3600)
        model = sequence_parallel_dit(model, coordinator.devices, coordinator)
    noise = comfy.sample.prepare_noise(latent, 0)
    start = time.perf_counter()
    with torch.no_grad():  # as ComfyUI samples (inference mode breaks the quantized weights' move)
        sampled = comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", positive, positive, latent,
                                      seed=0, disable_pbar=True)
    seconds = time.perf_counter() - start
    if coordinator is not None:
        coordinator.close()
    parts = list(sampled.unbind()) if getattr(sampled, "is_nested", False) else [sampled]
    torch.save([p.contiguous() for p in parts], out)
    return {"cards": cards, "seconds": round(seconds, 1),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 2)}


def child(argv) -> int:
    import_upstream()
    kind, *rest = argv
    if kind == "make":
        make_file(rest[0])
        return 0
    path, cards, width, height, frames, out = rest
    print("RESULT " + json.dumps(run_one(path, int(cards), int(width), int(height), int(frames), out)), flush=True)
    return 0


def spawn(*args) -> dict | None:
    proc = subprocess.run([sys.executable, __file__, "--child", "run", *map(str, args)], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0:
        killed = " (SIGKILL: the kernel, e.g. out of memory)" if proc.returncode == -9 else ""
        return {"failed": f"exit {proc.returncode}{killed}",
                "stderr_tail": proc.stderr[-800:]}
    return json.loads(lines[-1][7:]) if lines else None


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--cards", type=int, default=4)
    args = parser.parse_args()
    frames = frames_for(args.seconds)
    import torch
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny_h3_dit.safetensors")
        made = subprocess.run([sys.executable, __file__, "--child", "make", path])
        if made.returncode != 0:
            return made.returncode
        runs = {}
        for cards in (1, args.cards):
            out = os.path.join(tmp, f"out_{cards}.pt")
            runs[cards] = spawn(path, cards, args.width, args.height, frames, out)
            print(f"{cards} card(s): {runs[cards]}", flush=True)
        summary = {"width": args.width, "height": args.height, "frames": frames, "seconds": args.seconds,
                   "one_card": runs[1], f"cards_{args.cards}": runs[args.cards]}
        if all(r and "failed" not in r for r in runs.values()):
            a, b = (torch.load(os.path.join(tmp, f"out_{c}.pt")) for c in (args.cards, 1))
            summary["rel_diff"] = max(float((x - y).norm() / y.norm()) for x, y in zip(a, b))
            summary["peak_ratio"] = round(runs[args.cards]["peak_rss_gib"] / runs[1]["peak_rss_gib"], 2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
