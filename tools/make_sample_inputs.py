#!/usr/bin/env python3
"""Draw the sample input images of the MiniMax-H3 workflows (additional_files/input/minimax_h3_*.png).

Small flat-colour PNGs drawn here with Pillow, so the workflows run out of the box without
anyone else's pictures. 16:9 at half of 768p; the H3 nodes rescale them to 1344x768.

  tools/make_sample_inputs.py          (re)write the PNGs
  tools/make_sample_inputs.py --check  exit 1 when a committed PNG differs from the drawing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PIL import Image, ImageChops, ImageDraw

# Top level of input/: upstream's LoadImage lists only the files directly in input/, so a
# workflow naming a file in a subfolder opens with "Missing Inputs" errors on the canvas.
OUT_DIR = Path(__file__).resolve().parent.parent / "additional_files" / "input"
SIZE = (672, 384)


def _sky_and_hills(sun_xy: tuple[int, int], sky: str, hills: str) -> Image.Image:
    image = Image.new("RGB", SIZE, sky)
    draw = ImageDraw.Draw(image)
    x, y = sun_xy
    draw.ellipse((x - 34, y - 34, x + 34, y + 34), fill="#ffd23f")
    draw.ellipse((-120, 250, 380, 520), fill=hills)
    draw.ellipse((260, 270, 820, 560), fill="#3b7d3a")
    draw.rectangle((0, 360, SIZE[0], SIZE[1]), fill="#2f6b2e")
    return image


def first_frame() -> Image.Image:
    """Dawn: the sun on the horizon (first frame of the fl2va workflows)."""
    return _sky_and_hills((520, 250), sky="#f4a460", hills="#4f8f3f")


def last_frame() -> Image.Image:
    """Midday: the sun high over the same hills (last frame of the fl2va workflows)."""
    return _sky_and_hills((150, 70), sky="#87ceeb", hills="#5aa845")


def ref_character() -> Image.Image:
    """A small round robot on a plain background (reference 1 of the ref2va workflows)."""
    image = Image.new("RGB", SIZE, "#e8e4da")
    draw = ImageDraw.Draw(image)
    draw.rectangle((286, 170, 386, 300), fill="#c0392b")          # body
    draw.ellipse((281, 80, 391, 180), fill="#ecf0f1", outline="#34495e", width=4)  # head
    draw.ellipse((310, 115, 330, 135), fill="#2c3e50")            # eyes
    draw.ellipse((342, 115, 362, 135), fill="#2c3e50")
    draw.line((336, 80, 336, 50), fill="#34495e", width=4)        # antenna
    draw.ellipse((328, 40, 344, 56), fill="#f1c40f")
    draw.rectangle((296, 300, 318, 350), fill="#7f8c8d")          # legs
    draw.rectangle((354, 300, 376, 350), fill="#7f8c8d")
    draw.rectangle((256, 180, 284, 260), fill="#7f8c8d")          # arms
    draw.rectangle((388, 180, 416, 260), fill="#7f8c8d")
    return image


def ref_scene() -> Image.Image:
    """A lighthouse on a cliff at dusk (reference 2 of the ref2va workflows)."""
    image = Image.new("RGB", SIZE, "#2c3e70")
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 280, SIZE[0], SIZE[1]), fill="#1f4e79")    # sea
    draw.polygon([(380, 384), (430, 230), (672, 210), (672, 384)], fill="#5d4037")  # cliff
    draw.polygon([(505, 225), (525, 110), (555, 110), (575, 222)], fill="#f5f5f5")  # tower
    draw.rectangle((512, 150, 568, 168), fill="#c0392b")
    draw.rectangle((518, 88, 562, 110), fill="#fff59d")           # lamp
    draw.polygon([(518, 96), (300, 60), (300, 140), (518, 104)], fill="#fff9c4")  # beam
    return image


SAMPLES = {
    "minimax_h3_first_frame.png": first_frame,
    "minimax_h3_last_frame.png": last_frame,
    "minimax_h3_ref_character.png": ref_character,
    "minimax_h3_ref_scene.png": ref_scene,
}


def differs(path: Path, image: Image.Image) -> bool:
    if not path.is_file():
        return True
    with Image.open(path) as committed:
        return committed.size != image.size or ImageChops.difference(
            committed.convert("RGB"), image).getbbox() is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for name, draw in SAMPLES.items():
        image, path = draw(), OUT_DIR / name
        if args.check:
            if differs(path, image):
                stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, optimize=True)
        print(f"wrote {path.relative_to(OUT_DIR.parents[2])} ({path.stat().st_size} bytes)")
    if stale:
        print(f"stale sample inputs: {', '.join(stale)}; run: .venv/bin/python "
              f"tools/make_sample_inputs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
