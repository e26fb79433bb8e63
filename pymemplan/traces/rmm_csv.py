"""Allocation traces as CSV in the column layout of RAPIDS RMM's logging adaptor.

RMM's ``logging_resource_adaptor`` writes one line per event under the header
``Thread,Time,Action,Pointer,Size,Stream``, with the spdlog pattern ``%t,%H:%M:%S.%f``
before the event's own fields, for example::

    Thread,Time,Action,Pointer,Size,Stream
    140573312345856,14:02:31.123456,allocate,0x7f8a40000000,1024,0x7f8a38001020
    140573312345856,14:02:31.123470,free,0x7f8a40000000,1024,0x7f8a38001020
    140573312345856,14:02:31.123502,allocate failure,(nil),1099511627776,0

Our own files use the same columns, so that RMM's replay benchmark (its
``benchmarks/utilities/log_parser.hpp`` reads Pointer as hex, Size and Stream as decimal)
and our reader accept each other's files. We write Time as seconds with six decimals.

What the reader accepts, and why:

* Pointer: hex, with or without ``0x`` (RMM's parser reads it base 16); ``(nil)``, the
  way glibc prints a null pointer in RMM's "allocate failure" lines, reads as 0.
* Size, Thread: decimal.
* Stream: ``0x``-prefixed hex (what RMM prints for a stream), decimal (what we write),
  or ``(nil)``.
* Time: ``HH:MM:SS.ffffff`` (RMM; read as seconds since midnight, plus a day each time
  the clock wraps past midnight) or a plain number of seconds (ours).
* Action: ``allocate``, ``free``, ``allocate failure``; ``deallocate`` reads as ``free``
  because RMM's own documentation shows it.

Anything else raises :class:`TraceError` naming the file, the line and the problem.
Fields are split on commas without CSV quoting: RMM never quotes, and a plain split
keeps every row on its own physical line, so error messages name the right line.
"""

from __future__ import annotations

import os
import re
from itertools import repeat

import numpy as np

from ._files import read_bytes, trace_name, write_bytes
from ._pairing import pair_events
from .trace import ACTION_NAMES, ALLOC, ALLOC_FAILURE, FREE, Trace, TraceError

HEADER = ("Thread", "Time", "Action", "Pointer", "Size", "Stream")
HEADER_LINE = ",".join(HEADER)
_ACTIONS = {"allocate": ALLOC, "free": FREE, "allocate failure": ALLOC_FAILURE, "deallocate": FREE}
_UNKNOWN_ACTION = 255
_NULL_POINTERS = {"(nil)", "(null)"}  # how glibc (and others) print a null %p
_INT64_MAX = 2**63 - 1
_SECONDS_PER_DAY = 86400.0
_TIME_OF_DAY = re.compile(r"(\d{1,2}):(\d\d):(\d\d)(?:\.(\d{1,9}))?")
_DECIMAL = re.compile(r"\d+")
_HEX = re.compile(r"(?:0[xX])?[0-9a-fA-F]+")


def read_rmm_csv(path: str | os.PathLike, *, drop_unknown_frees: bool = False,
                 name: str | None = None) -> Trace:
    """Read an RMM logging-adaptor CSV log, or one of ours (plain or gzipped).

    Events keep the file's order. A free that gives size 0 takes its allocation's size.
    Zero-byte allocations and their frees are left out (they hold no memory) and counted
    in ``meta["zero_size_allocs"]``. A free of a pointer that is not live raises, unless
    ``drop_unknown_frees`` is set (a log that starts mid-run): then it is left out and
    counted in ``meta["dropped_frees"]``.
    """
    return parse_rmm_csv(read_bytes(path), path, drop_unknown_frees=drop_unknown_frees, name=name)


def parse_rmm_csv(data: bytes, path: str | os.PathLike = "<bytes>", *,
                  drop_unknown_frees: bool = False, name: str | None = None) -> Trace:
    """:func:`read_rmm_csv` on a file's (uncompressed) content; ``path`` names it in errors."""
    text = _decode(path, data)
    lines = text.replace("\r\n", "\n").split("\n")
    return _parse_lines(path, lines, drop_unknown_frees, name)


def write_csv(trace: Trace, path: str | os.PathLike, *, failures: bool = True) -> None:
    """Write ``trace`` as RMM-layout CSV; gzipped when ``path`` ends in ``.gz``.

    Each free is written with its allocation's size (RMM's replay passes it to
    ``deallocate``). Thread is written as 0: a :class:`Trace` has no thread column.
    ``failures=False`` leaves out "allocate failure" rows, which RMM's replay parser
    rejects. Raises :class:`TraceError` naming the event if the trace is not valid.
    """
    action, ptr, stream, time = trace.action, trace.ptr, trace.stream, trace.time
    where = lambda i: f"{trace.name}: event {i}"  # noqa: E731
    for col, what in ((ptr, "pointer"), (stream, "stream")):
        bad = np.flatnonzero(col < 0)
        if len(bad):
            raise TraceError(f"{where(bad[0])}: negative {what} {col[bad[0]]} cannot be written "
                             f"(RMM's format has unsigned pointers and streams)")
    bad = np.flatnonzero(~np.isfinite(time))
    if len(bad):
        raise TraceError(f"{where(bad[0])}: time is {time[bad[0]]}, expected a finite number")
    unknown = np.flatnonzero(~np.isin(action, list(ACTION_NAMES)))
    if len(unknown):
        raise TraceError(f"{where(unknown[0])}: unknown action code {action[unknown[0]]}")
    bad = np.flatnonzero(trace.size < 0)
    if len(bad):
        raise TraceError(f"{where(bad[0])}: negative size {trace.size[bad[0]]}")
    size = pair_events(action, ptr, trace.size, where, refer=lambda i: f"event {i}",
                       drop_zero_size=False).size

    rows = zip(action.tolist(), ptr.tolist(), size.tolist(), stream.tolist(), time.tolist())
    names = ACTION_NAMES
    body = [f"0,{t:.6f},{names[a]},{p:#x},{s},{st}" for a, p, s, st, t in rows
            if failures or a != ALLOC_FAILURE]
    write_bytes(path, ("\n".join([HEADER_LINE, *body]) + "\n").encode("ascii"))


# --- parsing -------------------------------------------------------------------------

def _decode(path, data: bytes) -> str:
    try:
        return data.decode("utf-8").removeprefix("\ufeff")  # a BOM, from Windows editors
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise TraceError(f"{path}: line {line}: not UTF-8 text; is this a CSV trace?") from None


def _parse_lines(path, lines: list[str], drop_unknown_frees: bool, name: str | None) -> Trace:
    # Blank lines (a trailing newline, mostly) are skipped; line numbers stay physical.
    filled = np.fromiter((bool(line) and not line.isspace() for line in lines), dtype=bool,
                         count=len(lines))
    line_no = np.flatnonzero(filled) + 1
    if not len(line_no):
        raise TraceError(f"{path}: empty file, expected the header {HEADER_LINE!r}")
    if len(line_no) < len(lines):
        lines = [lines[i - 1] for i in line_no.tolist()]
    header, rows, header_no, line_no = lines[0], lines[1:], line_no[0], line_no[1:]
    if tuple(f.strip() for f in header.split(",")) != HEADER:
        raise TraceError(f"{path}: line {header_no}: expected the header {HEADER_LINE!r} "
                         f"(RMM logging_resource_adaptor format), got {header[:120]!r}")
    at = lambda i: f"{path}: line {line_no[i]}"  # noqa: E731

    commas = np.fromiter((row.count(",") for row in rows), dtype=np.int64, count=len(rows))
    bad = np.flatnonzero(commas != len(HEADER) - 1)
    if len(bad):
        i = bad[0]
        raise TraceError(f"{at(i)}: {commas[i] + 1} columns, expected {len(HEADER)} "
                         f"({HEADER_LINE}): {rows[i][:120]!r}")
    # One split of the whole body instead of one list per row: millions of small lists
    # cost more than the parsing itself.
    flat = ",".join(rows).split(",") if rows else []
    threads, times, acts, ptrs, sizes, streams = (flat[k::len(HEADER)] for k in range(len(HEADER)))

    action = _parse_actions(acts, at)
    ptr = _parse_pointers(ptrs, at)
    size = _parse_decimal(sizes, at, "size")
    stream = _parse_streams(streams, at)
    time, time_format = _parse_times(times, at)
    thread_ids = _parse_threads(threads, at)

    bad = np.flatnonzero(size < 0)
    if len(bad):
        raise TraceError(f"{at(bad[0])}: negative size {size[bad[0]]}")
    pairing = pair_events(action, ptr, size, at, refer=lambda i: f"line {line_no[i]}",
                          drop_unknown_frees=drop_unknown_frees)
    keep = pairing.keep
    meta = {
        "format": "rmm-csv", "source": str(path), "time_format": time_format,
        "threads": len(thread_ids), "dropped_frees": pairing.dropped_frees,
        "dropped_free_bytes": pairing.dropped_free_bytes,
        "zero_size_allocs": pairing.zero_size_allocs,
    }
    return Trace(action[keep], ptr[keep], pairing.size[keep], stream[keep], time[keep],
                 name=name or trace_name(path), meta=meta)


def _first_bad(values, ok) -> int:
    """Index of the first value for which ``ok(value)`` is false (slow path, errors only)."""
    return next((i for i, v in enumerate(values) if not ok(v)), 0)


def _converts(v: str, convert) -> bool:
    """Whether ``convert(v)`` fits in 64 bits. The slow path asks the same converter as
    the fast path, so it always finds the row the fast path choked on."""
    try:
        np.array([convert(v)], dtype=np.int64 if convert is int else np.float64)
        return True
    except (ValueError, OverflowError):
        return False


def _parse_actions(acts, at) -> np.ndarray:
    get = _ACTIONS.get
    codes = np.fromiter((get(a, _UNKNOWN_ACTION) for a in acts), dtype=np.uint8, count=len(acts))
    bad = np.flatnonzero(codes == _UNKNOWN_ACTION)
    if len(bad):
        raise TraceError(f"{at(bad[0])}: unknown action {acts[bad[0]]!r} "
                         f"(expected one of: allocate, free, allocate failure)")
    return codes


def _parse_decimal(values, at, what: str) -> np.ndarray:
    # Fast path: convert the whole column; on failure find the first bad row to name it.
    try:
        return np.array(list(map(int, values)), dtype=np.int64)
    except (ValueError, OverflowError):
        pass
    i = _first_bad(values, lambda v: _converts(v, int))
    if _DECIMAL.fullmatch(values[i].strip()):
        raise TraceError(f"{at(i)}: {what} {values[i]} does not fit in 64 bits")
    raise TraceError(f"{at(i)}: {what} {values[i]!r} is not a decimal integer")


def _pointer_ok(v: str) -> bool:
    v = v.strip()
    return v in _NULL_POINTERS or (bool(_HEX.fullmatch(v)) and int(v, 16) <= _INT64_MAX)


def _parse_pointers(values, at) -> np.ndarray:
    joined = "".join(values)
    # int(v, 16) also takes a sign and underscores, which no real pointer has.
    if "-" not in joined and "_" not in joined and "+" not in joined:
        try:
            if "(" in joined:  # null pointers printed as (nil)
                ints = [0 if v in _NULL_POINTERS else int(v, 16) for v in values]
            else:
                ints = list(map(int, values, repeat(16)))
            return np.array(ints, dtype=np.int64)
        except (ValueError, OverflowError):
            pass
    i = _first_bad(values, _pointer_ok)
    if _HEX.fullmatch(values[i].strip()):
        raise TraceError(f"{at(i)}: pointer {values[i]} does not fit in 63 bits")
    raise TraceError(f"{at(i)}: pointer {values[i]!r} is not a hexadecimal address "
                     f"(like 0x7f8a40000000)")


def _parse_stream(v: str) -> int | None:
    s = v.strip()
    if s in _NULL_POINTERS:
        return 0
    if s[:2] in ("0x", "0X") and _HEX.fullmatch(s):
        n = int(s, 16)
    elif _DECIMAL.fullmatch(s):
        n = int(s)
    else:
        return None
    return n if n <= _INT64_MAX else None


def _parse_streams(values, at) -> np.ndarray:
    # A run uses a handful of streams: parse each distinct string once.
    parsed = {v: _parse_stream(v) for v in set(values)}
    for v, n in parsed.items():
        if n is None:
            i = values.index(v)
            s = v.strip()
            if (s[:2] in ("0x", "0X") and _HEX.fullmatch(s)) or _DECIMAL.fullmatch(s):
                raise TraceError(f"{at(i)}: stream {s} does not fit in 63 bits")
            raise TraceError(f"{at(i)}: stream {v!r} is neither 0x-prefixed hex nor decimal")
    return np.array([parsed[v] for v in values], dtype=np.int64)


def _parse_threads(values, at) -> set:
    distinct = set(values)
    for v in distinct:
        if not _DECIMAL.fullmatch(v.strip()):
            i = values.index(v)
            raise TraceError(f"{at(i)}: thread id {v!r} is not a decimal integer")
    return distinct


def _parse_times(values, at) -> tuple[np.ndarray, str]:
    """Seconds as float64, and which format the column used."""
    if not values:
        return np.zeros(0), "seconds"
    if ":" not in values[0]:
        try:
            t = np.array(list(map(float, values)), dtype=np.float64)
        except ValueError:
            i = _first_bad(values, lambda v: _converts(v, float))
            raise TraceError(f"{at(i)}: time {values[i]!r} is not a number of seconds") from None
        bad = np.flatnonzero(~np.isfinite(t))
        if len(bad):
            raise TraceError(f"{at(bad[0])}: time {values[bad[0]]!r} is not finite")
        return t, "seconds"
    t = _times_of_day_fixed_width(values)
    if t is None:
        t = np.empty(len(values))
        for i, v in enumerate(values):
            m = _TIME_OF_DAY.fullmatch(v.strip())
            if m is None:
                raise TraceError(f"{at(i)}: time {v!r} is not HH:MM:SS.ffffff "
                                 f"(as RMM writes) nor a number of seconds")
            h, mi, s, frac = m.groups()
            t[i] = int(h) * 3600 + int(mi) * 60 + int(s) + (int(frac) / 10 ** len(frac) if frac else 0.0)
    # The clock is time of day: a large step backwards is midnight passing. Small steps
    # back are kept (threads log slightly out of order).
    wraps = np.cumsum(np.diff(t, prepend=t[0]) < -_SECONDS_PER_DAY / 2)
    return t + wraps * _SECONDS_PER_DAY, "time-of-day"


def _times_of_day_fixed_width(values) -> np.ndarray | None:
    """Vectorised parse of RMM's ``HH:MM:SS.ffffff`` (always 15 characters); ``None``
    when any value has another shape, so the caller takes the per-row path."""
    width = 15
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    if (lengths != width).any():
        return None
    try:
        raw = "".join(values).encode("ascii")
    except UnicodeEncodeError:
        return None
    c = np.frombuffer(raw, dtype=np.uint8).reshape(len(values), width)
    digits = c - np.uint8(ord("0"))  # wraps below '0', so "is a digit" is "<= 9"
    digit_cols = [0, 1, 3, 4, 6, 7, *range(9, width)]
    if not ((c[:, [2, 5]] == ord(":")).all() and (c[:, 8] == ord(".")).all()
            and (digits[:, digit_cols] <= 9).all()):
        return None
    d = digits.astype(np.int64)
    seconds = (d[:, 0] * 10 + d[:, 1]) * 3600 + (d[:, 3] * 10 + d[:, 4]) * 60 + d[:, 6] * 10 + d[:, 7]
    micros = np.zeros(len(values), dtype=np.int64)
    for k in range(9, width):
        micros = micros * 10 + d[:, k]
    return seconds + micros / 1e6
