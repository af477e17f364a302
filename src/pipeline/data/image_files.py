"""The image files a user names for prediction: files, folders or glob patterns.

No torch and no decoding here: the workflow lists a `predict` rule's inputs with it at parse
time. Whether a file is a readable image is found out when it is decoded (pipeline.prediction).
"""

from __future__ import annotations

import glob
from collections.abc import Iterable
from pathlib import Path

from pipeline.errors import DataError

# What a folder or a pattern contributes; a file named on its own is taken whatever its name.
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".gif"})
_GLOB_CHARACTERS = frozenset("*?[")


def _is_image_name(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES


def _files_of(item: str) -> list[Path]:
    """The files one item names, in sorted order; an item that names nothing raises. A file or
    folder of that very name is taken as it is, before any pattern: `shot[1].jpg` is a photo's
    name far more often than a pattern matching shot1.jpg."""
    path = Path(item).expanduser()
    if _GLOB_CHARACTERS & set(item) and not path.exists():
        found = sorted(Path(name) for name in glob.glob(item, recursive=True))
        files = [path for path in found if _is_image_name(path)]
        if not files:
            raise DataError(
                f"The pattern {item!r} matches no image file (names ending in "
                f"{', '.join(sorted(IMAGE_SUFFIXES))})."
            )
        return files
    if path.is_dir():
        files = sorted(child for child in path.iterdir() if _is_image_name(child))
        if not files:
            raise DataError(
                f"The folder {path} holds no image file (names ending in "
                f"{', '.join(sorted(IMAGE_SUFFIXES))}); its subfolders are not searched: "
                f"name them, or use a pattern such as '{path}/**/*.jpg'."
            )
        return files
    if path.is_file():
        return [path]
    raise DataError(f"{path} does not exist: name an image file, a folder or a glob pattern.")


def find_images(items: Iterable[str]) -> list[Path]:
    """Every image file the items name, in their order, each once."""
    items = list(items)
    if not items:
        raise DataError("No images given: name image files, folders or glob patterns.")
    found: dict[Path, None] = {}
    for item in items:
        for path in _files_of(str(item)):
            found.setdefault(path, None)
    return list(found)
