"""Small recorded traces shipped with the package (made by benchmarks/make_sample_traces.py),
so that replay and the CLI have something real to run when the user names no file."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"


def builtin_traces() -> list[Path]:
    """Paths of the shipped traces (gzipped CSV), sorted by name."""
    return sorted(DATA_DIR.glob("*.csv.gz"))
