"""Inputs named by URL are fetched only when the user asks for it (docs/security.md).

detectron2 and fvcore open any ``http(s)://`` name through iopath, which downloads it and caches
it under ``$HOME``; ``detectron2://`` names are the model zoo's files on dl.fbaipublicfiles.com. A
config file from elsewhere could thus make a run fetch whatever it names. Here a URL is refused
unless the command line opts in (``--allow-network``); with it, ``fetch`` reads the bytes itself,
bounded by a cap, so that what was fetched goes through the same checks as a local file before
anything else reads it. ``file://`` names a local path, not the network.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote, urlsplit

from contrastive_transfer.cli import UserError

# detectron2's model-zoo prefix (detectron2.utils.file_io.Detectron2Handler) and its location
MODEL_ZOO_PREFIX = "detectron2://"
MODEL_ZOO_URL = "https://dl.fbaipublicfiles.com/detectron2/"
NETWORK_SCHEMES = ("http://", "https://", MODEL_ZOO_PREFIX)
OPT_IN = "--allow-network"
TIMEOUT_S = 60


class NetworkRefused(UserError, ValueError):
    """A URL named where the user did not allow fetching, or a fetch that failed or ran too large."""


def is_url(name: str) -> bool:
    """Whether opening ``name`` would reach the network."""
    return isinstance(name, str) and name.lower().startswith(NETWORK_SCHEMES)


def local_name(name: str) -> str:
    """``file://`` names as the local path they mean; anything else as it is."""
    if isinstance(name, str) and name.lower().startswith("file://"):
        parts = urlsplit(name)
        return unquote(parts.path) if parts.netloc in ("", "localhost") else name
    return name


def _refuse_unless(allow: bool, url: str, what: str) -> str:
    if not allow:
        raise NetworkRefused(
            f"{what} {url}: is a URL; nothing is downloaded unless the command line allows it ({OPT_IN}): "
            "pass the flag, or download the file yourself and give its local path"
        )
    return MODEL_ZOO_URL + url[len(MODEL_ZOO_PREFIX) :] if url.lower().startswith(MODEL_ZOO_PREFIX) else url


def _chunks(url: str, what: str, allow: bool, max_bytes: int) -> Iterator[bytes]:
    """The bytes at ``url`` (a ``detectron2://`` name mapped to the model zoo) in pieces, at most
    ``max_bytes`` in all; NetworkRefused in one line when ``allow`` is off, the fetch fails or the
    file is larger."""
    real, total = _refuse_unless(allow, url, what), 0
    try:
        with urllib.request.urlopen(real, timeout=TIMEOUT_S) as response:
            while chunk := response.read(min(2**20, max_bytes + 1 - total)):
                total += len(chunk)
                if total > max_bytes:
                    raise NetworkRefused(f"{what} {url}: larger than {max_bytes} bytes, the cap for this kind of file")
                yield chunk
    except NetworkRefused:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise NetworkRefused(f"{what} {url}: could not be fetched ({' '.join(str(e).split())})") from None


def fetch(url: str, what: str, allow: bool, max_bytes: int) -> bytes:
    """The bytes at ``url`` (``_chunks``), for small files such as configs."""
    return b"".join(_chunks(url, what, allow, max_bytes))


def fetch_to(url: str, dest: Path, what: str, allow: bool, max_bytes: int) -> Path:
    """The file at ``url`` (``_chunks``) written to ``dest`` by the project's writer (``atomic_write``)."""
    from contrastive_transfer.cli import atomic_write

    _refuse_unless(allow, url, what)  # before anything is created

    def write(f) -> None:
        for chunk in _chunks(url, what, allow, max_bytes):
            f.write(chunk)

    return atomic_write(dest, write)
