"""Bad input gets a clear error that names what was wrong and how to fix it."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import pymemplan  # noqa: E402
from pymemplan.planner import PlannerError, UntraceableError  # noqa: E402


class Gate(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if self.mode == "item":
            return x * x.abs().max().item()
        if self.mode == "if":
            return x if x.sum() > 0 else -x
        return x[x > 0]  # data-dependent output size


class Net(nn.Module):
    def __init__(self, mode="item"):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 8), Gate(mode))
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.enc(x))


def mean_loss(out):
    return out.mean()


@pytest.mark.parametrize("mode", ["item", "if", "mask"])
def test_value_dependent_forward_names_op_module_and_fix(mode):
    with pytest.raises(UntraceableError) as e:
        pymemplan.trace(Net(mode), (torch.randn(4, 8),), loss_fn=mean_loss)
    msg = str(e.value)
    assert "module 'enc.1'" in msg
    assert "aten." in msg                      # the op
    assert "torch.where" in msg and "values" in msg  # what to change
    # and the line of the model's code that asked, as far down as the module's own frames
    line = {"item": "x.abs().max().item()", "if": "x.sum() > 0", "mask": "x[x > 0]"}[mode]
    lineno = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if line in text)
    assert f"test_planner_errors.py:{lineno}, in forward)" in msg


class PackedRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(100, 16), nn.LSTM(16, 32, batch_first=True), nn.Linear(32, 3)

    def forward(self, ids, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True,
                                                   enforce_sorted=False)
        _, (h, _) = self.rnn(packed)
        return self.out(h[-1])


@pytest.mark.parametrize("lengths", [torch.tensor([10, 7, 5, 3]), [10, 7, 5, 3]])
def test_a_packed_sequence_says_it_cannot_be_traced_and_what_to_do(lengths):
    # The generic advice (pass the value as a Python number) does not help here: the packed
    # size needs the lengths' values even when they are a list.
    with pytest.raises(UntraceableError, match=r"packs a padded batch .*pack_padded_sequence.*"
                                               r"run the RNN on the padded batch") as e:
        pymemplan.trace(PackedRNN(), (torch.randint(0, 100, (4, 10)), lengths), loss_fn=mean_loss)
    assert "test_planner_errors.py" in str(e.value) and "Python number" not in str(e.value)


def test_a_mask_without_a_density_says_how_to_give_one():
    with pytest.raises(UntraceableError, match="nonzero_density=") as e:
        pymemplan.trace(Net("mask"), (torch.randn(4, 8),), loss_fn=mean_loss)
    assert "1/E" in str(e.value)


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, "1/8", True, float("nan")])
def test_nonzero_density_outside_0_1_is_an_error(bad):
    with pytest.raises(PlannerError, match=r"nonzero_density=.*\(0, 1\]"):
        pymemplan.trace(Net("mask"), (torch.randn(4, 8),), loss_fn=mean_loss,
                        nonzero_density=bad)


def test_a_density_does_not_hide_other_value_dependent_code():
    # .item() and `if tensor:` still need values: a density sizes masks only.
    for mode in ("item", "if"):
        with pytest.raises(UntraceableError, match="enc.1"):
            pymemplan.trace(Net(mode), (torch.randn(4, 8),), loss_fn=mean_loss,
                            nonzero_density=0.5)


def test_inputs_that_do_not_fit_the_model():
    model = Net()
    with pytest.raises(UntraceableError) as e:
        pymemplan.trace(model, (torch.randn(4, 5),), loss_fn=mean_loss)
    msg = str(e.value)
    assert "module 'enc.0'" in msg and "aten." in msg
    assert "tensor(4, 5)" in msg and "inputs fit the model" in msg

    with pytest.raises(UntraceableError, match=r"do not fit Net\.forward\(x\)"):
        pymemplan.trace(model, (torch.randn(4, 8), torch.randn(4, 8)), loss_fn=mean_loss)
    with pytest.raises(PlannerError, match="tuple of positional arguments"):
        pymemplan.trace(model, {"x": torch.randn(4, 8)}, loss_fn=mean_loss)


def test_loss_that_is_not_a_scalar():
    model = nn.Linear(8, 3)
    with pytest.raises(PlannerError, match=r"scalar, got a tensor of shape \(4, 3\).*loss_fn"):
        pymemplan.trace(model, (torch.randn(4, 8),))
    with pytest.raises(PlannerError, match="scalar"):
        pymemplan.trace(model, (torch.randn(4, 8),), loss_fn=lambda out: out.sum(0))
    with pytest.raises(PlannerError, match="does not depend on any parameter"):
        pymemplan.trace(model, (torch.randn(4, 8),), loss_fn=lambda out: out.detach().sum())
    with pytest.raises(PlannerError, match="not a scalar loss; pass loss_fn"):
        pymemplan.trace(nn.LSTM(8, 8), (torch.randn(2, 3, 8),))


@pytest.mark.parametrize("bad", [42, nn.Linear, "adam", lambda params: nn.Linear(2, 2)],
                         ids=["int", "module_class", "string", "factory_returning_module"])
def test_optimizer_that_is_not_an_optimizer(bad):
    with pytest.raises(PlannerError, match="not (an optimizer|a torch.optim.Optimizer)"):
        pymemplan.trace(nn.Linear(8, 1), (torch.randn(4, 8),), loss_fn=mean_loss, optimizer=bad)


def test_optimizer_instance_is_rebuilt_on_fake_parameters():
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    t = pymemplan.trace(model, (torch.randn(4, 8),), loss_fn=mean_loss, optimizer=opt,
                        device="cpu")
    assert t.graph.meta["optimizer"] == "SGD"
    assert t.breakdown(0)["optimizer_state"] == 9 * 4  # one momentum buffer per parameter
    assert opt.state == {} or all(not v for v in opt.state.values())  # the real one untouched


def test_other_bad_arguments():
    model = nn.Linear(8, 1)
    x = torch.randn(4, 8)
    with pytest.raises(PlannerError, match="'cuda' .* or 'cpu'"):
        pymemplan.trace(model, (x,), loss_fn=mean_loss, device="tpu")
    with pytest.raises(PlannerError, match="autocast"):
        pymemplan.trace(model, (x,), loss_fn=mean_loss, autocast=torch.float64)
    with pytest.raises(PlannerError, match="nn.Module"):
        pymemplan.trace(lambda x: x, (x,), loss_fn=mean_loss)
    # A TorchScript submodule: named, where hooks could not be registered before.
    scripted = nn.Sequential(nn.Linear(8, 8), torch.jit.script(nn.Linear(8, 8)))
    with pytest.raises(PlannerError, match="'1' is a TorchScript module"):
        pymemplan.trace(scripted, (x,), loss_fn=mean_loss)
    t = pymemplan.trace(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1)), (x,),
                        loss_fn=mean_loss, device="cpu")
    with pytest.raises(PlannerError, match="count of tensors"):
        t.tensors_at_peak(-1)
    with pytest.raises(PlannerError, match="policies must be some of"):
        t.plan(t.peak_bytes, policies=("bogus",))
    # A failed trace leaves the model as it was.
    model.train(False)
    with pytest.raises(UntraceableError):
        pymemplan.trace(Net(), (torch.randn(4, 8),), loss_fn=mean_loss)
    assert model.training is False


class Broken(nn.Module):
    """Fails in Python, before any op: as a model reading a config attribute it lacks."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * self.missing_setting


def test_python_error_in_a_forward_names_the_module_and_line_not_the_loss():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), Broken()))
    with pytest.raises(UntraceableError) as e:
        pymemplan.trace(model, (torch.randn(4, 8),), loss_fn=mean_loss)
    msg = str(e.value)
    assert "module '1.1'" in msg and "outside the model" not in msg
    assert "missing_setting" in msg and "test_planner_errors.py:" in msg
    # The same error raised by the loss function is placed there.

    def bad_loss(out):
        raise AttributeError("the loss needs a 'missing_setting'")
    with pytest.raises(UntraceableError, match=r"outside the model \(the loss function\?\)"):
        pymemplan.trace(nn.Linear(8, 8), (torch.randn(4, 8),), loss_fn=bad_loss)


class ComplexParam(nn.Module):
    """A complex weight beside real ones, as in a spectral (Fourier) layer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.cfloat))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin((x.to(torch.cfloat) @ self.w).abs())


def test_an_optimizer_that_refuses_the_parameters_is_named_as_the_failure():
    # Adafactor refuses complex parameters in its first step, where the state is made.
    with pytest.raises(UntraceableError, match=r"^the optimizer's step failed \(.*_adafactor\.py:"
                                               r"\d+, in \w+\): RuntimeError: .*complex"):
        pymemplan.trace(ComplexParam(), (torch.randn(4, 8),), loss_fn=mean_loss,
                        optimizer=torch.optim.Adafactor)


@pytest.mark.parametrize("how", ["class", "factory", "instance"])
def test_an_optimizer_whose_step_needs_a_closure_is_a_clear_error(how):
    # LBFGS's step() runs forward and backward again through a closure: before, the trace
    # failed inside torch with "step() missing 1 required positional argument: 'closure'".
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = {"class": torch.optim.LBFGS,
                 "factory": lambda params: torch.optim.LBFGS(params, history_size=10),
                 "instance": torch.optim.LBFGS(model.parameters())}[how]
    history = 10 if how == "factory" else 100
    trained = sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(UntraceableError, match=r"^LBFGS\.step\(\) takes a closure") as e:
        pymemplan.trace(model, (torch.randn(4, 64),), loss_fn=mean_loss, optimizer=optimizer)
    assert f"up to {history} pairs" in str(e.value)
    assert pymemplan.units.format_bytes((2 * history + 2) * trained) in str(e.value)
    assert "optimizer=None" in str(e.value)


def test_advise_gives_a_row_to_an_optimizer_that_cannot_run_and_goes_on(tmp_path):
    advice = pymemplan.advise(ComplexParam(), (torch.randn(4, 8),), capacity="1GiB",
                              loss_fn=mean_loss, device="cpu", world_size=2,
                              techniques=("optimizer", "sharding"))
    row = advice.row("optimizer adafactor")
    assert row.peak_bytes is None and row.fits is None
    assert "cannot run on this model" in row.notes and "complex" in row.notes
    assert advice.row("optimizer adam").fits is True
    # ZeRO-1 refuses parameters of mixed dtypes; DDP runs.
    zero1 = advice.row("zero1 x 2")
    assert zero1.peak_bytes is None and "cannot run on this model" in zero1.notes
    assert advice.row("ddp x 2").fits is True
    assert "optimizer adafactor" in advice.summary(200)
    import json
    assert json.loads(advice.to_json())["rows"]
    advice.to_html(tmp_path / "plan.html")
    assert "optimizer adafactor" in (tmp_path / "plan.html").read_text()


def test_sparse_gradients_are_a_clear_error():
    model = nn.EmbeddingBag(1000, 16, mode="sum", sparse=True)
    ids = torch.randint(0, 1000, (8, 4))
    with pytest.raises(UntraceableError, match=r"does not model sparse tensors yet .*sparse=False"):
        pymemplan.trace(model, (ids,), loss_fn=lambda o: o.sum(), device="cpu")


@pytest.mark.parametrize("dtype", [torch.long, torch.float64, torch.bfloat16])
def test_inputs_of_the_wrong_dtype_are_refused_as_eager_refuses_them(dtype):
    # The fake matmul kernels do not check dtypes: a Long input to a float Linear traced
    # and got a peak for a step eager cannot run.
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    x = torch.ones(8, 16, dtype=dtype)
    with pytest.raises(RuntimeError):
        model(x)
    with pytest.raises(UntraceableError, match=r"(?s)same dtype.*inputs fit the model"):
        pymemplan.trace(model, (x,), loss_fn=lambda o: o.float().sum(), device="cpu")


class Converts(nn.Module):
    """Converts a submodule in forward, as Switch Transformers' router does."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype, self.router, self.body = dtype, nn.Linear(16, 4), nn.Linear(16, 16)

    def forward(self, x):
        self.router = self.router.to(self.dtype)
        return self.body(x) * self.router(x).softmax(-1).sum(-1, keepdim=True)


def test_a_conversion_in_forward_that_changes_nothing_traces():
    from pymemplan.planner.measure import measure_step

    model, x = Converts(torch.float32), torch.randn(32, 16)
    predicted = pymemplan.trace(model, (x,), loss_fn=mean_loss, device="cpu").peak_bytes
    assert predicted == measure_step(model, (x,), loss_fn=mean_loss).peak_bytes
    # ... and the model's parameters are still the real ones afterwards.
    assert not isinstance(model.router.weight, torch._subclasses.FakeTensor)


def test_a_conversion_in_forward_that_changes_dtype_is_a_clear_error():
    model = Converts(torch.float64)
    with pytest.raises(PlannerError, match="'router' converts its parameters.*before tracing"):
        pymemplan.trace(model, (torch.randn(32, 16),), loss_fn=mean_loss, device="cpu")
    assert model.router.weight.dtype == torch.float32


def test_a_tensor_value_used_as_a_python_value_gets_the_value_hint():
    class Experts(nn.ModuleDict):
        def __init__(self):
            super().__init__({f"e{i}": nn.Linear(8, 8) for i in range(2)})

        def forward(self, x):
            pick = x.argmax(-1)[0]
            return self[f"e{pick}"](x)  # a tensor formatted into a key

    with pytest.raises(UntraceableError, match="uses the value of a tensor.*Code that needs"):
        pymemplan.trace(Experts(), (torch.randn(4, 8),), loss_fn=mean_loss, device="cpu")


def test_a_tensor_cached_outside_the_model_does_not_stay_fake():
    # A model caching a table in a functools.lru_cache (BEiT's relative position index,
    # DINOv3's patch coordinates): the trace filled the cache with a fake tensor, and every
    # real forward after it computed on fake tensors.
    import functools

    calls = []

    @functools.lru_cache(maxsize=4)
    def table(n, d):
        return torch.sin(torch.arange(n * d, dtype=torch.float32).reshape(n, d))

    @functools.lru_cache(maxsize=None)
    def register_once():
        calls.append(1)

    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            register_once()
            return self.lin(x + table(x.shape[0], x.shape[1]))

    x = torch.randn(8, 16)
    pymemplan.trace(Cached(), (x,), loss_fn=mean_loss, device="cpu")
    out = Cached()(x)
    assert not isinstance(out, torch._subclasses.FakeTensor)
    assert torch.isfinite(out).all()
    # A cache that holds no fake tensor is kept: its function ran once.
    register_once()
    assert calls == [1]


@pytest.mark.parametrize("kwargs, message", [
    ({"train": "no"}, "train must be True or False, got 'no'"),
    ({"grads_present": 1}, "grads_present must be True or False"),
    ({"grad_scaler": True}, "grad_scaler=True traces GradScaler's part of an optimizer step"),
])
def test_flags_that_are_not_flags_are_refused(kwargs, message):
    with pytest.raises(PlannerError, match=message):
        pymemplan.trace(nn.Linear(8, 1), (torch.randn(4, 8),), loss_fn=mean_loss, device="cpu",
                        **kwargs)


def test_module_patterns_that_match_nothing_are_named_as_the_problem():
    # It was a BudgetTooSmallError whose "least achievable peak" was the unplanned one.
    from pymemplan.planner.checkpoint.plan import BudgetTooSmallError

    m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(512, 64)
    t = pymemplan.trace(m, (x,), loss_fn=lambda o: o.mean(), device="cpu")
    with pytest.raises(PlannerError, match=r"matches no module.*such as '0'") as e:
        t.plan(t.peak_bytes // 2, model=m, inputs=(x,), modules=["encoder.*"])
    assert not isinstance(e.value, BudgetTooSmallError)
    assert t.plan(t.peak_bytes, model=m, inputs=(x,), modules=["?"]).budget_bytes == t.peak_bytes


class _MixedScatter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):  # eager refuses it too: the source is fp16, the destination fp32
        return torch.zeros(4, 8).scatter_add(1, torch.zeros(4, 8, dtype=torch.long),
                                             self.lin(x).half()).sum()


def test_an_op_the_fake_kernel_refuses_gives_one_clear_error_and_no_logged_traceback():
    # FakeTensorMode logs the kernel's refusal with its traceback at error level before
    # raising it: 19 lines of torch internals above the planner's own message.
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("torch._subclasses.fake_tensor")
    log.addHandler(handler)
    try:
        with pytest.raises(UntraceableError, match=r"scatter_add.*Expected self.dtype to be equal"):
            pymemplan.trace(_MixedScatter(), (torch.randn(4, 8),))
    finally:
        log.removeHandler(handler)
    assert not [r for r in records if r.levelno >= logging.ERROR]


class _MixedIndexOps(nn.Module):
    """An MoE layer's pattern: expert outputs (bf16 under autocast) accumulated into an fp32
    buffer. Eager on the CPU refuses each of these; the meta kernels of the index ops do not
    check the dtypes."""

    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.how = how

    def forward(self, x):
        y = self.lin(x)  # bf16 under autocast
        buf = torch.zeros(4, 8, device=x.device)
        idx = torch.arange(4, device=x.device)
        if self.how == "index_add":
            out = buf.index_add(0, idx, y)
        elif self.how == "setitem":
            buf[idx] = y
            out = buf
        elif self.how == "index_put":
            out = buf.index_put((idx,), y, accumulate=True)
        elif self.how == "scatter_add":
            out = buf.scatter_add(0, torch.zeros(4, 8, dtype=torch.long, device=x.device), y)
        elif self.how == "dot":
            return torch.dot(y[0], buf[0])
        else:
            out = buf.put(idx, y[:, 0])
        return out.sum()


@pytest.mark.parametrize("how,message", [
    ("index_add", r"index_add_\(\): self \(Float\) and source \(BFloat16\) must have the same"),
    ("setitem", r"Index put requires the source and destination dtypes match, got Float"),
    ("index_put", r"Index put requires the source and destination dtypes match"),
    ("put", r"put_\(\): self and source expected to have the same dtype"),
])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_index_ops_with_a_source_of_another_dtype_fail_as_in_eager(how, message, device):
    model = _MixedIndexOps(how)
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=message):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)  # eager on the CPU refuses it
    if device == "cuda" and how == "index_put":
        # CUDA's autocast casts the operands of the out-of-place index_put to the widest
        # dtype (not those of the in-place one a setitem makes): eager on CUDA runs it, and
        # so does the trace, with the cast.
        t = pymemplan.trace(model, (x,), autocast=torch.bfloat16, device=device)
        ops = [o.name for o in t.graph.ops if o.phase == "forward"]
        before = ops[:ops.index("aten.index_put.default")]
        # Linear's three casts, then the source's.
        assert before.count("aten._to_copy.default") == 4, before
    else:
        with pytest.raises(UntraceableError, match=message + r".*cast the source to torch.float32"):
            pymemplan.trace(model, (x,), autocast=torch.bfloat16, device=device)
    # Without autocast the dtypes agree, and it traces.
    assert pymemplan.trace(model, (x,), device=device).peak_bytes > 0


@pytest.mark.parametrize("how", ["scatter_add", "dot"])
def test_cuda_autocast_promotes_ops_the_cpus_autocast_does_not(how):
    # CUDA's autocast casts the operands of these ops to the widest dtype; the CPU's does not,
    # and eager on the CPU refuses them. The planner traces under the CPU's autocast, so the
    # CUDA target refused a step that a GPU runs.
    model, x = _MixedIndexOps(how), torch.randn(4, 8)
    with pytest.raises(RuntimeError):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
    with pytest.raises(UntraceableError, match=how):
        pymemplan.trace(model, (x,), autocast=torch.bfloat16, device="cpu")
    t = pymemplan.trace(model, (x,), autocast=torch.bfloat16, device="cuda")
    ops = [o.name for o in t.graph.ops if o.phase == "forward"]
    before = ops[:ops.index(f"aten.{how}.default")]
    assert before.count("aten._to_copy.default") == 4, before  # Linear's three, the source's


@pytest.mark.parametrize("where", ["model", "submodule"])
def test_a_compiled_model_is_traced_as_eager_and_says_so(where):
    # trace() runs a compiled module's original forward op by op: the eager step, which a
    # compiled step undercuts (found 2.6x above the compiled peak on an elementwise MLP).
    # The figure is the eager step's, and a warning says so rather than pass it silently.
    body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    model = torch.compile(body) if where == "model" else nn.Sequential(torch.compile(body))
    with pytest.warns(UserWarning, match=r"compiled with torch\.compile: pymemplan\.trace "
                                         r"predicts the eager step") as caught:
        t = pymemplan.trace(model, (torch.randn(8, 16),), loss_fn=mean_loss, device="cpu")
    assert ("'0'" in str(caught[0].message)) == (where == "submodule")
    assert t.peak_bytes == pymemplan.trace(body, (torch.randn(8, 16),), loss_fn=mean_loss,
                                           device="cpu").peak_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing for a model that is not compiled
        pymemplan.trace(body, (torch.randn(8, 16),), loss_fn=mean_loss, device="cpu")


def test_a_lazy_module_not_run_yet_says_to_run_it_once():
    # Its parameters have no shape until a first forward; before, torch's own error about
    # an uninitialized parameter surfaced from deep inside the trace.
    model = nn.Sequential(nn.Linear(8, 8), nn.LazyLinear(4))
    with pytest.raises(PlannerError, match=r"parameters not made yet \(1\.weight, 1\.bias\): a "
                                           r"lazy module .* Run the model once"):
        pymemplan.trace(model, (torch.randn(2, 8),), loss_fn=mean_loss)
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert pymemplan.trace(model, (torch.randn(2, 8),), loss_fn=mean_loss).peak_bytes > 0


def test_sparse_parameters_buffers_and_inputs_are_refused_by_name():
    # Their fake copies would be dense (a sparse tensor's strides are zeros): a GCN's sparse
    # adjacency was predicted 10 times over what its step takes, without a word.
    class GCN(nn.Module):
        def __init__(self, adj):
            super().__init__()
            self.register_buffer("adj", adj)
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return torch.sparse.mm(self.adj, self.lin(x))

    n = 64
    adj = torch.sparse_coo_tensor(torch.randint(0, n, (2, 200)), torch.rand(200), (n, n))
    with pytest.raises(UntraceableError, match=r"buffer 'adj' is a sparse_coo tensor of shape "
                                               r"\(64, 64\): the planner does not model sparse"):
        pymemplan.trace(GCN(adj), (torch.randn(n, 16),), loss_fn=mean_loss, device="cpu")
    dense = GCN(torch.zeros(n, n))
    with pytest.raises(UntraceableError, match=r"input '1' is a sparse_csr tensor"):
        pymemplan.trace(nn.Bilinear(4, 4, 2),
                        (torch.randn(3, 4), torch.eye(4)[:3].to_sparse_csr()),
                        loss_fn=mean_loss, device="cpu")
    assert pymemplan.trace(dense, (torch.randn(n, 16),), loss_fn=mean_loss,
                           device="cpu").peak_bytes > 0


def test_gradient_hooks_on_parameters_are_traced_and_post_accumulate_hooks_refused():
    from pymemplan.planner.measure import measure_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    x = torch.randn(64, 256)
    plain = pymemplan.trace(model, (x,), loss_fn=mean_loss, device="cpu").peak_bytes
    # A hook that replaces each gradient (clipping by hook) makes one more per parameter.
    for p in model.parameters():
        p.register_hook(lambda g: g.clamp(-0.01, 0.01))
    hooked = pymemplan.trace(model, (x,), loss_fn=mean_loss, device="cpu").peak_bytes
    assert hooked > plain
    assert hooked == measure_step(model, (x,), loss_fn=mean_loss).peak_bytes
    # Optimizer-in-backward steps the real parameters: it cannot run on the trace's copies.
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    model[0].weight.register_post_accumulate_grad_hook(lambda p: opts[p].step())
    with pytest.raises(UntraceableError, match=r"parameter\(s\) 0\.weight have hooks "
                                               r"registered with register_post_accumulate_grad_hook"):
        pymemplan.trace(model, (x,), loss_fn=mean_loss, device="cpu")


def test_value_reads_in_pytorchs_own_code_name_the_setting_that_makes_them():
    # BatchNorm's cumulative average reads num_batches_tracked.item(); torch.distributions
    # validates its arguments' values; unique's size is not a mask's share. Each refusal
    # says what to change, not only the generic advice.
    bn = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None))
    with pytest.raises(UntraceableError, match=r"module '1' needs the value of a tensor\. Asked "
                                               r"for by library code \(.*batchnorm\.py:\d+, in "
                                               r"forward\)\. BatchNorm1d\(momentum=None\)"):
        pymemplan.trace(bn, (torch.randn(4, 8),), loss_fn=mean_loss, device="cpu")

    class VAE(nn.Module):
        def __init__(self, validate):
            super().__init__()
            self.enc, self.validate = nn.Linear(8, 16), validate

        def forward(self, x):
            mu, logvar = self.enc(x).chunk(2, dim=-1)
            d = torch.distributions.Normal(mu, logvar.exp(), validate_args=self.validate)
            return d.rsample()

    with pytest.raises(UntraceableError, match=r"validate_args=False to the distribution"):
        pymemplan.trace(VAE(True), (torch.randn(4, 8),), loss_fn=mean_loss, device="cpu")
    assert pymemplan.trace(VAE(False), (torch.randn(4, 8),), loss_fn=mean_loss,
                           device="cpu").peak_bytes > 0

    class Dedup(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 8)

        def forward(self, ids):
            uniq, inverse = torch.unique(ids, return_inverse=True)
            return self.emb(uniq)[inverse]

    ids = torch.randint(0, 100, (4, 16))
    with pytest.raises(UntraceableError) as e:
        pymemplan.trace(Dedup(), (ids,), loss_fn=mean_loss, device="cpu", nonzero_density=0.5)
    assert "nonzero_density= does not size aten._unique2.default" in str(e.value)
    assert "pass nonzero_density=" not in str(e.value)
    with pytest.raises(UntraceableError, match=r"pass nonzero_density="):  # not given: offered
        pymemplan.trace(Gate("mask"), (torch.randn(4, 8),), loss_fn=mean_loss, device="cpu")


def test_a_cuda_autocast_region_the_model_opens_itself_is_said_on_a_cuda_target():
    # CUDA's autocast cannot be enabled without a GPU: the region ran in full precision on
    # the trace's CPU tensors, and the prediction was the fp32 step's without a word.
    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return self.lin(x)

    x = torch.randn(32, 64)
    with pytest.warns(UserWarning, match=r"opens torch\.autocast\('cuda', \.\.\.\) itself "
                                         r"\(bfloat16\).*Pass autocast=torch\.bfloat16"):
        pymemplan.trace(Half(), (x,), loss_fn=mean_loss, device="cuda")
    with pytest.warns(UserWarning, match=r"traced as the rest of the forward pass, under "
                                         r"the autocast=torch\.bfloat16"):
        pymemplan.trace(Half(), (x,), loss_fn=mean_loss, device="cuda", autocast=torch.bfloat16)
    with warnings.catch_warnings():  # a model that opens none: nothing to say
        warnings.simplefilter("error", UserWarning)
        pymemplan.trace(nn.Linear(64, 64), (x,), loss_fn=mean_loss, device="cuda")
