"""Which way up a picture is shown: one reading of its orientation for the size check (from
the header) and for the decoder, so the two never disagree."""

from __future__ import annotations

import re

from PIL import Image

_EXIF_ORIENTATION = 0x0112
# what turns the stored pixels upright, for each EXIF orientation but 1 (as shown)
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_AXES = frozenset({5, 6, 7, 8})  # orientations that turn the picture by 90 degrees
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(?:="|>)([0-9])')


def orientation(image: Image.Image) -> int:
    """How the picture is shown (EXIF's 1 to 8), from the header: the EXIF tag, else XMP's
    `tiff:Orientation`, as Pillow's `getexif()` reads them, which the size check and the
    decoder both take from here, so they never disagree.

    Reads the blocks the header carries instead of calling `getexif()`, which decodes a
    whole PNG to look for one.
    """
    raw = image.info.get("exif")
    if raw:
        exif = Image.Exif()
        exif.load(raw)
        if _EXIF_ORIENTATION in exif:
            return int(exif[_EXIF_ORIENTATION])
    xmp = image.info.get("XML:com.adobe.xmp") or image.info.get("xmp")
    if xmp:
        found = _XMP_ORIENTATION.search(xmp.encode() if isinstance(xmp, str) else xmp)
        if found:
            return int(found[1])
    return 1


def oriented_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) of the picture as shown, its orientation applied, from the header."""
    width, height = image.size
    return (height, width) if orientation(image) in _SWAPS_AXES else (width, height)


def upright(image: Image.Image) -> Image.Image:
    """The decoded picture as shown: turned by its orientation (see `orientation`)."""
    method = _UPRIGHT.get(orientation(image))
    return image.transpose(method) if method is not None else image
