"""`pymemplan trace` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from pymemplan.cli import main  # noqa: E402


def test_trace_builtin_model_json(capsys):
    rc = main(["trace", "mlp", "--batch", "8", "--device", "cpu", "--optimizer", "none", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["device"] == "cpu" and d["meta"]["optimizer"] is None
    assert d["peak_bytes"] == sum(d["breakdown"].values())
    # 24 x Linear(2048, 2048) + Linear(2048, 1000): the parameters alone.
    assert d["breakdown"]["parameter"] == (24 * (2048 * 2048 + 2048) + 2048 * 1000 + 1000) * 4


def test_trace_table_plot_and_autocast(tmp_path, capsys):
    png = tmp_path / "gpt2.png"
    rc = main(["trace", "gpt2", "--batch", "1", "--seq-len", "32", "--autocast", "bf16",
               "--optimizer", "adamw", "--plot", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Predicted memory of one training step on cuda" in out
    assert "AdamW (foreach)" in out and "bfloat16" in out and "transformer.h." in out
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.fixture
def small_model_file(tmp_path):
    """A model file of the user's: build(batch) -> model, inputs, loss; it takes no length."""
    f = tmp_path / "mymodel.py"
    f.write_text(
        "import torch\n"
        "def build(batch=2):\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(),\n"
        "                                torch.nn.Linear(16, 1))\n"
        "    return model, (torch.randn(batch, 16),), lambda out: out.pow(2).mean()\n")
    return f


def test_trace_user_factory(small_model_file, capsys):
    f = small_model_file
    rc = main(["trace", f"{f}:build", "--batch", "3", "--device", "cpu", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["meta"]["inputs"] == "(tensor(3, 16) float32)"
    assert d["meta"]["optimizer"] == "Adam"


@pytest.mark.parametrize("argv, message", [
    (["trace", "no-such-model"], "unknown model 'no-such-model'"),
    (["trace", "missing.py:make"], "does not exist"),
    (["trace", "mlp", "--batch", "0"], "--batch must be positive"),
    (["trace", "mlp", "--top", "-1"], "--top must be 0 or more"),
    (["trace", "resnet50", "--seq-len", "5"], "'resnet50' has no sequence"),
    # Output paths are checked before the trace, which can take minutes.
    (["trace", "mlp", "--plot", "/nonexistent/dir/x.png"], "the folder /nonexistent/dir does not exist"),
    (["plan", "mlp", "--html", "/nonexistent/dir/x.html"], "the folder /nonexistent/dir does not exist"),
    (["plan", "mlp", "--plot", "."], "is a folder"),
    (["plan", "mlp", "--techniques", ",,"], "--techniques names none"),
])
def test_trace_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("body, message", [
    ("def build():\n    return make_model()\n",
     "build() failed (at {f}:2, in build): NameError: name 'make_model' is not defined"),
    ("import torch\nraise RuntimeError('needs a dataset path')\ndef build(): pass\n",
     "running {f} failed (at {f}:2, in <module>): RuntimeError: needs a dataset path"),
])
def test_a_model_file_that_fails_says_where_in_it(tmp_path, capsys, body, message):
    # The user's own code failing is an error naming its line, not a traceback.
    f = tmp_path / "model.py"
    f.write_text(body)
    assert main(["trace", f"{f}:build", "--device", "cpu"]) == 2
    assert message.format(f=f) in capsys.readouterr().err


def test_a_batch_the_model_file_cannot_take_is_an_error_not_ignored(tmp_path, capsys):
    # Figures for the file's own batch, printed for --batch 32, would be read as the answer.
    f = tmp_path / "model.py"
    f.write_text("import torch\n"
                 "def build():\n"
                 "    return torch.nn.Linear(4, 4), (torch.randn(8, 4),)\n")
    assert main(["trace", f"{f}:build", "--device", "cpu", "--batch", "32"]) == 2
    err = capsys.readouterr().err
    assert f"--batch 32 cannot reach {f}:build(), which takes no batch= argument" in err


def test_import_pymemplan_does_not_import_torch():
    code = ("import sys, pymemplan, pymemplan.cli; "
            "assert 'torch' not in sys.modules; "
            "assert callable(pymemplan.trace); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _refused_by_the_parser(argv, message, capsys):
    """argparse's refusal: exit status 2, with `message` in what it prints."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value, message", [("3", "not in (0, 1]"), ("1/0", "not a number"),
                                            ("lots", "not a number")])
def test_nonzero_density_option_rejects_what_is_not_a_share(value, message, capsys):
    _refused_by_the_parser(["trace", "mlp", "--nonzero-density", value], message, capsys)


def test_nonzero_density_option_sizes_masks(tmp_path, capsys):
    f = tmp_path / "masked.py"
    f.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(16, 16)\n"
        "    def forward(self, x):\n"
        "        y = self.lin(x)\n"
        "        return y[y[:, 0] > 0]\n"
        "def build():\n"
        "    return M(), (torch.randn(1000, 16),), lambda out: out.pow(2).mean()\n")
    assert main(["trace", f"{f}:build", "--device", "cpu", "--no-probe", "--json"]) == 2
    assert "nonzero_density" in capsys.readouterr().err
    assert main(["trace", f"{f}:build", "--device", "cpu", "--no-probe", "--json",
                 "--nonzero-density", "1/4"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["peak_bytes"] > 250 * 16 * 4  # the 250 rows the mask keeps, at least


def test_trace_reserved_predicts_what_each_allocator_reserves(capsys):
    """--reserved: the predicted run of 3 steps replayed through the allocators. Each holds
    at least the offline layout, which holds at least the live peak in whole pages."""
    rc = main(["trace", "mlp", "--batch", "64", "--optimizer", "adamw", "--reserved", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)["reserved"]
    assert d["steps"] == 3
    page = 2 << 20
    floor = -(-d["peak_live_bytes"] // page) * page
    assert d["offline_bytes"] >= floor
    assert set(d["policies"]) == {"torch", "torch=expandable_segments:True", "pymemplan-vmm",
                                  "pymemplan-planned"}
    assert all(b >= d["offline_bytes"] for b in d["policies"].values())


def test_trace_reserved_over_a_run_of_several_lengths(capsys):
    """--run-seq-lens: one step per length, in order. The run peaks at the longest step's live
    peak (the optimizer's state made in the first step); PyTorch's allocator, whose blocks of
    one length fit another's poorly, holds more than pymemplan-vmm."""
    argv = ["trace", "gpt2", "--batch", "2", "--seq-len", "64", "--optimizer", "adamw",
            "--reserved", "--run-seq-lens", "64,256,128,256,64"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    d = out["reserved"]
    assert d["steps"] == [64, 256, 128, 256, 64]
    longest = json.loads(_run_json(["trace", "gpt2", "--batch", "2", "--seq-len", "256",
                                     "--optimizer", "adamw", "--json"], capsys))
    assert d["peak_live_bytes"] == longest["peak_bytes"]
    assert d["policies"]["torch"] > d["policies"]["pymemplan-vmm"] >= d["offline_bytes"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "Reserved memory over a run of 5 steps at sequence lengths" in text
    assert "PyTorch, expandable_segments" in text and "least possible with 2 MiB pages" in text


def _run_json(argv, capsys):
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["trace", "mlp", "--run-seq-lens", "64,128"], "add --reserved"),
    (["trace", "mlp", "--reserved", "--device", "cpu"], "use it with --device cuda"),
    (["trace", "resnet50", "--batch", "2", "--reserved", "--run-seq-lens", "64,128"],
     "--reserved: --seq-len 64: the built-in 'resnet50' has no sequence"),
])
def test_trace_reserved_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value, message", [("64,x", "not a list of lengths"), ("64,0", "must be positive")])
def test_run_seq_lens_rejects_what_is_not_lengths(value, message, capsys):
    _refused_by_the_parser(["trace", "gpt2", "--reserved", "--run-seq-lens", value], message, capsys)


def test_run_seq_lens_on_a_model_file_without_a_length_is_an_error(small_model_file, capsys):
    """Every step would be the same input: refused, not a run of one shape reported as several."""
    f = small_model_file
    assert main(["trace", f"{f}:build", "--reserved", "--run-seq-lens", "8,16"]) == 2
    assert "takes no seq_len= argument" in capsys.readouterr().err
