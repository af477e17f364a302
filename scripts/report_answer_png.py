"""Picture the answer section of a real run's report, for the README (docs/report-answer.png).

    make report
    .venv/bin/python scripts/report_answer_png.py results/report.html docs/report-answer.png

The page is the report itself with every section but the answer left out (its header and
stylesheet kept), rendered by headless Chromium through the browser tests' own machinery
(tests/report_page.py), then cropped to what it shows. Tests never write into the repository:
only this script, run by hand, writes the picture.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageChops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from report_page import find_chromium, headless_chromium

WIDTH = 1100
HEIGHT = 2400  # taller than any answer section: the picture is cropped to its content
MARGIN = 16
SECTION = re.compile(r'<section id="(?P<id>[^"]*)">.*?</section>\n?', re.DOTALL)
NAV = re.compile(r"<nav>.*?</nav>\n?", re.DOTALL)


def answer_only(report: str) -> str:
    """The report's page with its answer section alone: no navigation, no other section."""
    if '<section id="answer">' not in report:
        raise ValueError("the page has no answer section: is it a pipeline report?")
    without_nav = NAV.sub("", report)
    return SECTION.sub(lambda m: m[0] if m["id"] == "answer" else "", without_nav)


def crop_to_content(picture: Image.Image) -> Image.Image:
    """Cut the empty page below (and beside) what is drawn, keeping a small margin."""
    rgb = picture.convert("RGB")
    background = Image.new("RGB", rgb.size, rgb.getpixel((rgb.width - 1, rgb.height - 1)))
    box = ImageChops.difference(rgb, background).getbbox()
    if box is None:
        raise ValueError("the rendered page is blank")
    left, top, right, bottom = box
    return rgb.crop(
        (
            max(0, left - MARGIN),
            max(0, top - MARGIN),
            min(rgb.width, right + MARGIN),
            min(rgb.height, bottom + MARGIN),
        )
    )


def picture(report: Path, out: Path, browser: str) -> Path:
    with tempfile.TemporaryDirectory() as scratch:
        page, shot = Path(scratch) / "answer.html", Path(scratch) / "shot.png"
        page.write_text(answer_only(report.read_text(encoding="utf-8")), encoding="utf-8")
        done = headless_chromium(
            browser,
            Path(scratch) / "profile",
            f"--screenshot={shot}",
            f"--window-size={WIDTH},{HEIGHT}",
            "--force-device-scale-factor=1",
            "--hide-scrollbars",
            page.as_uri(),
        )
        if done.returncode != 0 or not shot.exists():
            raise RuntimeError(f"Chromium could not render {page}: {done.stderr[-1000:]}")
        with Image.open(shot) as image:
            crop_to_content(image).save(out, optimize=True)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="a real run's results/report.html")
    parser.add_argument("out", type=Path, help="the picture to write, e.g. docs/report-answer.png")
    args = parser.parse_args(argv)
    browser = find_chromium()
    if browser is None:
        print("error: Chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 2
    try:
        print(f"wrote {picture(args.report, args.out, browser)}")
    except (OSError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
