"""Allocation traces: the data type, readers and writer, and CPU recording.

    from pymemplan.traces import read_trace, write_csv, record
    trace = read_trace("run.csv.gz")           # RMM / pymemplan CSV or a torch snapshot
    offline_layout(trace).peak_reserved_bytes  # what knowing the whole trace would hold
    print(snapshot_fit("oom.pickle"))          # which allocator would have fit its requests
    with record() as rec: train_step()         # record a real eager step
    write_csv(rec.trace, "step.csv.gz")

Importing this package does not import torch; only recording does.
"""

from .builtin import builtin_traces
from .io import detect_format, read_trace
from .record import RecordingError, RecordingWarning, record, record_step
from .rmm_csv import read_rmm_csv, write_csv
from .snapshot import read_snapshot_pickle
from .trace import ALLOC, ALLOC_FAILURE, FREE, Trace, TraceError
from .replay import DEFAULT_POLICIES, ReplayResult, replay
from .offline import OfflineLayout, offline_layout
from .explain import (HeldBlock, Holder, MemoryExplanation, PeakExplanation, SnapshotBlock,
                      explain_peak, explain_snapshot)
from .fit import AllocatorFit, FitComparison, compare_fit, snapshot_fit

__all__ = [
    "ALLOC", "ALLOC_FAILURE", "FREE", "AllocatorFit", "FitComparison", "compare_fit", "snapshot_fit", "RecordingError", "RecordingWarning", "Trace", "TraceError",
    "DEFAULT_POLICIES", "HeldBlock", "Holder", "MemoryExplanation", "OfflineLayout", "PeakExplanation",
    "SnapshotBlock", "explain_peak", "explain_snapshot", "ReplayResult", "builtin_traces", "offline_layout", "replay", "detect_format", "read_rmm_csv", "read_snapshot_pickle",
    "read_trace", "record", "record_step", "write_csv",
]
