"""Plans kept across runs without code: ``enable("pymemplan-planned", plans="plans.txt")``
(or ``PYMEMPLAN_PLANS``) loads the file if it exists and writes the run's plans back at exit.

Loading stages the text in the plugin, which gives it to each device's allocator as that is
made: an allocator made early would retain a CUDA context before the program chose its
device. A path with ``{device}`` holds one file per device (several GPUs in one process);
one without it serves every device, and is written only where one device made plans (one
process per GPU, as DDP runs, all writing the same file: each write replaces it whole).
"""

from __future__ import annotations

import atexit
import os
import sys

from . import _library

DEVICE_FIELD = "{device}"
MAX_DEVICES = 64  # the plugin's kMaxDevices


def plan_path(template: str, device: int) -> str:
    return template.replace(DEVICE_FIELD, str(device))


def write_atomic(path: str | os.PathLike, text: str) -> None:
    # A run killed mid-write leaves the old file whole; the temporary file is the process's
    # own, since several processes (one per GPU) may save to the same path at once.
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def plan_count(text: str) -> int:
    return int(text.splitlines()[2])  # export_plans' third line


# A run's prologue is worth a file of its own, with no plan armed, once it is this long (the
# policy's default `prologue`): a job whose steps never repeat (generation), not a short
# debugging run.
WHOLE_PROLOGUE = 1 << 16


def prologue_count(text: str) -> int:
    """Requests in the prologue of export_plans' text (0 in a version-1 text, which has none)."""
    at = text.find("\nprologue ")
    return int(text[at:].split()[2]) if at >= 0 else 0


def worth_saving(text: str) -> bool:
    """Whether a run's export replaces the file of an earlier run: it armed a plan, or made
    a whole prologue."""
    return plan_count(text) > 0 or prologue_count(text) >= WHOLE_PROLOGUE


def read_plans(template: str) -> dict[int, str]:
    """The plan files of `template` that exist, checked: {device: text}, device -1 for a path
    without {device}. Raises ValueError naming the file for text save_plans did not write."""
    from .. import _core

    folder = os.path.dirname(os.path.abspath(template))
    if not os.path.isdir(folder):
        # Found now rather than at exit, when the run's plans could only be lost.
        raise ValueError(f"plans={template!r}: the folder {folder!r} does not exist; create "
                         "it, or give a path in an existing folder")
    if DEVICE_FIELD in template:
        paths = {d: plan_path(template, d) for d in range(MAX_DEVICES)}
    else:
        paths = {-1: template}
    out = {}
    for device, path in paths.items():
        if not os.path.exists(path):
            continue  # a first run: its plans are written at exit
        with open(path) as f:
            text = f.read()
        check = _core.Allocator(_core.SimulatedDevice(1 << 40), "pymemplan-planned", "")
        try:
            check.import_plans(text)
        except _core.AllocatorError as e:
            raise ValueError(f"plans file {path!r}: {e}. Delete the file (the next run writes "
                             "it again) or point plans= elsewhere.") from None
        out[device] = text
    return out


def stage(template: str, texts: dict[int, str]) -> None:
    """Hands `texts` (read_plans) to the plugin and saves this run's plans to `template` at
    exit. The plugin must be configured with pymemplan-planned."""
    lib = _library.load()
    for device, text in texts.items():
        _library.check(lib.pymemplan_stage_plans(device, text.encode()),
                       f"plans={template!r}")
    atexit.register(save_at_exit, template)


def exported_plans() -> dict[int, str]:
    """{device: text} of every device whose allocator armed plans, or made a whole prologue,
    in this run."""
    lib = _library.load()
    out = {}
    for device in range(MAX_DEVICES):
        try:
            text = _library.read_text(lib.pymemplan_export_plans, device, "export_plans")
        except _library.PluginError:
            continue  # no allocator on this device
        if worth_saving(text):
            out[device] = text
    return out


def save_at_exit(template: str) -> None:
    """Writes the run's plans where read_plans found them. A run that armed none and whose
    prologue is short (a short debugging run, a process that used no GPU) leaves the files of
    the last one as they are.
    At exit nothing can be raised to the program, so problems go to stderr."""
    try:
        texts = exported_plans()
        if DEVICE_FIELD in template:
            for device, text in texts.items():
                write_atomic(plan_path(template, device), text)
        elif len(texts) == 1:
            write_atomic(template, next(iter(texts.values())))
        elif texts:
            print(f"pymemplan: the plans of devices {sorted(texts)} were not saved: "
                  f"plans={template!r} is one file; put {DEVICE_FIELD} in the path "
                  "(e.g. plans.{device}.txt) for a file per device", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - the run is over; say why and let it end
        print(f"pymemplan: the plans were not saved to {template!r}: {e}", file=sys.stderr)
