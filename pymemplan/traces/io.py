"""One entry point for reading a trace file of any supported format.

The format is told by content, not by name: a pickle starts with the protocol byte
0x80, gzip with 1f 8b (and may hold either format), our CSV and RMM's with the header
``Thread,Time,Action,Pointer,Size,Stream``.
"""

from __future__ import annotations

import os

from ._files import read_bytes
from .rmm_csv import HEADER_LINE, parse_rmm_csv
from .snapshot import read_snapshot_pickle
from .trace import Trace, TraceError

__all__ = ["detect_format", "read_trace"]

_PICKLE_PROTO = b"\x80"  # every pickle protocol >= 2 starts with PROTO; torch uses >= 2


def detect_format(path: str | os.PathLike, data: bytes | None = None) -> str:
    """``"torch-snapshot"`` or ``"rmm-csv"``; raises :class:`TraceError` otherwise.
    ``data``: the file's (gunzipped) content when the caller has already read it."""
    head = (read_bytes(path) if data is None else data)[:256]
    if head.startswith(_PICKLE_PROTO):
        return "torch-snapshot"
    text = head.decode("utf-8", errors="replace").removeprefix("\ufeff").lstrip()
    if text.replace(" ", "").startswith(HEADER_LINE):
        return "rmm-csv"
    raise TraceError(
        f"{path}: unrecognised trace format; expected a PyTorch memory snapshot pickle "
        f"(torch.cuda.memory._dump_snapshot) or a CSV with header {HEADER_LINE!r} "
        f"(RMM logging_resource_adaptor or pymemplan), optionally gzipped")


def read_trace(path: str | os.PathLike, *, device: int | str | None = None,
               name: str | None = None) -> Trace:
    """Read a trace: a snapshot pickle, or RMM-layout CSV (plain or gzipped).

    ``device`` picks the device of a multi-device snapshot (see
    :func:`read_snapshot_pickle`); it is an error for a CSV, which has one address space.
    """
    data = read_bytes(path)  # read (and gunzip) once; both parsers take the bytes
    fmt = detect_format(path, data)
    if fmt == "torch-snapshot":
        return read_snapshot_pickle(path, device=device, name=name, data=data)
    if device is not None:
        raise TraceError(f"{path}: device={device!r} given, but a CSV trace has no devices")
    return parse_rmm_csv(data, path, name=name)
