"""Reports of a :class:`~pymemplan.planner.api.MemoryTrace`: rich table, PNG plot, JSON."""

from __future__ import annotations

import io
import sys

from ..units import format_bytes
from .graph import CATEGORIES

_COLORS = {"parameter": "#4C72B0", "buffer": "#8172B3", "gradient": "#DD8452",
           "optimizer_state": "#937860", "input": "#64B5CD", "activation": "#55A868",
           "temporary": "#C44E52"}
_PHASE_SHADE = {"forward": "#f2f2f2", "backward": "#e0e8f0", "optimizer": "#f0e8e0"}


def _tables(t, top: int):
    from rich.table import Table

    g = t.graph
    meta = g.meta
    head = Table(title=f"Predicted memory of one training step on {g.device}", show_header=False)
    head.add_column("", style="bold")
    head.add_column("")
    head.add_row("model", f"{meta.get('model', '')} {meta.get('inputs', '')}")
    opt = meta.get("optimizer")
    if opt:
        opt += " (foreach)" if meta.get("foreach") else ""
    head.add_row("step", "forward + backward" + (f" + {opt} step" if opt else ""))
    if meta.get("autocast"):
        head.add_row("autocast", meta["autocast"])
    pk = t.peak_op
    head.add_row("peak", f"[bold]{format_bytes(t.peak_bytes)}[/bold] ({t.peak_bytes:,} B)")
    if pk is not None:
        where = f"op {pk.index} of {g.num_ops}: {pk.name} ({pk.phase}"
        where += f", {pk.module})" if pk.module else ")"
        head.add_row("at", where)
    for p, b in t.phase_peaks().items():
        head.add_row(f"{p} peak", format_bytes(b))

    bd = Table(title="At the peak, by category")
    bd.add_column("category")
    bd.add_column("bytes", justify="right")
    bd.add_column("share", justify="right")
    breakdown = t.breakdown()
    for c in CATEGORIES:
        if breakdown[c]:
            bd.add_row(c.replace("_", " "), format_bytes(breakdown[c]),
                       f"{100 * breakdown[c] / max(t.peak_bytes, 1):.1f}%")

    mods = Table(title="Activations saved for backward, by module")
    mods.add_column("module")
    mods.add_column("bytes", justify="right")
    for path, b in list(t.by_module().items())[:top]:
        mods.add_row(path, format_bytes(b))

    tens = Table(title=f"Largest tensors at the peak")
    for col in ("bytes", "shape", "dtype", "category", "made by", "module", "freed after op"):
        tens.add_column(col, justify="right" if col == "bytes" else "left")
    for x in t.tensors_at_peak(top):
        made = x.op.replace("aten.", "") if x.op else f"(before step) {x.name}"
        freed = "end of step" if x.freed_after is None else str(x.freed_after)
        tens.add_row(format_bytes(x.bytes), "x".join(map(str, x.shape)) or "scalar", x.dtype,
                     x.category, made, x.module, freed)
    return [head, bd, mods, tens]


def summary_text(t, top: int = 10, width: int | None = None) -> str:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=width or 140, force_terminal=False, color_system=None)
    for table in _tables(t, top):
        console.print(table)
    return buf.getvalue()


def print_summary(t, top: int = 10) -> None:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 160)
    for table in _tables(t, top):
        console.print(table)


def plot(t, path, title: str | None = None):
    """Stacked live memory by category over the step's ops, phases shaded, peak marked."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - matplotlib is a dependency
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    tl = t.timeline
    n = len(tl["total"])
    x = np.arange(n)
    gib = 1024 ** 3
    unit, scale = ("GiB", gib) if t.peak_bytes >= gib else ("MiB", 1024 ** 2)
    fig, ax = plt.subplots(figsize=(11, 5), dpi=110)
    for phase, (a, b) in t.phase_ranges().items():
        ax.axvspan(a, b, color=_PHASE_SHADE.get(phase, "#eeeeee"), zorder=0)
        ax.text((a + b) / 2, 1.0, phase, transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", fontsize=9)
    cats = [c for c in CATEGORIES if tl[c].any()]
    ax.stackplot(x, *[tl[c] / scale for c in cats], labels=[c.replace("_", " ") for c in cats],
                 colors=[_COLORS[c] for c in cats], step="post", zorder=2)
    # The total as a line too: a one-op spike is thinner than a pixel in the stack.
    ax.plot(x, tl["total"] / scale, drawstyle="steps-post", color="black", lw=0.5, zorder=3)
    i = t.peak_index
    ax.axvline(i, color="black", lw=0.8, ls="--", zorder=3)
    ax.plot([i], [t.peak_bytes / scale], marker="v", color="black", ms=6, zorder=4)
    right_half = i > 0.6 * n  # keep the label inside the axes
    ax.annotate(f"peak {format_bytes(t.peak_bytes)}\nop {i}: {t.graph.ops[i].name if n else ''}",
                xy=(i, t.peak_bytes / scale), xytext=(-12 if right_half else 12, -30),
                textcoords="offset points", ha="right" if right_half else "left",
                fontsize=8, zorder=4, bbox=dict(boxstyle="round", fc="white", alpha=0.85))
    ax.set_xlim(0, max(n, 1))
    ax.set_ylim(0, t.peak_bytes / scale * 1.12 if t.peak_bytes else 1)
    ax.set_xlabel("op (dispatch order)")
    ax.set_ylabel(f"live bytes on {t.device} ({unit})")
    ax.set_title(title or f"{t.graph.meta.get('model', 'step')}: predicted memory on {t.device}",
                 pad=18)
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def to_dict(t, top: int = 20, timeline: bool = True) -> dict:
    g = t.graph
    pk = t.peak_op
    d = {
        "device": g.device,
        "meta": g.meta,
        "num_ops": g.num_ops,
        "num_tensors": len(g.tensors),
        "peak_bytes": t.peak_bytes,
        "peak_index": t.peak_index,
        "peak_op": None if pk is None else {"name": pk.name, "module": pk.module, "phase": pk.phase},
        "phase_ranges": {p: list(r) for p, r in t.phase_ranges().items()},
        "phase_peaks": t.phase_peaks(),
        "breakdown": t.breakdown(),
        "by_module": dict(list(t.by_module().items())[:top]),
        "tensors_at_peak": [{**x.__dict__, "shape": list(x.shape)} for x in t.tensors_at_peak(top)],
    }
    if timeline:
        d["timeline"] = {k: v.tolist() for k, v in t.timeline.items()}
    return d
