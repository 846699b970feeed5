"""Draw the thumbnail of each example workflow (example_workflows/<name>.jpg).

ComfyUI serves a pack's example_workflows/ folder as it is, and its templates browser shows
`<name>.jpg` beside `<name>.json` as the card's picture. Each thumbnail shows the sample input
images its workflow loads (additional_files/input/, drawn by tools/make_sample_inputs.py) side
by side, with a caption saying what the workflow makes, in how many steps, on how many cards.

    .venv/bin/python tools/make_thumbnails.py          # write them
    .venv/bin/python tools/make_thumbnails.py --check  # compare, write nothing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PIL import Image, ImageChops, ImageDraw, ImageFont, ImageStat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_workflows  # noqa: E402 - a script beside this one

INPUT_DIR = make_workflows.REPO_DIR / "additional_files" / "input"
SIZE = (512, 288)  # 16:9, as the workflows' 1344x768 video
CAPTION_HEIGHT = 56
QUALITY = 88
MAX_MEAN_DIFFERENCE = 2.0  # levels: another JPEG encoder build may round a little differently
# The images each task loads, in the order its H3 node takes them (make_workflows.set_images)
TASK_IMAGES = {"ref2va": ("ref_character", "ref_scene"), "fl2va": ("first_frame", "last_frame")}
TASK_WORDS = {"ref2va": "reference images -> video + audio", "fl2va": "first + last frame -> video + audio"}


def image_files(variant: make_workflows.Variant) -> list[Path]:
    return [INPUT_DIR / f"{make_workflows.SAMPLE_INPUT_PREFIX}{name}.png" for name in TASK_IMAGES[variant.task]]


def caption(variant: make_workflows.Variant) -> str:
    lora = " + Turbo LoRA" if variant.lora else ""
    return f"{TASK_WORDS[variant.task]}: {variant.steps} steps{lora}, {make_workflows.NPU_COUNT} cards"


def draw(variant: make_workflows.Variant) -> Image.Image:
    width, height = SIZE
    thumbnail = Image.new("RGB", SIZE, (24, 24, 28))
    half = width // 2
    for i, path in enumerate(image_files(variant)):
        with Image.open(path) as source:
            picture = source.convert("RGB")
        picture.thumbnail((half - 8, height - CAPTION_HEIGHT - 8))
        x = i * half + (half - picture.width) // 2
        thumbnail.paste(picture, (x, (height - CAPTION_HEIGHT - picture.height) // 2))
    pen = ImageDraw.Draw(thumbnail)
    font = ImageFont.load_default(size=17)
    pen.text((12, height - CAPTION_HEIGHT + 8), caption(variant), fill=(240, 240, 240), font=font)
    pen.text((12, height - CAPTION_HEIGHT + 30), "MiniMax-H3 across the cards (Multi-NPU Parallel Config)",
             fill=(170, 170, 180), font=font)
    return thumbnail


def differs(path: Path, image: Image.Image) -> bool:
    if not path.is_file():
        return True
    with Image.open(path) as committed:
        if committed.size != image.size:
            return True
        difference = ImageChops.difference(committed.convert("RGB"), image)
    return max(ImageStat.Stat(difference).mean) > MAX_MEAN_DIFFERENCE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for variant in make_workflows.VARIANTS:
        image, path = draw(variant), make_workflows.OUT_DIR / f"{variant.name}.jpg"
        if args.check:
            if differs(path, image):
                stale.append(path.name)
            continue
        image.save(path, quality=QUALITY, optimize=True)
        print(f"wrote {path.relative_to(make_workflows.REPO_DIR)} ({path.stat().st_size} bytes)")
    if stale:
        print(f"stale thumbnails: {', '.join(stale)}; run: .venv/bin/python tools/make_thumbnails.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
