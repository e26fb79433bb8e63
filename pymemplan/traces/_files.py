"""Reading trace files as bytes, whatever the compression.

Readers call :func:`read_bytes` so that every format may be gzipped: gzip is recognised
by its magic bytes, not by the file name, so a renamed file still reads.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

from .trace import TraceError

GZIP_MAGIC = b"\x1f\x8b"


def read_bytes(path: str | os.PathLike) -> bytes:
    """The file's content, gunzipped when it starts with the gzip magic bytes."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, expected a trace file") from None
    if data[:2] == GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(f"{path}: corrupt or truncated gzip data ({e})") from None
    return data


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data``, gzipped when the name ends in ``.gz``.

    The gzip header carries no file name and no timestamp, so writing the same trace
    twice gives byte-identical files (shipped sample traces do not churn in git).
    """
    path = Path(path)
    if path.name.endswith(".gz"):
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                                    compresslevel=6, mtime=0) as gz:
            gz.write(data)
    else:
        path.write_bytes(data)


def trace_name(path: str | os.PathLike) -> str:
    """A default trace name: the file name without ``.gz``/``.csv``/``.pickle`` suffixes."""
    name = Path(path).name
    for suffix in (".gz", ".csv", ".pickle", ".pkl"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name or "trace"
