"""Liveness and the timeline: live bytes after every op, by category, and the peak.

"Live at op i" means allocated before or by op i and not yet released when op i runs:
the memory op i runs in. The peak over ops is the peak over the whole event sequence,
because releases only ever lower it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .graph import BEFORE_STEP, CATEGORIES, TEMPORARY, StepGraph


@dataclass
class Timeline:
    """``by_category[c][i]``: device bytes of category ``c`` live at op ``i``."""

    by_category: dict[str, np.ndarray]
    total: np.ndarray

    @property
    def peak_index(self) -> int:
        return int(np.argmax(self.total)) if len(self.total) else 0

    @property
    def peak_bytes(self) -> int:
        return int(self.total.max()) if len(self.total) else 0


def live_interval(t, num_ops: int) -> tuple[int, int]:
    """[start, stop) in op indices."""
    start = 0 if t.alloc_op == BEFORE_STEP else t.alloc_op
    stop = num_ops if t.freed_before is None else t.freed_before
    return start, max(stop, start + 1)  # made and dropped between two ops: live at its op


def build_timeline(g: StepGraph) -> Timeline:
    n = max(g.num_ops, 1)
    diff = {c: np.zeros(n + 1, dtype=np.int64) for c in CATEGORIES}
    for t in g.tensors:
        if t.size == 0:
            continue
        start, stop = live_interval(t, n)
        d = diff[t.category]
        d[start] += t.size
        d[min(stop, n)] -= t.size
    by_cat = {c: np.cumsum(d[:-1]) for c, d in diff.items()}
    # Kernel scratch is live only while its op runs: on top of everything live at that op.
    scratch = [(op.index, op.scratch) for op in g.ops if op.scratch]
    if scratch:
        idx, ws = zip(*scratch)
        by_cat[TEMPORARY] = by_cat[TEMPORARY].copy()
        np.add.at(by_cat[TEMPORARY], np.array(idx), np.array(ws, dtype=np.int64))
    total = np.sum(np.stack(list(by_cat.values())), axis=0)
    return Timeline(by_cat, total)


def live_at(g: StepGraph, index: int) -> list:
    """Tensors live at op `index`, largest first."""
    n = max(g.num_ops, 1)
    out = []
    for t in g.tensors:
        start, stop = live_interval(t, n)
        if t.size and start <= index < stop:
            out.append(t)
    out.sort(key=lambda t: -t.size)
    return out
