"""Record small real training steps on CPU and write them as sample allocation traces.

Writes each trace as gzipped RMM-layout CSV into both ``tests/data/`` (for the tests)
and ``pymemplan/traces/data/`` (built-in traces the CLI replays when given no file),
plus a small synthetic PyTorch memory-snapshot pickle into ``tests/data/``.

    PYTHONPATH=. python benchmarks/make_sample_traces.py

Each step is eager PyTorch under ``pymemplan.traces.record``: every tensor allocation
and free, in order, checked against the CPU allocator's own running total. Pointers
differ from run to run; sizes and event order do not.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pymemplan.traces import record, write_csv  # noqa: E402

OUT_DIRS = [ROOT / "tests" / "data", ROOT / "pymemplan" / "traces" / "data"]
MAX_BYTES = 200_000  # keep the repository and the wheel small


def train(model: nn.Module, opt: torch.optim.Optimizer, batches, loss_fn) -> None:
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        del loss


def mlp_adam():
    """A 3-layer MLP, Adam, 3 steps: the first step also allocates Adam's state."""
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = [(torch.randn(64, 256), torch.randint(0, 10, (64,))) for _ in range(3)]
    return model, opt, batches, nn.functional.cross_entropy


def cnn_sgd():
    """A small CNN (conv-bn-relu-pool twice, linear) on 32x32 images, SGD with momentum."""
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = [(torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))) for _ in range(3)]
    return model, opt, batches, nn.functional.cross_entropy


class TinyEncoder(nn.Module):
    def __init__(self, d_model: int = 64) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=128,
                                                dropout=0.1, batch_first=True)
        self.head = nn.Linear(d_model, 1)

    def forward(self, x):
        return self.head(self.layer(x)).squeeze(-1)


def transformer_varlen():
    """A tiny transformer encoder layer, AdamW, 4 steps of varying sequence length:
    activations change size from step to step, as in real language-model training."""
    model = TinyEncoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [(torch.randn(8, seq, 64), torch.randn(8, seq)) for seq in (16, 48, 32, 64)]
    return model, opt, batches, nn.functional.mse_loss


RECIPES = [mlp_adam, cnn_sgd, transformer_varlen]


def synthetic_snapshot() -> dict:
    """A small snapshot in the format of ``torch.cuda.memory._snapshot()``, written by
    hand so that its expected trace is known exactly (see tests/test_trace_io.py).

    Device 0's history begins mid-run: its first events free a block allocated before
    the ring buffer started. One free is requested before a later allocation but
    completes only after it. Device 1 has fewer events.
    """
    def frame(line, name="train_step"):
        return [{"filename": "train.py", "line": line, "name": name}]

    base, big, s = 0x7F3A00200000, 0x7F3A02000000, 94_000_000_000_000  # addresses, a stream
    t = 1_733_150_000_000_000  # time_us

    def ev(i, action, addr, size, stream=0, **extra):
        return {"action": action, "addr": addr, "size": size, "stream": stream,
                "time_us": t + 10 * i, "frames": frame(100 + i), **extra}

    dev0 = [
        ev(0, "free_requested", 0x7F3A00000000, 512),   # allocated before the history began
        ev(1, "free_completed", 0x7F3A00000000, 512),
        ev(2, "segment_alloc", base, 2 << 20),
        ev(3, "alloc", base, 4096),
        ev(4, "alloc", base + 0x1000, 8192, stream=s),
        ev(5, "free_requested", base, 4096),
        ev(6, "alloc", base + 0x3000, 1024),              # the 4096 block is not yet reusable
        ev(7, "free_completed", base, 4096),
        ev(8, "alloc", base, 2048),
        ev(9, "snapshot", 0, 0),
        ev(10, "segment_alloc", big, 20 << 20),
        ev(11, "alloc", big, 10 << 20),
        {"action": "oom", "size": 1 << 34, "device_free": 1 << 20, "stream": 0,
         "time_us": t + 120, "frames": frame(112)},
        ev(13, "free_requested", base + 0x1000, 8192, stream=s),
        ev(14, "free_completed", base + 0x1000, 8192, stream=s),
    ]
    dev1 = [
        ev(0, "segment_alloc", 0x7F3B00000000, 2 << 20),
        ev(1, "alloc", 0x7F3B00000000, 512),
        ev(2, "free_requested", 0x7F3B00000000, 512),
        ev(3, "free_completed", 0x7F3B00000000, 512),
    ]

    def block(addr, size, state):
        return {"address": addr, "size": size, "requested_size": size, "state": state,
                "frames": frame(0)}

    segments = [
        {"device": 0, "address": base, "total_size": 2 << 20, "allocated_size": 3072,
         "active_size": 3072, "requested_size": 3072, "stream": 0, "segment_type": "small",
         "segment_pool_id": (0, 0), "is_expandable": False, "frames": frame(2),
         "blocks": [block(base, 2048, "active_allocated"),
                    block(base + 0x800, 0x2800, "inactive"),
                    block(base + 0x3000, 1024, "active_allocated"),
                    block(base + 0x3400, (2 << 20) - 0x3400, "inactive")]},
        {"device": 0, "address": big, "total_size": 20 << 20, "allocated_size": 10 << 20,
         "active_size": 10 << 20, "requested_size": 10 << 20, "stream": 0,
         "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
         "frames": frame(10),
         "blocks": [block(big, 10 << 20, "active_allocated"),
                    block(big + (10 << 20), 10 << 20, "inactive")]},
        {"device": 1, "address": 0x7F3B00000000, "total_size": 2 << 20, "allocated_size": 0,
         "active_size": 0, "requested_size": 0, "stream": 0, "segment_type": "small",
         "segment_pool_id": (0, 0), "is_expandable": False, "frames": frame(0),
         "blocks": [block(0x7F3B00000000, 2 << 20, "inactive")]},
    ]
    return {"segments": segments, "device_traces": [dev0, dev1],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None, "max_split_size": -1,
                                   "garbage_collection_threshold": 0.0,
                                   "expandable_segments": False, "pinned_num_register_threads": 1,
                                   "release_lock_on_cudamalloc": False,
                                   "pinned_use_cuda_host_register": False,
                                   "roundup_power2_divisions": {}}}


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # deterministic kernels, and a light load on shared machines
    for d in OUT_DIRS:
        d.mkdir(parents=True, exist_ok=True)
    for recipe in RECIPES:
        model, opt, batches, loss_fn = recipe()
        with record(name=recipe.__name__) as rec:
            train(model, opt, batches, loss_fn)
        trace = rec.trace
        for d in OUT_DIRS:
            path = d / f"{recipe.__name__}.csv.gz"
            write_csv(trace, path)
            size = path.stat().st_size
            if size > MAX_BYTES:
                raise SystemExit(f"{path}: {size} bytes, over the {MAX_BYTES} limit; shrink the recipe")
        print(f"{recipe.__name__}: {len(trace)} events, peak live {trace.peak_live_bytes()} B, "
              f"{size} B gzipped")
    snap = OUT_DIRS[0] / "snapshot_sample.pickle"
    with open(snap, "wb") as f:
        pickle.dump(synthetic_snapshot(), f, protocol=4)
    print(f"{snap.relative_to(ROOT)}: synthetic snapshot")


if __name__ == "__main__":
    main()
