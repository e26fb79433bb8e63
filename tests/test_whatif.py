"""pymemplan.advise and `pymemplan plan`: every row is a traced configuration."""

from __future__ import annotations

import base64
import json
import re
from html.parser import HTMLParser

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import pymemplan  # noqa: E402
from pymemplan.planner.errors import PlannerError  # noqa: E402
from pymemplan.planner.measure import measure_step  # noqa: E402
from pymemplan.whatif.advise import inputs_at_batch  # noqa: E402


class Net(nn.Module):
    def __init__(self, width=256, hidden=1024, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


B = 512  # activations dominate the peak: the techniques that shrink them matter


def loss_fn(out):
    return out.float().pow(2).mean()


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return Net()


def _advise(net, capacity, **kw):
    # Without the kernel-scratch probe (real oneDNN runs) unless a test compares with a
    # real step: the probe runs kernels at every batch size the searches try.
    kw.setdefault("probe_kernels", False)
    x = torch.randn(B, 256)
    return pymemplan.advise(net, (x,), capacity=capacity, loss_fn=loss_fn, device="cpu",
                            optimizer=torch.optim.Adam, **kw)


@pytest.fixture(scope="module")
def tight(net):
    """A capacity the step as it is does not fit, but bf16 or checkpointing does."""
    x = torch.randn(B, 256)
    full = pymemplan.trace(net, (x,), loss_fn=loss_fn, device="cpu",
                           optimizer=torch.optim.Adam, probe_kernels=False)
    return _advise(net, int(full.peak_bytes * 0.85)), full


def test_rows_are_traced_configurations(net, tight):
    a, full = tight
    assert a.baseline.peak_bytes == full.peak_bytes and a.baseline.fits is False
    bf16 = a.row("autocast bf16")
    t = pymemplan.trace(net, (torch.randn(B, 256),), loss_fn=loss_fn, device="cpu",
                        optimizer=torch.optim.Adam, autocast=torch.bfloat16,
                        probe_kernels=False)
    assert bf16.peak_bytes == t.peak_bytes
    sgd = a.row("optimizer sgd-momentum")
    # Momentum is one buffer a parameter, Adam two (plus Adam's 4-byte step counters).
    assert abs(2 * sgd.extra["state_bytes"] - a.row("optimizer adam").extra["state_bytes"]) \
        < 4 * len(list(net.parameters())) + 1
    assert {r.technique for r in a} >= {"baseline", "precision", "batch", "accumulation",
                                        "checkpoint", "optimizer", "weights", "best"}
    assert all(r.fits == (r.peak_bytes <= a.capacity_bytes) for r in a if r.peak_bytes)


def test_largest_batch_is_confirmed_at_the_answer_and_one_above(net, tight):
    a, _ = tight
    row = a.row("largest batch")
    b = row.extra["largest_batch"]
    x = torch.randn(B, 256)

    def peak(n):
        return pymemplan.trace(net, inputs_at_batch((x,), B, n), loss_fn=loss_fn,
                               device="cpu", optimizer=torch.optim.Adam,
                               probe_kernels=False).peak_bytes
    assert 1 <= b < B
    assert peak(b) <= a.capacity_bytes < peak(b + 1)


def test_accumulation_reaches_the_target_batch_with_gradients_present(net, tight):
    a, _ = tight
    row = a.row(f"accumulate to {B}")
    micro, steps = row.extra["micro_batch"], row.extra["steps"]
    assert micro * steps >= B and steps > 1 and row.fits
    assert row.extra["accumulated_gradient_bytes"] == sum(
        p.numel() * 4 for p in net.parameters())
    # The row is the last micro-step: gradients present, optimizer step included.
    assert row.trace.graph.meta["grads_present"] is True


def test_checkpoint_row_fits_by_tracing_the_checkpointed_model(net, tight):
    a, full = tight
    row = a.row("checkpointing")
    assert row.fits and row.config.checkpoint
    assert row.peak_bytes < full.peak_bytes
    assert row.relative_compute > 1.0  # recompute is traced, so it costs
    assert all(not hasattr(m, "_pymemplan_checkpoint") for m in net.modules())


def test_best_is_the_cheapest_row_that_fits(tight):
    a, _ = tight
    assert a.best is not None and a.best.fits
    fitting = [r for r in a if r.fits and r.technique in ("precision", "checkpoint",
                                                          "accumulation")]
    assert a.best.relative_compute <= min(r.relative_compute for r in fitting) + 1e-3
    c, code = a.best.config, a.best.code
    assert c.autocast is None or "torch.autocast" in code
    assert not c.checkpoint or "apply(model, {" in code
    assert c.accumulation == 1 or f"% {c.accumulation} == 0" in code


def test_allocator_rows_replay_the_same_step_through_other_allocators():
    # 272 MiB live; PyTorch's allocator reserves 322 MiB, expandable segments and
    # pymemplan-vmm 282 MiB: at 300 MiB only another allocator makes the step fit, at no
    # cost in compute, and that is the best row.
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(1536, 1536), nn.GELU())])
    x = torch.randn(384, 1536)

    def advise(**kw):
        return pymemplan.advise(model, (x,), capacity="300MiB", loss_fn=lambda o: o.sum(), **kw)

    a = advise(techniques=["allocator"])
    base, rows = a.baseline, a.rows_for("allocator")
    assert not base.fits
    assert [r.config.allocator for r in rows] == ["torch=expandable_segments:True",
                                                  "pymemplan-vmm"]
    cap = max(4 * base.peak_bytes, 1 << 30)
    for r in rows:
        assert r.trace is base.trace and r.peak_bytes == base.peak_bytes  # not traced again
        assert r.reserved_bytes == base.trace.reserved_peak(r.config.allocator, capacity=cap)
        assert r.reserved_bytes < base.reserved_bytes and r.fits and r.relative_compute == 1.0
    assert a.best.config.allocator == "torch=expandable_segments:True"
    assert 'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"' in a.best.code
    # With the batch rows, each allocator's largest batch; the policy given is no row.
    a = advise(techniques=["allocator", "batch"], policy="pymemplan-vmm")
    (row,) = a.rows_for("allocator")
    assert row.config.allocator == "torch=expandable_segments:True"
    assert row.extra["largest_batch"] >= 1 and "with pymemplan-vmm" in row.notes
    # On the CPU the fit is on live bytes: no allocator rows.
    assert advise(techniques=["allocator"], device="cpu", probe_kernels=False).rows_for(
        "allocator") == []


def test_best_combines_another_allocator_with_the_cheapest_row_it_makes_fit():
    # SGD, activations dominate: 308 MiB live (fp32), 216 MiB under bf16 autocast. At
    # 240 MiB no row fits alone: bf16 reserves 254 MiB under PyTorch's allocator, the
    # step as it is more than 300 MiB under any. bf16 with expandable segments (222 MiB)
    # fits, and is the best.
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.GELU())])
    a = pymemplan.advise(model, (torch.randn(4096, 1024),), capacity="240MiB",
                         loss_fn=lambda o: o.float().sum(), optimizer=torch.optim.SGD,
                         techniques=["precision", "allocator"])
    assert not any(r.fits for r in a if r.technique != "best")
    best = a.best
    assert best.config.autocast == "bf16" and best.config.allocator == (
        "torch=expandable_segments:True")
    assert best.fits and best.reserved_bytes <= 240 << 20 and best.relative_compute < 1
    assert "expandable_segments:True" in best.code and "torch.autocast" in best.code


def test_predictions_match_real_cpu_steps(net, tight):
    _, full = tight
    # With the probe, as CPU predictions are made by default: oneDNN's bf16 scratch counts.
    a = _advise(net, int(full.peak_bytes * 0.85), probe_kernels=True,
                techniques=("precision", "accumulation", "optimizer"))
    x = torch.randn(B, 256)
    cases = [(a.row("autocast bf16"), dict(autocast=torch.bfloat16)),
             (a.row(f"accumulate to {B}"), dict(grads_present=True)),
             (a.row("optimizer sgd-momentum"), {})]
    for row, kw in cases:
        c = row.config
        opt = (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9)) if c.optimizer else \
            torch.optim.Adam
        inputs = inputs_at_batch((x,), B, c.batch)
        inputs = tuple(torch.randn(i.shape) for i in inputs)
        m = measure_step(net, inputs, loss_fn=loss_fn, optimizer=opt, **kw)
        net.zero_grad(set_to_none=True)
        assert m.peak_bytes == row.peak_bytes, row.name


def test_capacity_below_the_parameters_names_what_could_fit(net):
    with pytest.raises(PlannerError, match=r"FSDP / ZeRO-3 over at least \d+ GPUs"):
        _advise(net, "1MiB")


@pytest.mark.parametrize("kw, match", [
    (dict(techniques=["precision", "magic"]), "unknown technique.*'magic'"),
    (dict(world_size=0), "world_size must be"),
    (dict(capacity="lots"), "not a size"),
    (dict(target_batch=-3), "target_batch must be"),
])
def test_bad_input_is_refused_clearly(net, kw, match):
    kw.setdefault("capacity", "1GiB")
    cap = kw.pop("capacity")
    with pytest.raises(PlannerError, match=match):
        _advise(net, cap, **kw)


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.ids, self.external = [], set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "img":
            self.imgs.append(a["src"])
        for k in ("src", "href"):
            if k in a and re.match(r"https?:|//", a[k]):
                self.external.append(a[k])
        if tag in ("script", "link"):
            self.external.append(tag)


def test_cli_json_and_self_contained_html(tmp_path, capsys):
    from pymemplan.cli import main

    page = tmp_path / "plan.html"
    rc = main(["plan", "mlp", "--batch", "64", "--capacity", "2GiB", "--device", "cpu", "--no-probe",
               "--techniques", "precision,checkpoint", "--json", "--html", str(page)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["capacity_bytes"] == 2 * 2**30 and doc["rows"][0]["technique"] == "baseline"
    p = _Page()
    p.feed(page.read_text())
    assert {"timeline", "breakdown", "advice", "code", "verdict"} <= p.ids
    assert not p.external  # opens with no server and no network
    assert len(p.imgs) == 2
    for src in p.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"


def test_torch_policy_follows_pytorch_cuda_alloc_conf():
    from pymemplan.whatif.advise import torch_policy_from_conf as policy

    assert policy(None) == policy("") == ("torch", [])
    assert policy("expandable_segments:True,garbage_collection_threshold:0.6") == (
        "torch=expandable_segments:True", ["garbage_collection_threshold:0.6"])
    # A list of divisions (commas inside brackets) is one setting, modelled too.
    assert policy("max_split_size_mb:256,roundup_power2_divisions:[256:1,>:8],"
                  "garbage_collection_threshold:0.6") == (
        "torch=max_split_size_mb:256,roundup_power2_divisions:[256:1,>:8]",
        ["garbage_collection_threshold:0.6"])
    assert policy("backend:cudaMallocAsync") == ("torch", ["backend:cudaMallocAsync"])
    with pytest.raises(ValueError, match="PYTORCH_CUDA_ALLOC_CONF='expandable_segments:yes'.*"
                                         "True or False"):
        policy("expandable_segments:yes")


def test_cli_reserved_memory_is_pytorchs_as_its_environment_sets_it(capsys, monkeypatch):
    from pymemplan.cli import main

    args = ["plan", "mlp", "--batch", "64", "--capacity", "2GiB", "--techniques", "precision",
            "--json"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,release_lock:1")
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["allocator_policy"] == "torch=expandable_segments:True"
    assert "not modelled: release_lock:1" in err
    assert main(args[:-1]) == 0  # the table says whose reserved memory decides the fit
    assert "memory PyTorch's allocator (expandable_segments:True) would reserve" in " ".join(
        capsys.readouterr().out.split())
    assert main(args + ["--policy", "pymemplan-vmm"]) == 0  # an explicit --policy wins
    assert json.loads(capsys.readouterr().out)["allocator_policy"] == "pymemplan-vmm"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:4")
    assert main(args) == 2
    assert capsys.readouterr().err.startswith("pymemplan plan: PYTORCH_CUDA_ALLOC_CONF=")


def test_cli_errors_are_one_line(capsys):
    from pymemplan.cli import main

    assert main(["plan", "mlp", "--capacity", "1KiB", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pymemplan plan:") and "FSDP" in err
    assert main(["plan", "mlp", "--world-size", "0"]) == 2


_FACTORY = '''
import torch
from torch import nn


def build({arg}):
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    return model, (x,), (lambda out: nn.functional.cross_entropy(out, y))
'''


def test_cli_factory_losses_are_built_per_batch(tmp_path, capsys):
    # The loss closes over targets of the factory's batch: rows at other batch sizes get
    # the factory's inputs and loss for theirs, or, if it takes no batch=, a hint.
    from pymemplan.cli import main

    takes = tmp_path / "takes.py"
    takes.write_text(_FACTORY.format(arg="batch=32"))
    rc = main(["plan", f"{takes}:build", "--capacity", "2MiB", "--device", "cpu",
               "--no-probe", "--techniques", "batch,accumulation", "--target-batch", "64",
               "--json"])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    assert {r["technique"] for r in doc["rows"]} >= {"batch", "accumulation"}
    fixed = tmp_path / "fixed.py"
    fixed.write_text(_FACTORY.format(arg="").replace("randn(batch", "randn(32").replace(
        "(batch,)", "(32,)"))
    assert main(["plan", f"{fixed}:build", "--capacity", "2MiB", "--device", "cpu",
                 "--no-probe", "--techniques", "batch", "--json"]) == 2
    err = capsys.readouterr().err
    assert "batch= parameter" in err and "--techniques precision,checkpoint" in err


def test_sharding_rows_are_per_rank_traces(net):
    a = _advise(net, "1GiB", world_size=2, techniques=("sharding",))
    rows = {r.config.sharding: r for r in a.rows_for("sharding")}
    assert set(rows) == {"ddp", "zero1", "zero2", "zero3", "fsdp"}
    # ZeRO-3 shards parameters, gradients and Adam state over the two ranks.
    assert rows["zero3"].breakdown["optimizer_state"] * 2 <= \
        a.baseline.breakdown["optimizer_state"] + 4096
    assert rows["zero3"].peak_bytes < a.baseline.peak_bytes < rows["ddp"].peak_bytes
    assert "torchrun --nproc_per_node=2" in rows["fsdp"].code
    assert rows["ddp"].extra["communication_bytes"]


def _bn_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 4))


def test_batch_searches_step_over_a_batch_the_model_cannot_run():
    # BatchNorm in training refuses a batch of 1: the searches go on above it, and answer a
    # batch the model runs, or say that none fits and why.
    model, x = _bn_mlp(), torch.randn(32, 64)

    def peak(b):
        return pymemplan.trace(model, (x[:b],), loss_fn=lambda o: o.pow(2).mean(),
                               optimizer=torch.optim.AdamW, device="cpu").peak_bytes

    cap = (peak(4) + peak(5)) // 2
    a = pymemplan.advise(model, (x,), capacity=cap, loss_fn=lambda o: o.pow(2).mean(),
                         device="cpu", techniques=["batch", "accumulation"])
    assert a.row("largest batch").extra["largest_batch"] == 4
    assert a.row("accumulate to 32").fits
    low = pymemplan.advise(model, (x,), capacity=peak(2) - 1, loss_fn=lambda o: o.pow(2).mean(),
                           device="cpu", techniques=["batch"])
    assert not low.row("largest batch").fits
    assert "a batch of 1 cannot run" in low.row("largest batch").notes


def test_inputs_without_a_batch_dimension_get_the_rows_that_do_not_need_one():
    class Counted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 4)

        def forward(self, n):
            return self.lin(torch.ones(n, 16))

    a = pymemplan.advise(Counted(), (8,), capacity="1GiB", loss_fn=lambda o: o.sum(),
                         device="cpu", techniques=["precision"])
    assert a.baseline.fits and a.row("autocast bf16").peak_bytes > 0
    with pytest.raises(PlannerError, match="batch is empty"):
        pymemplan.advise(_bn_mlp(), (torch.randn(0, 64),), capacity="1GiB", device="cpu",
                         loss_fn=lambda o: o.sum(), techniques=["precision"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(capacity=float("inf")), "capacity=inf is not a size"),
    (dict(target_batch=True), "target_batch must be a positive integer, got True"),
    (dict(model=lambda x: x), "model must be a torch.nn.Module, got function"),
    # A misspelt keyword for pymemplan.trace: refused before tracing, not a TypeError deep in.
    (dict(probe_kernel=False), "unexpected keyword argument 'probe_kernel'"),
    (dict(grads_present=True), "sets grads_present= itself"),
])
def test_advise_arguments_that_make_no_sense_are_clear_errors(kwargs, message):
    args = dict(model=nn.Linear(4, 4), capacity="1GiB") | kwargs
    with pytest.raises(PlannerError, match=re.escape(message)):
        pymemplan.advise(args.pop("model"), (torch.randn(2, 4),), loss_fn=lambda o: o.sum(),
                         device="cpu", **args)


def test_one_technique_may_be_named_by_itself():
    a = pymemplan.advise(nn.Linear(4, 4), (torch.randn(2, 4),), capacity="1GiB",
                         loss_fn=lambda o: o.sum(), device="cpu", techniques="precision")
    assert {r.technique for r in a.rows} == {"baseline", "precision", "best"}


class _SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64)
        self.c3, self.fc = nn.Conv2d(64, 64, 3, padding=1), nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        return self.fc(torch.relu(self.c3(x)).mean((2, 3)))


def test_largest_batch_holds_where_reserved_memory_falls_as_the_batch_grows():
    # The allocator's segment sizes make this step reserve 26 MiB at batches 5-8 under bf16
    # and 22 MiB at 9-13: a bracket on reserved memory stopped at 4. The live peak grows
    # with the batch and reserved memory holds it, so nothing above the live answer fits.
    torch.manual_seed(0)
    with torch.device("meta"):
        model, x = _SmallCNN(), torch.empty(16, 3, 64, 64)
    cap = 23 << 20
    a = pymemplan.advise(model, (x,), capacity=cap, loss_fn=lambda o: o.float().mean(),
                         device="cuda", techniques=["batch"])
    best = a.row("largest batch (autocast bf16)").extra["largest_batch"]

    def reserved(b):
        return pymemplan.trace(model, (x[:b],), loss_fn=lambda o: o.float().mean(),
                               optimizer=torch.optim.AdamW, device="cuda",
                               autocast=torch.bfloat16).reserved_peak("torch", capacity=1 << 30)

    assert reserved(best) <= cap and reserved(best + 1) > cap
    assert best >= 9 and reserved(5) > cap  # a batch below the answer does not fit


def test_printed_code_runs_and_does_what_its_row_says(net, tight):
    # Each row's code, run on the model for the device advised (here the CPU): autocast
    # active in every forward, the micro-steps of accumulation under it, the row's own
    # checkpoint plan applied, the optimizer stepping.
    from pymemplan.planner.checkpoint import apply, remove

    a, _ = tight
    x = torch.randn(B, 256)
    dtypes = []
    hook = net.blocks[0][0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))

    def marked():
        return {n for n, m in net.named_modules() if getattr(m, "_pymemplan_checkpointed", 0)}

    try:
        for name in ("autocast bf16", f"accumulate to {B} (autocast bf16)", "checkpointing",
                     "largest batch (autocast bf16 + checkpointing)"):
            row = a.row(name)
            c = row.config
            dtypes.clear()
            opt = torch.optim.Adam(net.parameters())
            before = net.head.weight.detach().clone()
            ns = dict(torch=torch, pymemplan=pymemplan, model=net, inputs=(x,),
                      loss_fn=loss_fn, optimizer=opt, dataset=(x,),
                      DataLoader=lambda ds, batch_size: [(ds[0][:batch_size],)] * 8)
            try:
                exec(row.code, ns)
                applied = marked()
            finally:
                remove(net)
            want = torch.bfloat16 if c.autocast == "bf16" else torch.float32
            if "model(" in row.code:
                assert dtypes and set(dtypes) == {want}, (name, row.code)
            if "optimizer.step()" in row.code:
                assert not torch.equal(before, net.head.weight), (name, row.code)
            if c.checkpoint:
                apply(net, dict(c.checkpoint))
                try:
                    assert applied and applied == marked(), (name, row.code)
                finally:
                    remove(net)
            if c.accumulation > 1:
                assert f"batch_size={c.batch}" in row.code and len(dtypes) == 8
    finally:
        hook.remove()


def test_checkpointed_batch_search_steps_over_a_batch_the_model_cannot_run():
    # The largest batch with checkpointing traces checkpoint plans at each batch tried: a
    # batch the model cannot run (BatchNorm at 1) is stepped over there too, not an error.
    model, x = _bn_mlp(), torch.randn(32, 64)
    peak2 = pymemplan.trace(model, (x[:2],), loss_fn=lambda o: o.pow(2).mean(),
                            optimizer=torch.optim.AdamW, device="cpu",
                            probe_kernels=False).peak_bytes
    a = pymemplan.advise(model, (x,), capacity=peak2 - 1, loss_fn=lambda o: o.pow(2).mean(),
                         device="cpu", techniques=["batch", "checkpoint"], probe_kernels=False)
    rows = a.rows_for("batch")
    assert [r.name for r in rows][-1] == "largest batch (autocast bf16 + checkpointing)"
    for r in rows:
        assert r.fits is False and r.extra["largest_batch"] == 0
        assert "a batch of 1 cannot run" in r.notes


def test_a_batch_made_by_resizing_the_inputs_that_fails_says_so():
    # The batch of a sequence-first input is its dim 1: resizing dim 0 where it equals the
    # first input's leaves it as it is, and the step fails at any other batch. The error says
    # at which batch, which inputs kept their size, and what to pass instead.
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 64), nn.Linear(32, 64)

        def forward(self, x, ctx):
            return (self.a(x) + self.b(ctx).mean(0)).pow(2).mean()

    x, ctx = torch.randn(16, 32), torch.randn(8, 16, 32)
    with pytest.raises(PlannerError, match=r"(?s)traced at batch \d+: .*left as they were: "
                                           r"input 1: \(8, 16, 32\).*make_inputs="):
        pymemplan.advise(TwoInputs(), (x, ctx), capacity="1GiB", device="cpu",
                         techniques=["batch"], probe_kernels=False)


def test_best_does_not_pass_another_effective_batch_off_as_the_same_training(net, tight):
    # A prime target: no micro-batch that fits divides it, so accumulation reaches more
    # samples a step. That is another batch: the best says so, as for the rows that change
    # the training; with a target it reaches exactly, it does not.
    a0, _ = tight
    for target, exact in ((509, False), (512, True)):
        a = _advise(net, a0.capacity_bytes, techniques=["accumulation"], target_batch=target)
        c = a.best.config
        assert (c.batch * c.accumulation == target) is exact
        assert ("changes the training itself" in a.best.notes) is not exact
        if not exact:
            assert f"{c.batch * c.accumulation} samples a step, not {target}" in a.best.notes


def test_best_steps_over_micro_batches_the_model_cannot_run():
    # When nothing fits alone, the best tries micro-batches with checkpointing, down to the
    # divisors of the target: one the model cannot run (BatchNorm at 1, as in densenet121 at
    # 32 x 32) is not a candidate, not the end of the whole comparison.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 4))
    x = torch.randn(2, 64)
    peak = pymemplan.trace(model, (x,), loss_fn=loss_fn, optimizer=torch.optim.AdamW,
                           device="cpu", probe_kernels=False).peak_bytes
    a = pymemplan.advise(model, (x,), capacity=int(peak * 0.9), loss_fn=loss_fn, device="cpu",
                         probe_kernels=False, techniques=["accumulation", "checkpoint"])
    assert a.best is None and not any(r.fits for r in a)
