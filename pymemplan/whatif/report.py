"""Reports of :class:`~pymemplan.whatif.advise.Advice`: a rich table, plain text, one HTML page."""

from __future__ import annotations

import base64
import html
import io
import sys

from ..units import format_bytes

_COLUMNS = ("technique", "configuration", "peak", "reserved", "fits", "compute", "notes")


def _cells(a, r) -> list[str]:
    fits = {True: "yes", False: "no", None: "?"}[r.fits]
    return [r.technique, r.name,
            format_bytes(r.peak_bytes) if r.peak_bytes is not None else "-",
            format_bytes(r.reserved_bytes) if r.reserved_bytes is not None else "-",
            fits,
            f"{r.relative_compute:.2f}x" if r.relative_compute is not None else "-",
            r.notes]


def _allocator_words(policy: str | None) -> str:
    name, _, config = (policy or "torch").partition("=")
    if name != "torch":
        return f"the {name} allocator"
    return "PyTorch's allocator" + (f" ({config})" if config else "")


def _title(a) -> str:
    fit_on = (f"memory {_allocator_words(a.policy)} would reserve" if a.fit_metric == "reserved"
              else "peak of live bytes")
    return (f"What fits {format_bytes(a.capacity_bytes)} on {a.device}: {a.model}, batch "
            f"{a.batch} (fits = {fit_on}; compute per sample relative to the step as it is)")


def advice_table(a):
    from rich.table import Table

    table = Table(title=_title(a), show_lines=False)
    for col in _COLUMNS:
        table.add_column(col, justify="right" if col in ("peak", "reserved", "compute") else
                         "left", overflow="fold", max_width=70 if col == "notes" else None)
    for r in a.rows:
        cells = _cells(a, r)
        style = "bold green" if r.technique == "best" else ("red" if r.fits is False else None)
        table.add_row(*cells, style=style)
    return table


def _render(a, console) -> None:
    from rich.syntax import Syntax

    console.print(advice_table(a))
    if a.best is None:
        console.print(f"[bold red]Nothing tried fits {format_bytes(a.capacity_bytes)}.[/] "
                      "See the rows' notes; sharding (--world-size) or a larger GPU may.")
    else:
        console.print(f"[bold]Best:[/] {a.best.name}. The code:")
        console.print(Syntax(a.best.code, "python", theme="ansi_dark", background_color="default"))


def summary_text(a, width: int | None = None) -> str:
    from rich.console import Console

    buf = io.StringIO()
    _render(a, Console(file=buf, width=width or 160, force_terminal=False, color_system=None))
    return buf.getvalue()


def print_advice(a) -> None:
    from rich.console import Console

    _render(a, Console(width=None if sys.stdout.isatty() else 200))


# -- HTML ----------------------------------------------------------------------------------

def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _timeline_png(a, row) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..planner.report import _COLORS

    t = row.trace
    tl = t.timeline
    fig, ax = plt.subplots(figsize=(10, 3.6))
    x = range(len(tl["total"]))
    cats = [c for c in _COLORS if c in tl and tl[c].any()]
    ax.stackplot(x, *[tl[c] / 2**30 for c in cats], labels=[c.replace("_", " ") for c in cats],
                 colors=[_COLORS[c] for c in cats], linewidth=0)
    ax.axhline(a.capacity_bytes / 2**30, color="black", linestyle="--", linewidth=1,
               label=f"capacity {format_bytes(a.capacity_bytes)}")
    ax.set_xlabel("op")
    ax.set_ylabel("GiB live")
    ax.set_title(f"{row.name}: live memory over one step")
    ax.legend(loc="upper left", fontsize=7, ncol=4)
    fig.tight_layout()
    return _png(fig)


def _breakdown_png(a) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..planner.report import _COLORS

    rows = [r for r in a.rows if r.peak_bytes is not None and r.technique != "best"]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.2))
    left = [0.0] * len(rows)
    for c, color in _COLORS.items():
        vals = [r.breakdown.get(c, 0) / 2**30 for r in rows]
        if any(vals):
            ax.barh(range(len(rows)), vals, left=left, color=color, label=c.replace("_", " "))
            left = [lo + v for lo, v in zip(left, vals)]
    ax.axvline(a.capacity_bytes / 2**30, color="black", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r.name for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GiB at the peak (dashed: capacity)")
    ax.legend(fontsize=7, ncol=4, loc="lower right")
    fig.tight_layout()
    return _png(fig)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; }
th { background: #f2f2f2; }
td.num { text-align: right; white-space: nowrap; }
tr.best { background: #e6f4e6; font-weight: bold; }
tr.nofit td.fits { color: #b00; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; }
img { max-width: 100%; }
"""


def write_html(a, path) -> str:
    """One self-contained page: figures inlined as data URIs, no script, no server."""
    from pathlib import Path

    best = a.best or a.baseline
    head = "".join(f"<th>{html.escape(c)}</th>" for c in _COLUMNS)
    body = []
    for r in a.rows:
        cls = "best" if r.technique == "best" else ("nofit" if r.fits is False else "")
        cells = _cells(a, r)
        tds = []
        for col, v in zip(_COLUMNS, cells):
            kind = "num" if col in ("peak", "reserved", "compute") else col
            tds.append(f'<td class="{kind}">{html.escape(v)}</td>')
        body.append(f'<tr class="{cls}">{"".join(tds)}</tr>')
    verdict = (f"Best: <b>{html.escape(a.best.name)}</b>" if a.best is not None else
               f"<b>Nothing tried fits {html.escape(format_bytes(a.capacity_bytes))}.</b>")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>pymemplan plan: {html.escape(a.model)}</title><style>{_CSS}</style></head>
<body>
<h1>pymemplan plan: {html.escape(a.model)}</h1>
<p>{html.escape(_title(a))}</p>
<p id="verdict">{verdict}</p>
<h2>Timeline of {html.escape(best.name)}</h2>
<img id="timeline" alt="live memory over one step" src="data:image/png;base64,{_timeline_png(a, best)}">
<h2>At the peak, by configuration</h2>
<img id="breakdown" alt="memory at the peak by category" src="data:image/png;base64,{_breakdown_png(a)}">
<h2>Every configuration</h2>
<table id="advice"><thead><tr>{head}</tr></thead><tbody>
{"".join(body)}
</tbody></table>
<h2>The code</h2>
<pre id="code">{html.escape(best.code)}</pre>
<p><small>pymemplan traced every row on fake tensors: no GPU, no real memory.
Traced in {a.seconds:.1f} s.</small></p>
</body></html>
"""
    Path(path).write_text(page, encoding="utf-8")
    return str(path)
