"""Image URLs of a request -> RGB PIL images, within the limits of ``MultiModalConfig``.

Security rule: a ``data:`` URL is decoded in place; an ``http(s)`` URL is fetched only when its
host is listed in ``--allowed_media_domains`` (empty by default), with a timeout, a byte cap and
no redirect to another host, so a request can never make the server fetch an arbitrary URL.
The pixel count is checked from the header before any pixel is decoded (decompression bombs),
and the decoded format must be one of PNG, JPEG, WebP and GIF (its first frame). Every failure
is an ``ImageError`` (a ``ValueError``: HTTP 400) that the caller prefixes with the part's name.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import urllib.parse
import urllib.request
from typing import Any

from bladellm.config import MultiModalConfig

# MIME type -> Pillow's format name.
IMAGE_MIME_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG",
                    "image/webp": "WEBP", "image/gif": "GIF"}
_FORMATS = frozenset(IMAGE_MIME_TYPES.values())


class ImageError(ValueError):
    """An image a request sent that cannot be used: broken, too big, or not allowed."""


def load_image_url(url: Any, config: MultiModalConfig) -> Any:
    """The RGB image a ``data:`` or allowed ``http(s)`` URL holds."""
    if not isinstance(url, str) or not url:
        raise ImageError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        mime, data = _parse_data_url(url, config.max_image_nbytes)
    elif scheme in ("http", "https"):
        mime, data = _fetch(url, config)
    else:
        raise ImageError(f"unsupported image URL scheme {scheme!r}: send a data: URL "
                         f"(data:image/png;base64,...)")
    return decode_image(data, config, mime)


def check_image(image: Any, config: MultiModalConfig) -> Any:
    """A PIL image handed over in process (``LLM.generate``): checked for size, as RGB."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ImageError(f"expected a PIL.Image.Image, got {type(image).__name__}")
    _check_pixels(image.size, config)
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_image(data: bytes, config: MultiModalConfig, mime: str | None = None) -> Any:
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Exception as e:  # UnidentifiedImageError, truncated headers, ...
        raise ImageError(f"cannot decode the image: {type(e).__name__}: {e}") from None
    if image.format not in _FORMATS:
        raise ImageError(f"image format {image.format} is not supported "
                         f"(PNG, JPEG, WebP or GIF)")
    if mime is not None and IMAGE_MIME_TYPES[mime] != image.format:
        raise ImageError(f"the URL says {mime} but the data is {image.format}")
    _check_pixels(image.size, config)
    try:
        image.seek(0)  # a GIF's (or animated WebP's) first frame
        image.load()
        return image.convert("RGB")
    except Exception as e:  # truncated data, bad chunks, a bomb that lied in its header
        raise ImageError(f"cannot decode the image: {type(e).__name__}: {e}") from None


def _check_pixels(size: tuple[int, int], config: MultiModalConfig) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageError(f"image has an empty size {width}x{height}")
    if width * height > config.max_image_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels, above the "
                         f"server's limit of {config.max_image_pixels} (--max_image_pixels)")


def _parse_data_url(url: str, max_bytes: int) -> tuple[str, bytes]:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise ImageError("a data: URL must look like data:image/png;base64,<data>")
    params = header.split(";")
    mime = params[0].strip().lower()
    if mime not in IMAGE_MIME_TYPES:
        raise ImageError(f"unsupported MIME type {mime or '(none)'!r}; expected one of "
                         f"{', '.join(sorted(IMAGE_MIME_TYPES))}")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise ImageError("a data: URL image must be base64-encoded (data:<mime>;base64,...)")
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:  # before decoding: cheap
        raise ImageError(f"image is larger than the server's limit of {max_bytes} bytes "
                         f"(--max_image_bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL's base64 payload is invalid") from None
    if len(data) > max_bytes:
        raise ImageError(f"image is {len(data)} bytes, above the server's limit of "
                         f"{max_bytes} (--max_image_bytes)")
    return mime, data


class _SameHostRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect may not leave the allowed hosts."""

    def __init__(self, allowed: set[str]) -> None:
        self.allowed = allowed

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        host = urllib.parse.urlsplit(newurl).hostname
        if host not in self.allowed:
            raise ImageError(f"the image URL redirects to {host!r}, which is not in "
                             f"--allowed_media_domains")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, config: MultiModalConfig) -> tuple[str | None, bytes]:
    allowed = set(config.allowed_media_domains or ())
    host = urllib.parse.urlsplit(url).hostname
    if host not in allowed:
        raise ImageError(f"fetching image URLs from {host!r} is not allowed: the server "
                         f"fetches only hosts listed in --allowed_media_domains; send the "
                         f"image as a data: URL instead")
    limit = config.max_image_nbytes
    timeout = config.media_fetch_timeout
    # The socket timeout bounds each read; the deadline bounds the whole body, so a server
    # that trickles bytes cannot hold the thread longer than the timeout either.
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(_SameHostRedirects(allowed))
    try:
        with opener.open(url, timeout=timeout) as resp:
            mime = (resp.headers.get_content_type() or "").lower()
            chunks, size = [], 0
            while size <= limit:
                chunk = resp.read1(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if time.monotonic() > deadline:
                    raise ImageError(f"fetching the image URL took longer than {timeout} s "
                                     f"(--media_fetch_timeout)")
            data = b"".join(chunks)
    except ImageError:
        raise
    except Exception as e:  # URLError, HTTPError, timeouts
        raise ImageError(f"cannot fetch the image URL: {type(e).__name__}: {e}") from None
    if len(data) > limit:
        raise ImageError(f"the image at the URL is larger than the server's limit of "
                         f"{limit} bytes (--max_image_bytes)")
    if mime not in IMAGE_MIME_TYPES:
        raise ImageError(f"the image URL answered with Content-Type {mime!r}, not an image "
                         f"type this server accepts")
    return mime, data
