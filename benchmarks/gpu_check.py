"""GPU check of the plugin: the GPU-marked tests, then real training with three allocators.

    python benchmarks/gpu_check.py            # needs a CUDA GPU and pymemplan installed

Trains resnet50 and GPT-2 small (random init) for 20 steps each with PyTorch's native
allocator, native with expandable_segments:True, pymemplan, pymemplan-vmm and
pymemplan-planned, each in its own process, pymemplan-planned once more, restarted
with the plans the first run saved at exit (PYMEMPLAN_PLANS), and the model of GMLake
(policy gmlake, stitching every request over 1 MiB) through the same plugin. It reports the peak reserved and peak allocated bytes (from each allocator's own
stats), the median step time, and the ratios to native; at the end of each run, what the
allocator's snapshot holds (``explain_snapshot``, as ``pymemplan explain`` reads PyTorch's own
snapshot or the plugin's; ``explained_at_end``), its reserved bytes beside the allocator's own
count. Beside the native runs it puts
the planner's predictions for the same step, made without the GPU: the peak of live bytes
(``pymemplan.trace(..., device="cuda").peak_bytes``) against the peak allocated, and the
reserved peak (``reserved_peak("torch")``, ``reserved_peak("torch=expandable_segments:True")``)
against the peak reserved. It also records each model's run under PyTorch's allocator
(building it and three steps, then one step alone) and reports, beside each mode's measured
peak, what the replay engine's model of that allocator reserves on the recorded run, and how
closely the planner's predicted step follows the recorded step's allocations, in order
(``allocation_match``: whether a plan made from the prediction could serve the first steps).
Before the training runs it makes a run that does not fit (GPT-2 small at a batch a fifth
past the device's memory, its history recorded from after the model is built), under
PyTorch's allocator and under pymemplan-vmm (pymemplan.record_memory_history), and reports
what `pymemplan explain` tells from the snapshot dumped at the error (``oom_snapshot``: the
capacity read from it beside the device's memory, each allocator's verdict, the advice).
First it replays two random training loops through the plugin with each of our policies and
GMLake's model (benchmarks/gpu_replay.py: what a driver call costs on this GPU, and the CUDA path's peak and
driver calls beside the simulated device's). Writes benchmarks/results/gpu_check.json, after each stage.
Sized to finish in about 10 minutes on one H100/H200 (never yet timed on one).

    python benchmarks/gpu_check.py --predict-only   # the predictions alone; no GPU needed
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "gpu_check.json"

MODES = {
    "native": {},
    "native_expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "pymemplan": {"PYMEMPLAN_ENABLE": "1"},
    "pymemplan_vmm": {"PYMEMPLAN_ENABLE": "1", "PYMEMPLAN_ALLOC_CONF": "policy:pymemplan-vmm"},
    "pymemplan_planned": {"PYMEMPLAN_ENABLE": "1",
                          "PYMEMPLAN_ALLOC_CONF": "policy:pymemplan-planned"},
    # The same again, starting with the plans the run before wrote at its exit
    # (PYMEMPLAN_PLANS, a file set by main() for both runs).
    "pymemplan_planned_restarted": {"PYMEMPLAN_ENABLE": "1",
                                    "PYMEMPLAN_ALLOC_CONF": "policy:pymemplan-planned"},
    # The model of GMLake through the same plugin, stitching every request over 1 MiB.
    "gmlake_stitching_all": {"PYMEMPLAN_ENABLE": "1",
                             "PYMEMPLAN_ALLOC_CONF": "policy:gmlake,frag_limit_mb:0"},
}

# The training step both workers run; DEVICE and SMALL (a dry run: small shapes) come from
# the environment, so that the workers can be tried on a CPU.
SETUP = textwrap.dedent("""
    import json, os, sys, time
    import pymemplan  # enables itself when PYMEMPLAN_ENABLE=1
    import torch, torch.nn.functional as F
    DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
    SMALL = os.environ.get("GPU_CHECK_SMALL") == "1"
    model_name = sys.argv[1]
    torch.manual_seed(0)

    def build():
        if model_name == "resnet50":
            import torchvision
            model = torchvision.models.resnet50().to(DEVICE)
            n, side = (4, 64) if SMALL else (64, 224)
            def batch():
                return (torch.randn(n, 3, side, side, device=DEVICE),
                        torch.randint(0, 1000, (n,), device=DEVICE))
            def loss_of(x, y):
                return F.cross_entropy(model(x), y)
        else:
            from transformers import GPT2Config, GPT2LMHeadModel
            config = GPT2Config(n_layer=2) if SMALL else GPT2Config()
            model = GPT2LMHeadModel(config).to(DEVICE)
            n, seq = (2, 128) if SMALL else (8, 1024)
            def batch():
                ids = torch.randint(0, 50257, (n, seq), device=DEVICE)
                return ids, ids
            def loss_of(x, y):
                return model(input_ids=x, labels=y).loss
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        def train(x, y):
            loss_of(x, y).backward(); opt.step(); opt.zero_grad(set_to_none=True)
        return batch, train

    def sync():
        if DEVICE != "cpu":
            torch.cuda.synchronize()
""")

WORKER = SETUP + textwrap.dedent("""
    steps = int(sys.argv[2])
    batch, train = build()
    times = []
    for _ in range(steps):
        x, y = batch()
        sync(); t0 = time.perf_counter()
        train(x, y)
        sync(); times.append(time.perf_counter() - t0)
    if DEVICE == "cpu":  # a dry run: no CUDA allocator to ask
        stats = {"reserved_bytes.all.peak": None, "allocated_bytes.all.peak": None}
    elif pymemplan.is_enabled():
        stats = pymemplan.memory_stats()
    else:
        stats = torch.cuda.memory_stats()
    times = sorted(times[3:])
    # `pymemplan explain` on the allocator's own snapshot at the end of the run (PyTorch's
    # format, or the plugin's): its reserved bytes must be the allocator's own count.
    end = None
    if DEVICE != "cpu":
        from pymemplan.traces import explain_snapshot
        native = not pymemplan.is_enabled()
        why = explain_snapshot(torch.cuda.memory._snapshot() if native else pymemplan.snapshot(0),
                               device=0, top=0)
        end = {"reserved_bytes": why.reserved_bytes, "live_bytes": why.live_bytes,
               "cached_bytes": why.cached_bytes, "fragment_bytes": why.fragment_bytes,
               "allocator_reserved_bytes": (torch.cuda.memory_reserved() if native
                                            else pymemplan.memory_reserved())}
    print(json.dumps({
        "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
        "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
        "num_device_alloc": stats.get("num_device_alloc"),
        "median_step_s": times[len(times) // 2],
        "explained_at_end": end,
    }))
""")

# Records the run under PyTorch's own allocator: building the model and three steps (the
# benchmark traces' shape), then one more step alone, to set beside the planner's step.
RECORDER = SETUP + textwrap.dedent("""
    from pymemplan.traces import record, write_csv
    out = sys.argv[2]
    with record(device=DEVICE, name=model_name) as run:
        batch, train = build()
        for _ in range(3):
            train(*batch())
    with record(device=DEVICE, name=model_name + "_step") as one:
        train(*batch())
    write_csv(run.trace, os.path.join(out, "run.csv.gz"))
    write_csv(one.trace, os.path.join(out, "step.csv.gz"))
""")


# A run that does not fit: GPT-2 small under Adam at a batch past the device's memory, its
# allocation history recorded from after the model is built (the weights are made before it,
# as in most runs), the snapshot dumped at the out-of-memory error, as a user would.
OOM_WORKER = textwrap.dedent("""
    import json, sys
    import pymemplan  # enables itself when PYMEMPLAN_ENABLE=1
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    path, batch = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    ours = pymemplan.is_enabled()
    if ours:
        pymemplan.record_memory_history(max_entries=100000)
    else:
        torch.cuda.memory._record_memory_history(max_entries=100000)
    try:
        ids = torch.randint(0, 50257, (batch, 1024), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        failed = False
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        if not (isinstance(e, torch.cuda.OutOfMemoryError) or pymemplan.is_out_of_memory(e)):
            raise
        failed = True
        pymemplan.save_snapshot(path) if ours else torch.cuda.memory._dump_snapshot(path)
    total = torch.cuda.get_device_properties(0).total_memory
    print(json.dumps({"failed": failed, "batch": batch, "total_bytes": total}))
""")

# The allocators the OOM stage runs under: PyTorch's, and ours through the plugin with its
# own history (pymemplan.record_memory_history).
OOM_MODES = {"native": {}, "pymemplan_vmm": MODES["pymemplan_vmm"]}

# GPT-2 small at 1024 tokens holds about 1.7 GiB a sample at its peak under Adam: a batch
# past the device's memory by a fifth.
OOM_BYTES_PER_SAMPLE = int(1.7 * 2**30)


def oom_batch(total_bytes: int) -> int:
    return int(1.2 * total_bytes / OOM_BYTES_PER_SAMPLE) + 1


def oom_summary(snapshot, total_bytes: int) -> dict:
    """What `pymemplan explain` tells from a snapshot at an OOM: each allocator's verdict on
    the memory the snapshot says the program had, beside the device's whole memory."""
    from pymemplan.traces import explain_snapshot, snapshot_fit

    fit = snapshot_fit(snapshot)
    why = explain_snapshot(snapshot, device=0, top=0)
    return {"capacity_bytes": fit.capacity_bytes, "capacity_source": fit.capacity_source,
            "device_total_bytes": total_bytes, "events": fit.events,
            "failed_requests": fit.failed_requests, "peak_live_bytes": fit.peak_live_bytes,
            "reserved_bytes": why.reserved_bytes, "fragment_bytes": why.fragment_bytes,
            "cached_bytes": why.cached_bytes,
            "rows": [{"policy": r.policy, "fits": r.fits,
                      "smallest_device_bytes": r.smallest_device_bytes,
                      "peak_reserved_bytes": r.peak_reserved_bytes} for r in fit.rows],
            "notes": fit.notes, "advice": fit.advice}


# The worker's step, on the meta device, for the planner: (model, inputs, loss_fn).
def _step_on_meta(model_name):
    import torch
    import torch.nn.functional as F

    with torch.device("meta"):
        if model_name == "resnet50":
            import torchvision

            model = torchvision.models.resnet50()
            y = torch.zeros(64, dtype=torch.long)

            def loss_fn(out):
                return F.cross_entropy(out, y.to(out.device))
            return model, (torch.empty(64, 3, 224, 224),), loss_fn
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config())

    class WithLabels(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

    return WithLabels(), (torch.zeros(8, 1024, dtype=torch.long, device="meta"),), None


# Native modes whose reserved peak the planner predicts, and the policy that models each.
PREDICTED_POLICY = {"native": "torch", "native_expandable": "torch=expandable_segments:True"}


def predictions(model_name, with_trace=False) -> dict:
    """The planner's figures for the worker's step (Adam), made on the CPU (and the step's
    predicted allocation trace, with_trace)."""
    import torch

    import pymemplan

    model, inputs, loss_fn = _step_on_meta(model_name)
    t = pymemplan.trace(model, inputs, loss_fn=loss_fn, optimizer=torch.optim.Adam,
                        device="cuda")
    out = {"peak_allocated_bytes": t.peak_bytes,
           **{mode: t.reserved_peak(policy) for mode, policy in PREDICTED_POLICY.items()}}
    if with_trace:
        out["trace"] = t.allocation_trace()
    return out


# Each mode's allocator, as the replay engine models it.
REPLAYED_POLICY = {"native": "torch", "native_expandable": "torch=expandable_segments:True",
                   "pymemplan": "pymemplan", "pymemplan_vmm": "pymemplan-vmm",
                   "pymemplan_planned": "pymemplan-planned",
                   "gmlake_stitching_all": "gmlake=frag_limit_mb:0"}
# Requests in a row that a plan needs to recognise where it is (planned.hpp: kPrefix).
RUN = 8


def allocation_match(predicted, recorded) -> dict:
    """How closely a predicted step's allocations follow a recorded one's, in order, by size
    (rounded to 512 bytes, as the allocators do): difflib's ratio (1.0: the same sequence),
    and the share of the recorded allocations that lie in runs of at least RUN requests
    matched in order, which a plan made from the prediction could follow."""
    import difflib

    import numpy as np

    def sizes(t):
        allocs = np.asarray(t.size)[np.asarray(t.action) == 0]
        return [int(-(-x // 512) * 512) for x in allocs]

    p, r = sizes(predicted), sizes(recorded)
    m = difflib.SequenceMatcher(a=r, b=p, autojunk=False)
    runs = [b.size for b in m.get_matching_blocks() if b.size >= RUN]
    return {"recorded_allocations": len(r), "predicted_allocations": len(p),
            "ratio": m.ratio(), "in_runs": sum(runs) / len(r) if r else 1.0,
            "longest_run": max((b.size for b in m.get_matching_blocks()), default=0)}


def recorded_checks(model_name, predicted_step, env=None) -> dict:
    """Records the run under PyTorch's allocator, replays it through each mode's model, and
    sets the planner's step beside the recorded one."""
    import tempfile

    from pymemplan.traces import read_trace, replay

    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-c", RECORDER, model_name, out], check=True,
                       capture_output=True, text=True, timeout=300, env=env)
        run = read_trace(os.path.join(out, "run.csv.gz"))
        step = read_trace(os.path.join(out, "step.csv.gz"))
    replayed = {r.policy: r.peak_reserved_bytes for r in replay(run, list(REPLAYED_POLICY.values()))}
    return {"events": len(run), "peak_live_bytes": run.peak_live_bytes(),
            "replayed_peak_reserved_bytes": {mode: replayed[policy]
                                             for mode, policy in REPLAYED_POLICY.items()},
            "prediction_match": allocation_match(predicted_step, step)}


def gpu_tests_command() -> list[str]:
    """pytest over the GPU tests, in one process: the project's addopts ask for pytest-xdist,
    which the GPU machine may not have (nothing installs there), and one process keeps the
    tests off each other's GPU memory."""
    return [sys.executable, "-m", "pytest", "-o", "addopts=-ra", "-m", "gpu", "-q",
            str(HERE.parent / "tests")]


def main() -> int:
    import tempfile

    import torch

    if "--predict-only" in sys.argv:
        for model in ("resnet50", "gpt2"):
            p = predictions(model)
            print(f"{model:9s} " + "  ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in p.items()))
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; nothing to check", file=sys.stderr)
        return 2
    tests = subprocess.run(gpu_tests_command(), timeout=300)
    rows, recorded, replays, oom = [], {}, [], {}

    def save():
        # After each stage, so that a run cut short still leaves what it measured.
        RESULT.parent.mkdir(exist_ok=True)
        RESULT.write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                      "torch": torch.__version__,
                                      "gpu_tests_exit_code": tests.returncode,
                                      "runs": rows, "recorded": recorded,
                                      "driver_calls": replays, "oom_snapshot": oom},
                                     indent=2) + "\n")

    # What the policies' driver calls cost here (benchmarks/gpu_replay.py): traces replayed
    # through the plugin on this GPU, beside the same policy on the simulated device.
    import gpu_replay

    try:
        replays = gpu_replay.run(gpu_replay.TRACES, torch.cuda.get_device_properties(0).total_memory,
                                 timeout=240)
    except (subprocess.SubprocessError, OSError) as e:
        replays = [{"error": str(e)[-2000:]}]
    save()
    # A run that does not fit, and what its snapshot tells (pymemplan explain).
    total = torch.cuda.get_device_properties(0).total_memory
    for mode, env in OOM_MODES.items():
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "oom.pickle")
            try:
                r = subprocess.run([sys.executable, "-c", OOM_WORKER, path, str(oom_batch(total))],
                                   capture_output=True, text=True, timeout=240, check=True,
                                   env={**os.environ, **env})
                ran = json.loads(r.stdout.strip().splitlines()[-1])
                oom[mode] = {**ran, **oom_summary(path, ran["total_bytes"])} if ran["failed"] else ran
            except (subprocess.SubprocessError, OSError, ValueError) as e:
                oom[mode] = {"error": str(e)[-2000:] + (getattr(e, "stderr", None) or "")[-2000:]}
        print(f"oom snapshot ({mode}): {json.dumps(oom[mode])[:600]}", flush=True)
        save()
    for model in ("resnet50", "gpt2"):
        predicted = predictions(model, with_trace=True)
        try:
            recorded[model] = recorded_checks(model, predicted["trace"])
        except (subprocess.SubprocessError, OSError, ValueError) as e:
            recorded[model] = {"error": str(e)[-2000:] + (getattr(e, "stderr", None) or "")[-2000:]}
        print(f"{model:9s} recorded: {json.dumps(recorded[model])[:400]}", flush=True)
        plans = os.path.join(tempfile.mkdtemp(), f"{model}_plans.txt")
        for mode, env in MODES.items():
            if mode.startswith("pymemplan_planned"):
                env = {**env, "PYMEMPLAN_PLANS": plans}  # written by the first, read by the next
            r = subprocess.run([sys.executable, "-c", WORKER, model, "20"], capture_output=True,
                               text=True, timeout=240, env={**os.environ, **env})
            if r.returncode != 0:
                rows.append({"model": model, "mode": mode, "error": r.stderr[-2000:]})
                print(f"{model:9s} {mode:18s} FAILED\n{r.stderr[-2000:]}", flush=True)
                continue
            row = {"model": model, "mode": mode, **json.loads(r.stdout.strip().splitlines()[-1])}
            replayed = recorded[model].get("replayed_peak_reserved_bytes", {})
            if mode in replayed:
                # The replay engine's model of this allocator on the recorded run (3 steps).
                row["replayed_peak_reserved_bytes"] = replayed[mode]
            if mode in PREDICTED_POLICY:
                row["predicted_peak_allocated_bytes"] = predicted["peak_allocated_bytes"]
                row["predicted_peak_reserved_bytes"] = predicted[mode]
                row["reserved_prediction_error"] = (predicted[mode] / row["peak_reserved_bytes"]
                                                    - 1)
            rows.append(row)
            save()
            print(f"{model:9s} {mode:18s} reserved {row['peak_reserved_bytes'] / 2**30:7.2f} GiB  "
                  f"allocated {row['peak_allocated_bytes'] / 2**30:7.2f} GiB  "
                  f"step {row['median_step_s'] * 1e3:7.1f} ms", flush=True)
    for row in rows:
        base = next((b for b in rows if b["model"] == row["model"] and b["mode"] == "native"
                     and "error" not in b), None)
        if base is not None and "error" not in row:
            row["reserved_over_native"] = row["peak_reserved_bytes"] / base["peak_reserved_bytes"]
            row["step_time_over_native"] = row["median_step_s"] / base["median_step_s"]
    save()
    print(f"-> {RESULT}")
    replayed = all("error" not in r for r in replays)
    oom_told = all("error" not in o and o.get("failed") for o in oom.values())
    return 0 if (tests.returncode == 0 and replayed and oom_told
                 and all("error" not in r for r in rows)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
