"""`pymemplan plan --html` writes one page that renders in a real browser with no server.

The page is opened from file:// in headless Chromium (Debian's ``chromium`` package):

- through a wrapper page that loads it in an iframe and reads, from the browser's own
  DOM, that both figures decoded (``complete`` and ``naturalWidth`` equal to the PNG's
  width), that they are laid out, and that the table has a row per configuration;
- as a screenshot, whose pixels must hold the category colours of both figures (the
  colours of ``pymemplan.planner.report._COLORS``) about as many times as the figures
  themselves do: the figures are painted, at full size.

Skips when Chromium is not installed.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import struct
import subprocess

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

SKIP_REASON = "headless Chromium not installed (apt-get install chromium)"
FIGURES = ("timeline", "breakdown")
TOL = 6  # per-channel tolerance when matching a colour


def _chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _run_chromium(tmp_path, *args, timeout=120) -> subprocess.CompletedProcess:
    exe = _chromium()
    if exe is None:
        pytest.skip(SKIP_REASON)
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    profile.mkdir()
    # No sandbox (root in containers), no GPU, and nothing that reaches the network.
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--disable-extensions", "--mute-audio",
           f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """(path of the page, the advice as JSON) from the CLI."""
    if _chromium() is None:
        pytest.skip(SKIP_REASON)
    from pymemplan.cli import main

    d = tmp_path_factory.mktemp("report")
    page = d / "page.html"
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", "mlp", "--batch", "64", "--capacity", "2GiB", "--device", "cpu",
                   "--no-probe", "--techniques", "precision", "--json", "--html", str(page)])
    assert rc == 0
    return page, json.loads(out.getvalue())


def _embedded_pngs(html: str) -> dict[str, bytes]:
    """id -> PNG bytes of the page's inline figures."""
    out = {}
    for m in re.finditer(r'<img id="(\w+)"[^>]*src="data:image/png;base64,([^"]+)"', html):
        out[m.group(1)] = base64.b64decode(m.group(2))
    return out


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    return struct.unpack(">II", png[16:24])


def _hex(c: str):
    return tuple(int(c[i:i + 2], 16) for i in (1, 3, 5))


def _colour_counts(img, colours: dict, tol: int = TOL) -> dict[str, int]:
    import numpy as np

    try:
        a = np.asarray(img.convert("RGB")).astype(int)
    except OSError as e:
        pytest.fail(f"not a valid PNG: {e}")
    return {k: int((np.abs(a - np.array(_hex(v))).max(-1) <= tol).sum())
            for k, v in colours.items()}


_PROBE = """<!DOCTYPE html><html><body><pre id="out">pending</pre>
<iframe id="f" src="{src}" width="1200" height="3000"></iframe>
<script>
var COLOURS = {colours}, TOL = {tol};
document.getElementById('f').addEventListener('load', function () {{
  var out = {{}};
  try {{
    var d = this.contentDocument;
    {figures}.forEach(function (id) {{
      var im = d.getElementById(id);
      if (!im) {{ out[id] = null; return; }}
      out[id] = {{complete: im.complete, width: im.naturalWidth, height: im.naturalHeight,
                 shown: im.getBoundingClientRect().width, colours: {{}}}};
      // The decoded pixels, as the browser has them: count each category colour.
      var c = document.createElement('canvas');
      c.width = im.naturalWidth; c.height = im.naturalHeight;
      var g = c.getContext('2d');
      g.drawImage(im, 0, 0);
      var px = g.getImageData(0, 0, c.width, c.height).data;
      Object.keys(COLOURS).forEach(function (k) {{
        var rgb = COLOURS[k], n = 0;
        for (var i = 0; i < px.length; i += 4) {{
          if (Math.abs(px[i] - rgb[0]) <= TOL && Math.abs(px[i + 1] - rgb[1]) <= TOL &&
              Math.abs(px[i + 2] - rgb[2]) <= TOL) n++;
        }}
        out[id].colours[k] = n;
      }});
    }});
    out.rows = d.querySelectorAll('#advice tbody tr').length;
    out.code = (d.getElementById('code') || {{}}).textContent;
    out.title = d.title;
  }} catch (e) {{ out.error = String(e); }}
  document.getElementById('out').textContent = 'RESULT' + JSON.stringify(out) + 'END';
}});
</script></body></html>
"""


def test_figures_decode_and_table_renders_in_chromium(report, tmp_path):
    from pymemplan.planner.report import _COLORS

    try:
        from PIL import Image
    except ImportError:
        Image = None
    page, doc = report
    pngs = _embedded_pngs(page.read_text(encoding="utf-8"))
    assert set(pngs) == set(FIGURES)
    probe = page.parent / "probe.html"
    probe.write_text(_PROBE.format(src=page.name, figures=json.dumps(list(FIGURES)),
                                   colours=json.dumps({k: _hex(v) for k, v in _COLORS.items()}),
                                   tol=TOL))
    # file:// pages are separate origins unless file access is allowed; virtual time lets
    # the load event fire before the DOM is dumped.
    r = _run_chromium(tmp_path, "--allow-file-access-from-files",
                      "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    m = re.search(r"RESULT(\{.*?\})END", r.stdout)
    assert m, f"no result from Chromium (rc {r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}"
    got = json.loads(m.group(1))
    assert "error" not in got, got
    for fig in FIGURES:
        w, h = _png_size(pngs[fig])
        assert got[fig] is not None, f"no <img id={fig}> in the rendered page"
        assert got[fig]["complete"] and (got[fig]["width"], got[fig]["height"]) == (w, h), \
            f"{fig} did not decode: {got[fig]} (PNG is {w}x{h})"
        assert got[fig]["shown"] > 0.5 * w, f"{fig} not laid out: {got[fig]}"
        # Every pixel decoded: the browser's pixels hold each category colour as often as
        # the PNG does (read here by Pillow when installed, else: the stack's colours).
        colours = got[fig]["colours"]
        assert colours["parameter"] > 1000 and colours["optimizer_state"] > 1000, got[fig]
        if Image is not None:
            want = _colour_counts(Image.open(io.BytesIO(pngs[fig])), _COLORS)
            for k, n in want.items():
                assert abs(colours[k] - n) <= 0.01 * n + 10, (fig, k, colours, want)
    assert got["rows"] == len(doc["rows"])
    best = doc["best"] or doc["rows"][0]
    assert got["code"] == best["code"]
    assert got["title"].startswith("pymemplan plan:")


def test_screenshot_shows_both_figures(report, tmp_path):
    Image = pytest.importorskip("PIL.Image")
    from pymemplan.planner.report import _COLORS

    page, _ = report
    pngs = _embedded_pngs(page.read_text(encoding="utf-8"))
    # What the figures themselves hold, colour by colour.
    expected = {k: 0 for k in _COLORS}
    for png in pngs.values():
        for k, n in _colour_counts(Image.open(io.BytesIO(png)), _COLORS).items():
            expected[k] += n
    shot = tmp_path / "shot.png"
    r = _run_chromium(tmp_path, "--hide-scrollbars", "--force-device-scale-factor=1",
                      "--window-size=1280,2400", "--virtual-time-budget=10000",
                      f"--screenshot={shot}", page.as_uri())
    assert shot.exists(), f"no screenshot (rc {r.returncode}): {r.stderr[-2000:]}"
    got = _colour_counts(Image.open(shot), _COLORS)
    shown = {k: n for k, n in expected.items() if n >= 200}
    # The step's parameters, gradients and Adam state fill most of both figures.
    assert {"parameter", "gradient", "optimizer_state"} <= set(shown), expected
    for k, n in shown.items():
        assert got[k] >= 0.9 * n, f"{k} ({_COLORS[k]}): {got[k]} pixels on screen, " \
                                  f"{n} in the figures; screenshot {shot}"
