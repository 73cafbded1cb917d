"""walbuf.Image: an image encoded once as PNG when it is logged, and kept inside the record.

Offline wandb writes one file per logged image, which on clusters runs into
inode quotas (wandb issue 1383) and loses images on the way to W&B (wandb
issues 11539, 10035, 4611). walbuf keeps each image in its record, as
base64 text in the record's JSON (``{"_type": "walbuf-image", "png": ...}``):
one log() is one row of the buffer, committed at once, and every guarantee of
records (a kill -9 loses none, directory buffers deliver them, prune
reclaims them, a bad one is quarantined) holds for images unchanged. The
cost is base64's third more bytes than the PNG. The syncer hands each image
to wandb as a ``wandb.Image`` of the same PNG (see walbuf.syncer.wandb.media).

Needs Pillow, in the writer to encode and in the syncer for wandb.Image:
``pip install 'walbuf[media]'``.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from .errors import NOTHING_WRITTEN, MetricTypeError, MetricValueError, MissingExtraError

TYPE = "walbuf-image"
"""The ``_type`` of an image as stored in a record."""
MAX_PNG_BYTES = 4 << 20
"""The largest image walbuf takes, as PNG: walbuf's own limit, so that a record stays a
row a sync reads in one go (a 4 MiB PNG is a 2048x2048 photograph)."""
MAX_PIXELS = 89_478_485
"""Pillow's default Image.MAX_IMAGE_PIXELS: wandb.Image opens the file with Pillow at
sync, which refuses an image of more than twice as many pixels as a decompression bomb."""
MAX_CAPTION = 10_000
"""Characters of a caption: walbuf's own limit, far below W&B's 1 MB for a value."""
_PNG_MODES = frozenset({"1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"})
"""The modes Pillow writes as PNG as they are (PIL/PngImagePlugin.py, _OUTMODES); others become RGB(A)."""


class ImageJSON(TypedDict):
    """An image as stored in the buffer."""

    _type: Literal["walbuf-image"]
    png: str  # the PNG file, base64
    width: int
    height: int
    caption: str | None


@dataclass(frozen=True, init=False)
class Image:
    """An image, as PNG bytes, with an optional caption.

    ``data``: a numpy array (or nested lists) of shape HxW (grey), HxWx1,
    HxWx3 (RGB) or HxWx4 (RGBA), of integers from 0 to 255 or floats from 0
    to 1 (scaled by 255); a PIL image; or the path of an image file Pillow
    reads (a PNG file is kept byte for byte, any other format is encoded as
    PNG). It is encoded when the Image is made, so log() stores it at once.

    Raises MetricValueError for an image over MAX_PNG_BYTES as PNG or
    MAX_PIXELS, values out of range, a shape that is not an image, or a file
    Pillow cannot read; MetricTypeError for data of another kind; and
    MissingExtraError if Pillow (or numpy, for arrays) is not installed.
    """

    png: bytes
    caption: str | None
    width: int
    height: int

    def __init__(self, data: Any, caption: str | None = None) -> None:
        _check_caption(caption)
        pil = _pillow()
        if isinstance(data, (str, os.PathLike)):
            png = _from_path(pil, os.fspath(data))
        elif isinstance(data, pil.Image):
            png = _encode(pil, data)
        else:
            png = _encode(pil, _from_array(pil, data))
        self._set(png, caption)

    def _set(self, png: bytes, caption: str | None) -> None:
        if len(png) > MAX_PNG_BYTES:
            raise MetricValueError(
                f"the image is {len(png):,} bytes as PNG, over walbuf's limit of {MAX_PNG_BYTES:,}; log it smaller",
                NOTHING_WRITTEN,
            )
        width, height = _size(png)
        object.__setattr__(self, "png", png)
        object.__setattr__(self, "caption", caption)
        object.__setattr__(self, "width", width)
        object.__setattr__(self, "height", height)

    @classmethod
    def from_png(cls, png: bytes, caption: str | None = None) -> Image:
        """An image given as PNG bytes (checked to be a PNG image, not decoded); needs no Pillow."""
        if not isinstance(png, bytes):
            raise MetricTypeError(f"from_png takes bytes, not {type(png).__qualname__}")
        _check_caption(caption)
        image = cls.__new__(cls)
        image._set(png, caption)
        return image

    def to_json(self) -> ImageJSON:
        """The form stored in the buffer: the PNG as base64 text, its size and caption."""
        return {
            "_type": "walbuf-image",
            "png": base64.b64encode(self.png).decode("ascii"),
            "width": self.width,
            "height": self.height,
            "caption": self.caption,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Image:
        """The image of its stored form (see :func:`stored`)."""
        return cls.from_png(base64.b64decode(value["png"]), value["caption"])

    def __repr__(self) -> str:
        caption = f", caption={self.caption!r}" if self.caption is not None else ""
        return f"walbuf.Image({self.width}x{self.height}, {len(self.png):,} bytes of PNG{caption})"


def stored(name: str, value: Mapping[Any, Any]) -> dict[str, Any] | None:
    """``value`` if it is an image as stored, checked; None if it is not one (a nested dict).

    The check is cheap (no decoding of the PNG): the keys, the types, the
    size. Raises MetricValueError if it says it is an image but is not a valid one.
    """
    if value.get("_type") != TYPE:
        return None
    problem = None
    if set(value) != {"_type", "png", "width", "height", "caption"}:
        problem = "keys other than _type, png, width, height and caption"
    elif not isinstance(value["png"], str) or len(value["png"]) > base64_size(MAX_PNG_BYTES):
        problem = f"png must be base64 text of at most {MAX_PNG_BYTES:,} bytes"
    elif not all(type(value[k]) is int and 0 < value[k] for k in ("width", "height")):
        problem = "width and height must be ints > 0"
    elif value["width"] * value["height"] > MAX_PIXELS:
        problem = f"it has more than {MAX_PIXELS:,} pixels"
    elif value["caption"] is not None and (
        not isinstance(value["caption"], str) or len(value["caption"]) > MAX_CAPTION or "\x00" in value["caption"]
    ):
        problem = f"caption must be None or text of at most {MAX_CAPTION:,} characters, without a NUL"
    if problem is not None:
        raise MetricValueError(f"metric {name!r} is marked an image but is not one: {problem}", NOTHING_WRITTEN)
    return dict(value)


def base64_size(size: int) -> int:
    """The length of ``size`` bytes as base64 text."""
    return (size + 2) // 3 * 4


def png_of(value: Mapping[str, Any]) -> bytes:
    """The PNG bytes of a stored image; MetricValueError if they are not base64."""
    try:
        return base64.b64decode(value["png"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MetricValueError(f"the image's png is not base64: {exc}") from None


def _check_caption(caption: Any) -> None:
    if caption is None:
        return
    if not isinstance(caption, str):
        raise MetricTypeError(f"an Image's caption must be a str or None, not {type(caption).__qualname__}")
    if len(caption) > MAX_CAPTION:
        raise MetricValueError(f"an Image's caption has {len(caption):,} characters, over {MAX_CAPTION:,}")
    if "\x00" in caption:
        raise MetricValueError("an Image's caption holds a NUL character, which W&B does not keep")
    try:
        caption.encode("utf-8")
    except UnicodeEncodeError:
        raise MetricValueError("an Image's caption is not valid text (it holds a lone surrogate)") from None


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _size(png: bytes) -> tuple[int, int]:
    """Width and height from a PNG's header (its first chunk, IHDR), without decoding it."""
    if len(png) < 24 or not png.startswith(_PNG_SIGNATURE) or png[12:16] != b"IHDR":
        raise MetricValueError("the image's bytes are not a PNG file", NOTHING_WRITTEN)
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    if not (width and height) or width * height > MAX_PIXELS:
        raise MetricValueError(
            f"the image is {width}x{height} pixels; walbuf takes from 1 to {MAX_PIXELS:,}"
            " (Pillow's limit, which wandb.Image uses at sync)",
            NOTHING_WRITTEN,
        )
    return width, height


def _pillow() -> Any:
    try:
        import PIL.Image
    except ImportError:
        raise MissingExtraError("walbuf.Image needs Pillow: pip install 'walbuf[media]' (or pillow)") from None
    return PIL.Image


def _from_path(pil: Any, path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise MetricValueError(f"cannot read the image file {path!r}: {exc.strerror or exc}") from None
    try:
        with pil.open(io.BytesIO(data)) as image:
            image.load()  # decodes it all: a damaged file fails here, not at sync
            if image.format == "PNG":
                return data
            return _encode(pil, image)
    except (
        OSError,
        SyntaxError,
        ValueError,
        pil.DecompressionBombError,
    ) as exc:  # reading bytes in memory: about the data
        raise MetricValueError(f"Pillow cannot read {path!r} as an image: {exc}") from None


def _encode(pil: Any, image: Any) -> bytes:
    if image.width * image.height > MAX_PIXELS:
        raise MetricValueError(
            f"the image is {image.width}x{image.height} pixels, over {MAX_PIXELS:,}"
            " (Pillow's limit, which wandb.Image uses at sync)",
            NOTHING_WRITTEN,
        )
    if image.mode not in _PNG_MODES:
        image = image.convert("RGBA" if "A" in image.mode else "RGB")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _from_array(pil: Any, data: Any) -> Any:
    """A PIL image of an HxW, HxWx1, HxWx3 or HxWx4 array of 0..255 integers or 0..1 floats."""
    if type(data).__module__.startswith("torch"):
        raise MetricTypeError(
            "walbuf.Image takes a numpy array of HxWxC, not a torch tensor (usually CxHxW):"
            " give tensor.permute(1, 2, 0).cpu().numpy()"
        )
    try:
        import numpy as np
    except ImportError:
        raise MissingExtraError("walbuf.Image of an array needs numpy: pip install 'walbuf[media]'") from None
    try:
        array = np.asarray(data)
    except (TypeError, ValueError) as exc:
        raise MetricTypeError(f"walbuf.Image cannot read a {type(data).__qualname__} as an array: {exc}") from None
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))) or 0 in array.shape:
        raise MetricValueError(
            f"an image array has shape HxW, HxWx1, HxWx3 or HxWx4, not {array.shape}", NOTHING_WRITTEN
        )
    if array.dtype == np.uint8:
        pass
    elif array.dtype.kind in "iu":
        if array.min() < 0 or array.max() > 255:
            raise MetricValueError("an image array of integers holds values from 0 to 255", NOTHING_WRITTEN)
        array = array.astype(np.uint8)
    elif array.dtype.kind == "f":
        if not (np.isfinite(array).all() and array.min() >= 0 and array.max() <= 1):
            raise MetricValueError(
                "an image array of floats holds values from 0 to 1 (no NaN); scale it, or give uint8", NOTHING_WRITTEN
            )
        array = (array * 255).round().astype(np.uint8)
    else:
        raise MetricTypeError(f"an image array holds integers or floats, not {array.dtype}", NOTHING_WRITTEN)
    return pil.fromarray(np.ascontiguousarray(array))  # uint8 HxW, HxWx3, HxWx4: L, RGB, RGBA
