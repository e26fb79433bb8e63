"""pymemplan.allocator and pymemplan.cupy: the Python side of libpymemplan_alloc.so.

Whatever changes process-wide state (PyTorch's allocator, the plugin's config and its
per-device allocators) runs in a fresh interpreter. Tests that need the built plugin or
the fake CUDA driver (pymemplan/_testing/libfakecuda.so) skip only when those files are
missing; the fake driver makes the plugin's real CUDA code path run on CPUs.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pymemplan
from pymemplan.allocator import _config, _library, _stats

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "plugin" / "pymemplan_alloc.h"
MiB = 1 << 20


def plugin_path() -> str:
    try:
        return _library.library_path()
    except _library.PluginLoadError:
        pytest.skip("libpymemplan_alloc.so not built")


def fake_driver_path() -> str:
    plugin_path()
    path = _library.fake_driver_path()
    if path is None:
        pytest.skip("libfakecuda.so (pymemplan/_testing) not built")
    return path


def run(code: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter; the caller's PYMEMPLAN_*/FAKECUDA_* do not leak in."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYMEMPLAN_", "FAKECUDA_"))}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env={**base, **env}, timeout=120)
    if check:
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


# The start of every fake-driver subprocess. oom_action:null because ctypes cannot catch the
# C++ exception that oom_action:raise throws (it would abort the process).
FAKE_PRELUDE = """
import ctypes, gc, json, sys
import pymemplan
from pymemplan.allocator import _library, configure
configure(oom_action="null")
lib = _library.load()
fake = ctypes.CDLL(_library.fake_driver_path())  # the plugin's driver: one shared state
fake.fakecuda_bytes_in_use.restype = ctypes.c_size_t
fake.fakecuda_bytes_in_use.argtypes = [ctypes.c_int]
MiB = 1 << 20
"""


def run_fake(code: str, **env: str) -> subprocess.CompletedProcess:
    return run(FAKE_PRELUDE + textwrap.dedent(code), PYMEMPLAN_LIBCUDA=fake_driver_path(), **env)


# --- Pure Python: no torch, no plugin ---

def test_config_keywords_become_the_plugin_string():
    assert _config.format_config({"max_split_size_mb": 512, "release_before_grow": False,
                                  "oom_action": "null"}) == \
        "max_split_size_mb:512,release_before_grow:False,oom_action:null"
    assert _config.parse_config(" policy:torch, max_split_size_mb:256 ,") == \
        ("torch", {"max_split_size_mb": "256"})
    assert _config.parse_config("") == (None, {})
    with pytest.raises(ValueError, match="key:value"):
        _config.parse_config("max_split_size_mb")
    with pytest.raises(ValueError, match="twice"):
        _config.parse_config("oom_action:null,oom_action:raise")
    with pytest.raises(ValueError, match="cannot be empty or contain"):
        _config.format_config({"max_split_size_mb": "1,2"})
    # PyTorch's list form keeps its commas.
    text = "policy:torch,roundup_power2_divisions:[256:1,>:4],max_split_size_mb:256"
    assert _config.parse_config(text) == (
        "torch", {"roundup_power2_divisions": "[256:1,>:4]", "max_split_size_mb": "256"})
    assert _config.format_config({"roundup_power2_divisions": "[256:1,>:4]"}) == \
        "roundup_power2_divisions:[256:1,>:4]"


def test_same_effective_config_compares_equal():
    # Defaults written out and spelling differences are the same allocator.
    assert _config.canonical("pymemplan", {}) == \
        _config.canonical("pymemplan", {"release_before_grow": "true", "oom_action": "raise"})
    assert _config.canonical("pymemplan", {"max_split_size_mb": 512}) != \
        _config.canonical("pymemplan", {"max_split_size_mb": 256})
    assert _config.canonical("pymemplan", {}) != _config.canonical("pymemplan", {"oom_action": "null"})


def test_device_arguments():
    assert _stats.device_index(3) == 3
    assert _stats.device_index("cuda:2") == 2
    assert _stats.device_index("1") == 1
    assert _stats.device_index("cuda") == _stats.device_index(None)
    with pytest.raises(ValueError, match="not a CUDA device"):
        _stats.device_index("cpu")
    with pytest.raises(ValueError, match="negative"):
        _stats.device_index(-1)
    with pytest.raises(TypeError):
        _stats.device_index(1.5)
    torch = pytest.importorskip("torch")
    assert _stats.device_index(torch.device("cuda", 1)) == 1
    with pytest.raises(ValueError, match="not a CUDA device"):
        _stats.device_index(torch.device("cpu"))


def test_import_pymemplan_stays_cheap():
    out = run("""
        import sys, pymemplan
        names = [pymemplan.enable, pymemplan.memory_stats, pymemplan.oom_as_torch_error]
        assert "enable" in dir(pymemplan)
        print("torch" in sys.modules, pymemplan.is_enabled())
    """, PYMEMPLAN_ENABLE="0")
    assert out.stdout.split() == ["False", "False"]


def test_missing_library_says_how_to_fix_it(monkeypatch, tmp_path):
    monkeypatch.setattr(_library, "_package_dirs", lambda: [str(tmp_path)])
    monkeypatch.setattr(_library, "_lib", None)
    for call in (pymemplan.memory_stats, pymemplan.empty_cache, pymemplan.snapshot,
                 pymemplan.explain_memory, lambda: pymemplan.set_memory_limit("1GiB"),
                 pymemplan.enable):
        with pytest.raises(_library.PluginLoadError, match="libpymemplan_alloc.so is missing") as e:
            call()
        assert "reinstall" in str(e.value) and str(tmp_path) in str(e.value)


def test_cupy_missing_gives_the_install_command(monkeypatch):
    import pymemplan.cupy

    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    with pytest.raises(ImportError, match=r"pip install cupy-cuda12x.*CUDA 12"):
        pymemplan.cupy.use()


def test_oom_as_torch_error_converts_only_our_oom():
    torch = pytest.importorskip("torch")
    message = "pymemplan: out of memory: tried to allocate 2.00 GiB (rounded to 2.00 GiB)"
    with pytest.raises(torch.cuda.OutOfMemoryError) as e:
        with pymemplan.oom_as_torch_error():
            raise RuntimeError(message)
    assert str(e.value) == message and isinstance(e.value.__cause__, RuntimeError)

    @pymemplan.oom_as_torch_error()
    def step():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access") as e:
        step()
    assert not isinstance(e.value, torch.cuda.OutOfMemoryError)
    with pytest.raises(ValueError):
        with pymemplan.oom_as_torch_error():
            raise ValueError(message)  # only RuntimeErrors come from PyTorch's allocator path
    assert pymemplan.is_out_of_memory(RuntimeError("Traceback...\n" + message))


# --- The built plugin, no driver: configuration and the swap into PyTorch ---

def test_ctypes_declares_every_function_of_the_header():
    plugin_path()
    lib = _library.load()
    if HEADER.exists():  # a source checkout: the header is the contract
        declared = set(re.findall(r"\b(pymemplan_\w+)\s*\(", HEADER.read_text()))
        assert declared == set(_library.SIGNATURES)
    for name, (restype, argtypes) in _library.SIGNATURES.items():
        assert getattr(lib, name).restype is restype and getattr(lib, name).argtypes == argtypes


def test_stats_of_an_unused_device_are_zero_and_buffers_grow():
    plugin_path()
    lib = _library.load()
    small = _library.read_json(lib.pymemplan_stats_json, 5, "stats", initial=16)
    assert small == dict(pymemplan.memory_stats(5))
    assert small["reserved_bytes.all.current"] == 0 and len(small) > 100
    with pytest.raises(_library.PluginError, match="invalid device"):
        pymemplan.memory_stats(100_000)


def test_bad_config_is_a_value_error_listing_the_valid_keys():
    plugin_path()
    with pytest.raises(ValueError, match="unknown key 'bogus'") as e:
        pymemplan.enable(bogus=1)  # fails in the plugin's configure, before PyTorch is touched
    assert "max_split_size_mb" in str(e.value) and "oom_action" in str(e.value)
    with pytest.raises(ValueError, match="oom_action"):
        pymemplan.enable(oom_action="maybe")
    with pytest.raises(ValueError, match="valid policies"):
        pymemplan.enable(policy="fancy")
    assert not pymemplan.is_enabled()


def test_enable_installs_our_library_into_torch():
    plugin_path()
    pytest.importorskip("torch")
    run("""
        import ctypes, torch
        captured = []
        real = torch._C._cuda_customAllocator
        def spy(alloc_fn, free_fn):  # what CUDAPluggableAllocator hands to PyTorch
            captured.append((alloc_fn, free_fn))
            return real(alloc_fn, free_fn)
        torch._C._cuda_customAllocator = spy

        import pymemplan
        from pymemplan.allocator import _enable
        assert not pymemplan.is_enabled()
        pymemplan.enable(max_split_size_mb=256)
        assert pymemplan.is_enabled()

        lib = ctypes.CDLL(pymemplan.library_path())
        ours = tuple(ctypes.cast(getattr(lib, f), ctypes.c_void_p).value
                     for f in ("pymemplan_alloc", "pymemplan_free"))
        assert captured == [ours], (captured, ours)
        current = torch.cuda.memory._get_current_allocator().allocator()
        assert current is _enable._state.torch_allocator.allocator()
        exposed = tuple(s for s, _ in _enable._OPTIONAL_HOOKS if hasattr(current, s))
        assert _enable._state.hooks == exposed, (_enable._state.hooks, exposed)

        pymemplan.enable(max_split_size_mb=256)                            # same: no-op
        pymemplan.enable(max_split_size_mb="256", release_before_grow=True)  # same, spelled out
        assert len(captured) == 1
        try:
            pymemplan.enable(max_split_size_mb=512)
            raise AssertionError("a different config was accepted")
        except RuntimeError as e:
            assert "already the active CUDA allocator" in str(e), e
            assert "max_split_size_mb:256" in str(e) and "max_split_size_mb:512" in str(e), e
        assert pymemplan.active_config() == {"policy": "pymemplan", "max_split_size_mb": "256"}
    """)


def test_enable_from_the_environment():
    plugin_path()
    pytest.importorskip("torch")
    out = run("""
        import json, sys, pymemplan
        print(json.dumps([pymemplan.is_enabled(), pymemplan.active_config()]))
    """, PYMEMPLAN_ENABLE="1", PYMEMPLAN_ALLOC_CONF="policy:torch, max_split_size_mb:256,oom_action:null")
    assert json.loads(out.stdout) == [
        True, {"policy": "torch", "max_split_size_mb": "256", "oom_action": "null"}]

    # The usual spellings of yes; anything else set, or a config without it, is said to do nothing.
    code = "import warnings; warnings.simplefilter('always'); import pymemplan; print(pymemplan.is_enabled())"
    for on in ("true", " Yes", "ON"):
        assert run(code, PYMEMPLAN_ENABLE=on).stdout.split() == ["True"], on
    for off in ("0", "false", ""):
        r = run(code, PYMEMPLAN_ENABLE=off)
        assert r.stdout.split() == ["False"] and "RuntimeWarning" not in r.stderr, (off, r.stderr)
    for env in ({"PYMEMPLAN_ENABLE": "enabled"}, {"PYMEMPLAN_ALLOC_CONF": "policy:pymemplan-vmm"},
                {"PYMEMPLAN_PLANS": "plans.txt"}):
        r = run(code, **env)
        assert r.stdout.split() == ["False"], env
        assert "RuntimeWarning" in r.stderr and "not PyTorch's allocator" in r.stderr, (env, r.stderr)
        assert "PYMEMPLAN_ENABLE=1" in r.stderr, r.stderr

    bad = run("import pymemplan", check=False, PYMEMPLAN_ENABLE="1",
              PYMEMPLAN_ALLOC_CONF="max_split_size_mb:256,bogus:1")
    assert bad.returncode != 0
    assert "ValueError: PYMEMPLAN_ALLOC_CONF='max_split_size_mb:256,bogus:1'" in bad.stderr
    assert "unknown key 'bogus'" in bad.stderr and "valid keys" in bad.stderr


def test_enable_after_cuda_is_initialized_explains_both_fixes():
    plugin_path()
    pytest.importorskip("torch")
    out = run("""
        import json, torch, pymemplan
        # Another allocator got there first: PyTorch refuses the swap, we explain why.
        torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(
            pymemplan.library_path(), "pymemplan_alloc", "pymemplan_free"))
        try:
            pymemplan.enable()
        except RuntimeError as e:
            refused = str(e)
        # CUDA initialized first (emulated: no GPU here).
        torch.cuda._initialized = True
        try:
            pymemplan.enable(max_split_size_mb=256)
        except RuntimeError as e:
            too_late = str(e)
        print(json.dumps([refused, too_late, pymemplan.is_enabled()]))
    """)
    refused, too_late, enabled = json.loads(out.stdout)
    assert not enabled
    assert "refused" in refused and "CUDA is already initialized in this process" in too_late
    for message in (refused, too_late):
        assert "call pymemplan.enable() first thing" in message, message
        assert "PYMEMPLAN_ENABLE=1" in message and "PYMEMPLAN_ALLOC_CONF=" in message, message
    assert 'PYMEMPLAN_ALLOC_CONF="max_split_size_mb:256"' in too_late


def test_enable_warns_once_about_cudnn_benchmark():
    plugin_path()
    pytest.importorskip("torch")
    out = run("""
        import warnings, torch, pymemplan
        torch.backends.cudnn.benchmark = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda._initialized = True
            try:
                pymemplan.enable()  # too late, after the warning
            except RuntimeError:
                pass
            torch.cuda._initialized = False
            pymemplan.enable()
        print("\\n".join(str(w.message) for w in caught))
    """)
    lines = [line for line in out.stdout.splitlines() if "cudnn" in line]
    assert len(lines) == 1 and "cacheInfo" in lines[0] and "= False" in lines[0]


# --- The live plugin over the fake CUDA driver ---

def test_mark_step_reaches_the_planned_plugin_and_is_a_no_op_when_not_enabled():
    run("""
        import ctypes
        import pymemplan
        from pymemplan.allocator import _library, configure
        pymemplan.mark_step()  # not enabled: nothing to tell, no library needed
        configure("pymemplan-planned", oom_action="null")
        lib = _library.load()
        MiB = 1 << 20
        sizes = [(7 + 3 * (i % 5)) * MiB + 512 * i for i in range(40)]
        calls = []
        for step in range(6):
            assert lib.pymemplan_mark_step(-1) == 0, pymemplan.last_error()
            live = [lib.pymemplan_alloc(n, 0, None) for n in sizes]
            assert all(live), pymemplan.last_error()
            for p, n in zip(reversed(live), reversed(sizes)):
                lib.pymemplan_free(p, n, 0, None)
            calls.append(pymemplan.memory_stats()["num_device_alloc"])
        # From the plan on, the steps need no new memory from the driver.
        assert calls[-1] == calls[-2] == calls[-3], calls
        assert lib.pymemplan_mark_step(0) == 0
        assert lib.pymemplan_mark_step(5) == -1  # the driver has one device
        assert "CUDA device 5 does not exist" in pymemplan.last_error(), pymemplan.last_error()
    """, PYMEMPLAN_LIBCUDA=fake_driver_path(), FAKECUDA_CAPACITY="4GiB")


def test_share_pages_through_the_python_api():
    run("""
        import ctypes
        import pymemplan
        from pymemplan.allocator import _library
        assert pymemplan.share_pages() == 0  # not enabled: nothing to share, no library needed
        pymemplan.enable(policy="pymemplan-vmm", oom_action="null")
        lib = _library.load()
        MiB = 1 << 20
        ptrs = [lib.pymemplan_alloc(MiB, 0, None) for _ in range(4)]
        assert all(ptrs), pymemplan.last_error()
        lib.pymemplan_free(ptrs[1], MiB, 0, None)  # page 0: front half in use
        lib.pymemplan_free(ptrs[2], MiB, 0, None)  # page 1: back half in use
        before = pymemplan.memory_reserved()
        assert pymemplan.share_pages() == 2 * MiB
        assert pymemplan.memory_reserved() == before - 2 * MiB
        assert pymemplan.share_pages(device=0) == 0  # nothing left to pair
    """, PYMEMPLAN_LIBCUDA=fake_driver_path(), FAKECUDA_CAPACITY="1GiB")


# One run of random training loop 33 (benchmarks/alloc_random.py) through the live plugin:
# prints its highest reserved bytes. PLANS_IN / PLANS_OUT: files to load and save plans.
REPLAY_WITH_PLANS = """
import os, sys
import pymemplan
from pymemplan.allocator import _library
sys.path.insert(0, {benchmarks!r})
from synthetic_traces import random_training
pymemplan.enable("pymemplan-planned", oom_action="null")
lib = _library.load()
if os.environ.get("PLANS_IN"):
    print("loaded", pymemplan.load_plans(os.environ["PLANS_IN"]))
t = random_training(33)
ptr = {{}}
for a, p, n, s in zip(t.action.tolist(), t.ptr.tolist(), t.size.tolist(), t.stream.tolist()):
    if a == 0:
        ptr[p] = (lib.pymemplan_alloc(n, 0, s or None), n, s)
        assert ptr[p][0], pymemplan.last_error()
    else:
        q, n, s = ptr.pop(p)
        lib.pymemplan_free(q, n, 0, s or None)
print("peak", pymemplan.max_memory_reserved())
if os.environ.get("PLANS_OUT"):
    print("saved", pymemplan.save_plans(os.environ["PLANS_OUT"]))
"""


def test_plans_saved_by_one_run_serve_the_next_through_the_plugin(tmp_path):
    """The same job twice over the fake driver: the second run loads the first one's plans
    and is served from them sooner, so it holds less at its peak (as the core's replays of
    the same loop: 1.022 of live without, 1.003 with)."""
    code = REPLAY_WITH_PLANS.format(benchmarks=str(Path(__file__).resolve().parent.parent / "benchmarks"))
    plans = tmp_path / "plans.txt"
    env = dict(PYMEMPLAN_LIBCUDA=fake_driver_path(), FAKECUDA_CAPACITY="2GiB")
    first = dict(line.split() for line in run(code, PLANS_OUT=str(plans), **env).stdout.splitlines())
    assert int(first["saved"]) >= 1 and plans.read_text().startswith("pymemplan-plans 4")
    second = dict(line.split() for line in run(code, PLANS_IN=str(plans), **env).stdout.splitlines())
    assert int(second["loaded"]) == int(first["saved"])
    assert int(second["peak"]) < int(first["peak"]), (first, second)


# In a subprocess: raises(fn, error type, text) asserts that fn() raises that error with text.
RAISES = """
def raises(fn, kind, text):
    try:
        fn()
    except kind as e:
        assert text in str(e), e
    else:
        raise AssertionError(f"no {kind.__name__} saying {text!r}")
"""


def test_save_and_load_plans_say_what_is_wrong(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("not plans")
    run(RAISES + textwrap.dedent(f"""
        import pymemplan
        from pymemplan.allocator import PluginError, _library
        raises(lambda: pymemplan.load_plans({str(bad)!r}), RuntimeError,
               "pymemplan.enable('pymemplan-planned') first")
        pymemplan.enable("pymemplan-planned", oom_action="null")
        raises(lambda: pymemplan.save_plans({str(tmp_path / "x.txt")!r}), PluginError,
               "nothing was allocated on device 0 yet")
        raises(lambda: pymemplan.load_plans({str(bad)!r}), PluginError,
               "does not start with 'pymemplan-plans'")
        lib = _library.load()
        p = lib.pymemplan_alloc(1 << 20, 0, None)
        assert p, pymemplan.last_error()  # the allocator is intact
        assert pymemplan.save_plans({str(tmp_path / "none.txt")!r}) == 0  # nothing armed yet
    """), PYMEMPLAN_LIBCUDA=fake_driver_path(), FAKECUDA_CAPACITY="1GiB")
    run(RAISES + textwrap.dedent(f"""
        import pymemplan
        from pymemplan.allocator import PluginError
        pymemplan.enable("pymemplan-vmm", oom_action="null")
        raises(lambda: pymemplan.load_plans({str(bad)!r}), PluginError,
               "policy pymemplan-vmm has no plans; enable pymemplan with policy 'pymemplan-planned'")
    """), PYMEMPLAN_LIBCUDA=fake_driver_path(), FAKECUDA_CAPACITY="1GiB")



# The same loop with pymemplan enabled from the environment (PYMEMPLAN_PLANS included), the
# way a job is run again without touching its code.
REPLAY_FROM_ENVIRONMENT = REPLAY_WITH_PLANS.replace(
    'pymemplan.enable("pymemplan-planned", oom_action="null")\n', "assert pymemplan.is_enabled()\n")


def test_plans_file_kept_across_runs_without_code(tmp_path):
    """PYMEMPLAN_PLANS: the first run finds no file and writes its plans at exit; the second
    loads them and peaks lower, as with save_plans/load_plans; a run that arms no plan leaves
    the file as it was."""
    code = REPLAY_FROM_ENVIRONMENT.format(benchmarks=str(Path(__file__).resolve().parent.parent / "benchmarks"))
    plans = tmp_path / "plans.txt"
    env = dict(PYMEMPLAN_LIBCUDA=fake_driver_path(), FAKECUDA_CAPACITY="2GiB", PYMEMPLAN_ENABLE="1",
               PYMEMPLAN_ALLOC_CONF="policy:pymemplan-planned,oom_action:null",
               PYMEMPLAN_PLANS=str(plans))
    first = dict(line.split() for line in run(code, **env).stdout.splitlines())
    saved = plans.read_text()
    assert saved.startswith("pymemplan-plans 4") and int(saved.splitlines()[2]) >= 1
    second = dict(line.split() for line in run(code, **env).stdout.splitlines())
    assert int(second["peak"]) < int(first["peak"]), (first, second)
    kept = plans.read_text()
    assert kept.startswith("pymemplan-plans 4")
    run("import pymemplan; assert pymemplan.is_enabled()", **env)  # no GPU used: nothing armed
    assert plans.read_text() == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plans.txt"]  # no temporary left


def test_plans_file_per_device(tmp_path):
    """{device} in the path: a file per device. Without it, plans of two devices are not
    written over each other: stderr says how to keep both."""
    code = textwrap.dedent("""
        import pymemplan
        from pymemplan.allocator import _library
        lib = _library.load()
        for step in range(12):  # the same step on both devices, a plan worth an arena
            for device in (0, 1):
                ptrs = [lib.pymemplan_alloc(n << 20, device, None) for n in (8, 24, 4, 16, 2)]
                assert all(ptrs), pymemplan.last_error()
                for p, n in zip(ptrs, (8, 24, 4, 16, 2)):
                    lib.pymemplan_free(p, n << 20, device, None)
    """)
    env = dict(PYMEMPLAN_LIBCUDA=fake_driver_path(), FAKECUDA_CAPACITY="1GiB", FAKECUDA_DEVICE_COUNT="2",
               PYMEMPLAN_ENABLE="1", PYMEMPLAN_ALLOC_CONF="policy:pymemplan-planned,oom_action:null")
    run(code, PYMEMPLAN_PLANS=str(tmp_path / "plans.{device}.txt"), **env)
    for device in (0, 1):
        text = (tmp_path / f"plans.{device}.txt").read_text()
        assert int(text.splitlines()[2]) >= 1, text
    one = tmp_path / "one.txt"
    out = run(code, PYMEMPLAN_PLANS=str(one), **env)
    assert not one.exists()
    assert "plans of devices [0, 1] were not saved" in out.stderr and "{device}" in out.stderr
    # Each device's file is checked and staged for its own allocator.
    run(code, PYMEMPLAN_PLANS=str(tmp_path / "plans.{device}.txt"), **env)


def test_plans_file_errors(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("pymemplan-plans 1\npeak 10\n1\nplan 16 5 1\n513 0 0 4\n")
    env = dict(PYMEMPLAN_LIBCUDA=fake_driver_path(), FAKECUDA_CAPACITY="1GiB")
    run(RAISES + textwrap.dedent(f"""
        import pymemplan
        raises(lambda: pymemplan.enable("pymemplan-vmm", plans="p.txt"), ValueError,
               "plans='p.txt' needs the policy 'pymemplan-planned'")
        raises(lambda: pymemplan.enable("pymemplan-planned", plans={str(bad)!r}), ValueError,
               "plans file {str(bad)!r}: import_plans: bad number of slots '1'")
        assert not pymemplan.is_enabled()  # a bad file changes nothing
        raises(lambda: pymemplan.enable("pymemplan-planned", plans={str(tmp_path / "no" / "p.txt")!r}),
               ValueError, "the folder {str(tmp_path / "no")!r} does not exist")
        raises(lambda: pymemplan.save_plans(), ValueError, "save_plans() needs a path")
        pymemplan.enable("pymemplan-planned", plans={str(tmp_path / "new.{device}.txt")!r})
        from pymemplan.allocator import _library
        assert _library.load().pymemplan_alloc(1 << 20, 0, None)
        assert pymemplan.save_plans() == 0  # nothing armed yet, but written where plans= says
        assert open({str(tmp_path / "new.0.txt")!r}).read().startswith("pymemplan-plans 4")
        pymemplan.enable("pymemplan-planned")  # again, with nothing asked about plans: fine
        raises(lambda: pymemplan.enable("pymemplan-planned", plans="other.txt"), RuntimeError,
               "plans= is taken from the first enable() only")
    """), **env)
    out = run("import pymemplan", check=False, PYMEMPLAN_ENABLE="1", PYMEMPLAN_PLANS=str(bad),
              PYMEMPLAN_ALLOC_CONF="policy:pymemplan-planned", **env)
    assert out.returncode != 0
    assert f"PYMEMPLAN_PLANS={str(bad)!r}: plans file" in out.stderr, out.stderr
    out = run("import pymemplan", check=False, PYMEMPLAN_ENABLE="1", PYMEMPLAN_PLANS="p.txt", **env)
    assert "needs the policy 'pymemplan-planned'" in out.stderr, out.stderr


def test_staged_plans_reach_allocators_made_before_and_after():
    """The C API under enable(plans=): an allocator that exists takes staged plans at once
    (bad text fails the call); one made later takes them as it is made, and text that slipped
    past Python's check is reported on stderr there while the allocator serves on."""
    out = run_fake("""
        configure("pymemplan-planned", oom_action="null")
        assert lib.pymemplan_stage_plans(1, b"not plans") == 0  # device 1 has no allocator yet
        p = lib.pymemplan_alloc(MiB, 0, None)
        assert p
        assert lib.pymemplan_stage_plans(0, b"not plans") == -1  # device 0 has one: imported now
        assert "does not start with 'pymemplan-plans'" in pymemplan.last_error()
        assert lib.pymemplan_stage_plans(-2, b"") == -1 and "invalid device" in pymemplan.last_error()
        q = lib.pymemplan_alloc(MiB, 1, None)  # made now: the staged text is refused, reported
        assert q, pymemplan.last_error()
        sys.stderr.flush()
    """, FAKECUDA_DEVICE_COUNT="2", FAKECUDA_CAPACITY="1GiB")
    assert "the plans staged for device 1 were not loaded" in out.stderr
    out = run_fake("""
        configure("pymemplan-vmm", oom_action="null")
        assert lib.pymemplan_stage_plans(-1, b"x") == -1
        assert "policy pymemplan-vmm has no plans" in pymemplan.last_error()
    """)


def test_stats_snapshot_and_summary_of_the_live_plugin(tmp_path):
    path = tmp_path / "snapshot.pickle"
    run_fake(f"""
        from pymemplan import _core
        p = lib.pymemplan_alloc(3 * MiB, 0, None)
        q = lib.pymemplan_alloc(300, 0, None)
        r = lib.pymemplan_alloc(12 * MiB, 1, None)
        assert p and q and r, pymemplan.last_error()
        ctypes.memset(p, 0xAB, 3 * MiB)  # real memory behind it

        stats = pymemplan.memory_stats()
        assert list(stats) == sorted(stats)  # as torch.cuda.memory_stats() orders them
        assert set(stats) == set(_core.Allocator(_core.SimulatedDevice(1 << 30)).stats())
        assert stats == pymemplan.memory_stats(0) == pymemplan.memory_stats("cuda:0")
        assert stats["requested_bytes.all.current"] == 3 * MiB + 300
        assert pymemplan.memory_allocated() == stats["allocated_bytes.all.current"] >= 3 * MiB + 300
        assert pymemplan.max_memory_allocated() == stats["allocated_bytes.all.peak"]
        assert pymemplan.memory_reserved() == fake.fakecuda_bytes_in_use(0) > 0
        assert pymemplan.max_memory_reserved() == stats["reserved_bytes.all.peak"]
        assert pymemplan.memory_allocated(1) == 12 * MiB

        snap = pymemplan.snapshot()
        assert len(snap["device_traces"]) == 2
        assert {{s["device"] for s in snap["segments"]}} == {{0, 1}}
        blocks = {{b["address"]: b for s in snap["segments"] for b in s["blocks"]}}
        assert blocks[p]["state"] == "active_allocated" and blocks[p]["requested_size"] == 3 * MiB
        assert blocks[r]["size"] == 12 * MiB
        one = pymemplan.snapshot(1)
        assert [s["device"] for s in one["segments"]] == [1] and len(one["device_traces"]) == 2
        assert sum(s["total_size"] for s in pymemplan.snapshot(0)["segments"]) == \\
            pymemplan.memory_reserved(0)
        pymemplan.save_snapshot({str(path)!r})
        from pymemplan.traces import explain_snapshot
        why = explain_snapshot({str(path)!r})  # what `pymemplan explain` reads
        assert why.reserved_bytes == pymemplan.memory_reserved(0) and why.live_bytes == 3 * MiB + 300
        assert explain_snapshot(one, device=1).live_bytes == 12 * MiB
        live = pymemplan.explain_memory(1)  # the plugin's pool, read now
        assert live.reserved_bytes == pymemplan.memory_reserved(1) and live.live_bytes == 12 * MiB
        assert str(live).startswith("device 1: ") and "fragments" in str(live)

        summary = pymemplan.memory_summary()
        for row in ("device ID 0", "CUDA OOMs: 0", "Device allocs: 2", "Allocated memory",
                    "Active memory", "Requested memory", "GPU reserved memory",
                    "Inactive split memory", "from large pool", "from small pool",
                    "Tot Freed", "Oversize GPU segments"):
            assert row in summary, (row, summary)
        assert "from small pool" not in pymemplan.memory_summary(abbreviated=True)

        lib.pymemplan_free(p, 3 * MiB, 0, None)
        lib.pymemplan_free(q, 300, 0, None)
        assert pymemplan.memory_allocated() == 0 and pymemplan.memory_reserved() > 0  # cached
        pymemplan.reset_peak_memory_stats()
        assert pymemplan.max_memory_allocated() == 0
        pymemplan.reset_accumulated_memory_stats()
        s = pymemplan.memory_stats()
        assert s["allocated_bytes.all.allocated"] == 0 and s["num_device_alloc"] == 0
        pymemplan.empty_cache()  # every device; device 1 still holds r
        assert pymemplan.memory_reserved(0) == fake.fakecuda_bytes_in_use(0) == 0
        assert pymemplan.memory_reserved(1) == fake.fakecuda_bytes_in_use(1) > 0
    """, FAKECUDA_DEVICE_COUNT="2", FAKECUDA_CAPACITY="1GiB")

    # What torch.cuda.memory._dump_snapshot writes, and its viewer reads.
    torch = pytest.importorskip("torch")
    from torch.cuda import _memory_viz

    data = pickle.loads(path.read_bytes())
    assert "segments: 3" in _memory_viz.segsum(data)
    assert "active_allocated" in _memory_viz.segments(data, format_flamegraph=lambda text: text)
    assert "<html" in _memory_viz.segment_plot(data).lower()
    cli = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "total_reserved" in cli.stdout, cli.stderr
    del torch


def test_the_plugin_records_its_allocation_history_for_pymemplan_explain(tmp_path):
    """record_memory_history keeps the last N actions in snapshot()'s device_traces, in
    PyTorch's trace-entry shape; `pymemplan explain` replays them, pymemplan's own policy first,
    on the memory the device had; a virtual segment counts its mapped pages only."""
    path = tmp_path / "snap.pickle"
    run_fake(f"""
        configure(policy="pymemplan-vmm", oom_action="null")
        lib = _library.load()
        from pymemplan.traces import explain_snapshot
        lib.pymemplan_alloc(MiB, 0, None)  # before recording: not in the history
        pymemplan.record_memory_history(max_entries=11)
        a, b, c = (lib.pymemplan_alloc(n * MiB, 0, None) for n in (3, 5, 7))
        lib.pymemplan_free(b, 5 * MiB, 0, None)
        assert not lib.pymemplan_alloc(60 * MiB, 0, None)  # over the 64 MiB device
        trace = pymemplan.snapshot(0)["device_traces"][0]
        # PyTorch's actions: the pages each request mapped (a page move, unmapped there and
        # mapped here, where the pool reclaims), and a free requested, then completed.
        actions = [e["action"] for e in trace]
        assert [x for x in actions if not x.startswith("segment_")] == \
            ["alloc", "alloc", "alloc", "free_requested", "free_completed", "oom"], actions
        assert actions[:2] == ["segment_map", "alloc"] and "segment_map" in actions[2:4]
        ours = [e for e in trace if not e["action"].startswith("segment_")]
        assert [e["size"] for e in ours] == [3 * MiB, 5 * MiB, 7 * MiB, 5 * MiB, 5 * MiB, 60 * MiB]
        assert ours[1]["addr"] == ours[3]["addr"] == ours[4]["addr"] == b and ours[0]["addr"] == a
        assert ours[5]["device_free"] == 64 * MiB - pymemplan.memory_reserved(0)
        mapped = sum(e["size"] * (1 if e["action"] == "segment_map" else -1)
                     for e in trace if e["action"] in ("segment_map", "segment_unmap"))
        assert mapped == pymemplan.memory_reserved(0) - 2 * MiB  # the first 1 MiB's page before
        assert [e["time_us"] for e in trace] == sorted(e["time_us"] for e in trace)
        lib.pymemplan_free(c, 7 * MiB, 0, None)  # the oldest entries go
        assert len(pymemplan.snapshot(0)["device_traces"][0]) == 11
        assert pymemplan.snapshot(0)["device_traces"][0][-1]["action"] == "free_completed"
        snap = pymemplan.snapshot(0)
        assert snap["allocator_settings"]["pymemplan_policy"].startswith("pymemplan-vmm=")
        # Only the mapped pages of the virtual segment are reserved memory.
        assert explain_snapshot(snap).reserved_bytes == pymemplan.memory_reserved(0)
        now = pymemplan.explain_memory(0)  # in the program: the split, and the replays
        assert now.fit.rows[0].policy == "pymemplan-vmm" and now.fit.capacity_bytes == 64 * MiB
        assert "under each allocator" in str(now)
        assert pymemplan.explain_memory(0, compare=False).fit is None
        pymemplan.save_snapshot({str(path)!r})
        pymemplan.record_memory_history(0)
        assert pymemplan.snapshot(0)["device_traces"][0] == []
        for bad in (-1, 2.5, True):
            try:
                pymemplan.record_memory_history(bad)
            except ValueError as e:
                assert "max_entries must be an integer >= 0" in str(e)
            else:
                raise AssertionError(bad)
    """, FAKECUDA_CAPACITY="64MiB")
    from pymemplan.traces import snapshot_fit

    fit = snapshot_fit(path)
    assert fit.rows[0].policy == "pymemplan-vmm" and "torch" in [r.policy for r in fit.rows]
    assert fit.capacity_bytes == 64 * MiB and fit.failed_requests == 1
    # 1 MiB made before the history, 3 and 7 MiB, then the failed 60 MiB: 71 MiB live.
    assert fit.peak_live_bytes == 71 * MiB and not any(r.fits for r in fit.rows)
    assert "no allocator fits" in fit.advice
    # PyTorch's viewer draws the history (pytorch.org/memory_viz reads the same).
    torch = pytest.importorskip("torch")
    from torch.cuda import _memory_viz

    assert "<html" in _memory_viz.trace_plot(pickle.loads(path.read_bytes())).lower()
    del torch


def test_oom_under_oom_action_null_returns_null_with_a_full_message():
    run_fake("""
        keep = lib.pymemplan_alloc(3 * MiB, 0, None)
        assert keep, pymemplan.last_error()
        assert not lib.pymemplan_alloc(128 * MiB, 0, None)  # over the 64 MiB device
        message = pymemplan.last_error()
        for part in ("pymemplan: out of memory", "tried to allocate 128.00 MiB",
                     "Allocated 3.00 MiB", "reserved", "largest free block",
                     "capacity 64.00 MiB"):
            assert part in message, (part, message)
        assert message.startswith("pymemplan: out of memory"), message
        # What batch-size finders test a RuntimeError of one argument for before they retry
        # with a smaller batch: Accelerate's should_reduce_batch_size (" out of memory."),
        # Lightning's is_oom_error ("CUDA" and "out of memory").
        assert " out of memory." in message, message
        assert "CUDA" in message and "out of memory" in message, message
        assert pymemplan.memory_stats()["num_ooms"] == 1

        lib.pymemplan_free(keep, 3 * MiB, 0, None)
        pymemplan.empty_cache()
        pymemplan.set_memory_limit("16MiB")
        a = lib.pymemplan_alloc(12 * MiB, 0, None)  # a 12 MiB segment of its own
        assert a, pymemplan.last_error()
        assert not lib.pymemplan_alloc(12 * MiB, 0, None), "24 MiB reserved > the 16 MiB limit"
        assert "memory limit 16.00 MiB" in pymemplan.last_error(), pymemplan.last_error()
        pymemplan.set_memory_limit(None)
        assert lib.pymemplan_alloc(12 * MiB, 0, None), pymemplan.last_error()
    """, FAKECUDA_CAPACITY="64MiB")


def test_cupy_allocates_from_the_pool():
    run_fake("""
        import types, warnings
        calls = []

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id):
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr = mem, mem.ptr + offset

        class OutOfMemoryError(MemoryError):
            def __init__(self, size, total, limit=0):
                super().__init__(f"Out of memory allocating {size} bytes")

        cuda = types.SimpleNamespace(
            UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer,
            memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
            runtime=types.SimpleNamespace(getDevice=lambda: 0),
            get_current_stream=lambda: types.SimpleNamespace(ptr=0),
            set_allocator=lambda fn: calls.append(fn))
        sys.modules["cupy"] = types.SimpleNamespace(cuda=cuda)
        import pymemplan.cupy

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pymemplan.cupy.use()
        assert not caught, [str(w.message) for w in caught]
        malloc, = calls

        mp = malloc(5 * MiB)
        assert mp.ptr and mp.mem.size == 5 * MiB and mp.mem.device_id == 0
        ctypes.memset(mp.ptr, 1, 5 * MiB)
        assert pymemplan.memory_stats()["requested_bytes.all.current"] == 5 * MiB
        del mp
        gc.collect()
        assert pymemplan.memory_allocated() == 0, "freed when CuPy dropped the memory"

        empty = malloc(0)
        assert empty.ptr == 0 and pymemplan.memory_allocated() == 0
        try:
            malloc(1 << 40)
            raise AssertionError("no OOM")
        except OutOfMemoryError as e:
            assert str(e).startswith("pymemplan: out of memory"), e

        cuda.runtime.getDevice = lambda: 7  # the fake driver has one device
        try:
            malloc(MiB)
            raise AssertionError("no error")
        except RuntimeError as e:  # a failure, but not an out-of-memory
            assert "pymemplan: allocation failed" in str(e), e
        cuda.runtime.getDevice = lambda: 0

        # oom_action:raise is for PyTorch; CuPy goes through pymemplan_try_alloc and still
        # gets a clean OutOfMemoryError instead of an exception ctypes cannot catch.
        configure(oom_action="raise")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pymemplan.cupy.use()
        assert not caught, [str(w.message) for w in caught]
        try:
            calls[-1](1 << 40)
            raise AssertionError("no OOM")
        except OutOfMemoryError as e:
            assert str(e).startswith("pymemplan: out of memory"), e

        # CuPy's per-thread default stream is one handle for every thread's own stream: the
        # pool cannot tell them apart, so it refuses it rather than share blocks unsafely.
        cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=2)
        before = pymemplan.memory_allocated()
        try:
            malloc(MiB)
            raise AssertionError("per-thread default stream accepted")
        except RuntimeError as e:
            assert "CUPY_CUDA_PER_THREAD_DEFAULT_STREAM" in str(e), e
        assert pymemplan.memory_allocated() == before

        # A stream the pool served outlives the program's last reference to it: the pool may
        # record events on its handle after the block is freed, and CuPy destroys the handle
        # of a stream it collects.
        import weakref

        class Stream:
            def __init__(self, ptr):
                self.ptr = ptr

        fake.fakecuda_stream_create.restype = ctypes.c_void_p
        stream = Stream(fake.fakecuda_stream_create(0))
        alive = weakref.ref(stream)
        cuda.get_current_stream = lambda: stream
        mp = malloc(MiB)
        cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=0)
        del mp, stream
        gc.collect()
        assert alive() is not None, "the stream was collected while the pool may still use it"
        mp = malloc(MiB)  # the null stream: nothing to keep
        del mp
        assert list(pymemplan.cupy._streams) == [alive().ptr]
    """)


def test_an_oom_records_what_the_driver_has_free_not_what_pymemplan_does_not_hold():
    # The CUDA context, NCCL's buffers and other processes hold device memory too: counted
    # as free, `pymemplan explain` would judge allocators on memory the program never had,
    # and say that the allocator that just failed fits.
    run_fake("""
        from pymemplan.traces import explain_snapshot
        configure(policy="pymemplan", oom_action="null")
        pymemplan.record_memory_history(1000)
        assert lib.pymemplan_alloc(100 * MiB, 0, None)
        ctx, other = ctypes.c_void_p(), ctypes.c_void_p()
        assert fake.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert fake.cuCtxSetCurrent(ctx) == 0
        assert fake.cuMemAlloc_v2(ctypes.byref(other), ctypes.c_size_t(80 * MiB)) == 0
        assert not lib.pymemplan_alloc(100 * MiB, 0, None)  # 56 MiB are free
        oom = [e for e in pymemplan.snapshot(0)["device_traces"][0] if e["action"] == "oom"][-1]
        assert oom["device_free"] == 256 * MiB - fake.fakecuda_bytes_in_use(0) == 76 * MiB
        fit = explain_snapshot(pymemplan.snapshot(0), compare=True).fit
        assert fit.capacity_bytes == pymemplan.memory_reserved(0) + 76 * MiB < 256 * MiB
        assert not any(r.fits for r in fit.rows), [(r.policy, r.fits, r.peak_reserved_bytes) for r in fit.rows]
    """, FAKECUDA_CAPACITY="256MiB")


def test_a_virtual_segment_is_one_snapshot_segment_per_run_of_mapped_pages():
    # As PyTorch reports its expandable segments: the segments' sizes add up to the memory
    # reserved, not to the address space reserved, in PyTorch's viewer as in `explain`.
    run_fake("""
        import pickle
        from torch.cuda import _memory_viz
        from pymemplan.traces import explain_snapshot
        configure(policy="pymemplan-vmm", oom_action="null")
        a, b, c = (lib.pymemplan_alloc(n * MiB, 0, None) for n in (3, 9, 5))
        lib.pymemplan_free(b, 9 * MiB, 0, None)
        pymemplan.empty_cache()  # the pages b alone used go back: two runs of mapped pages
        segs = pymemplan.snapshot(0)["segments"]
        reserved = pymemplan.memory_reserved(0)
        assert len(segs) == 2 and sum(s["total_size"] for s in segs) == reserved < 1 << 30
        for s in segs:  # blocks tile each segment, and the free ones are cut to it
            at = s["address"]
            for blk in s["blocks"]:
                assert blk["address"] == at
                at += blk["size"]
            assert at == s["address"] + s["total_size"] == s["address"] + s["mapped_size"]
            assert s["allocated_size"] == sum(x["size"] for x in s["blocks"]
                                              if x["state"] == "active_allocated")
        assert sorted(blk["address"] for s in segs for blk in s["blocks"]
                      if blk["state"] == "active_allocated") == sorted([a, c])
        snap = pymemplan.snapshot()
        assert f"total_reserved: {reserved / MiB:.1f}MiB" in _memory_viz.segsum(snap)
        assert explain_snapshot(snap).reserved_bytes == reserved
    """, FAKECUDA_CAPACITY="1GiB")


def test_the_history_keeps_the_allocators_order_when_threads_allocate_and_free_at_once():
    # A free written after another thread was handed the same address would make the
    # history allocate a live block again, and `explain` would refuse the snapshot.
    run_fake("""
        import threading
        from pymemplan.traces.snapshot import snapshot_trace
        pymemplan.record_memory_history(200000)
        def churn():
            for _ in range(3000):
                p = lib.pymemplan_alloc(4096, 0, None)
                lib.pymemplan_free(p, 4096, 0, None)
        threads = [threading.Thread(target=churn) for _ in range(3)]
        for t in threads: t.start()
        for t in threads: t.join()
        snap = pymemplan.snapshot(0)
        assert len(snap["device_traces"][0]) > 9000
        snapshot_trace(snap)  # raises where a live pointer is allocated again
    """)


def test_a_free_naming_another_device_frees_the_block_where_it_is():
    run_fake("""
        fake.fakecuda_primary_ctx_refcount.argtypes = [ctypes.c_int]
        p = lib.pymemplan_alloc(MiB, 0, None)
        lib.pymemplan_free(p, MiB, 1, None)
        assert pymemplan.memory_allocated(0) == 0
        assert fake.fakecuda_primary_ctx_refcount(1) == 0  # no allocator made on device 1
    """, FAKECUDA_DEVICE_COUNT="2")


def test_calls_naming_a_device_the_driver_lacks_fail_and_a_fraction_of_zero_allows_nothing():
    run_fake("""
        assert lib.pymemplan_alloc(MiB, 0, None)
        for name in ("reset_peak_stats", "reset_accumulated_stats", "empty_cache", "mark_step"):
            for device in (7, 100):
                assert getattr(lib, "pymemplan_" + name)(device) == -1, (name, device)
                assert "device" in pymemplan.last_error(), pymemplan.last_error()
        assert lib.pymemplan_empty_cache(-1) == 0 and lib.pymemplan_mark_step(1) == 0
        try:
            pymemplan.reset_peak_memory_stats(7)
        except Exception as e:
            assert "CUDA device 7 does not exist (the driver reports 2 devices)" in str(e), e
        else:
            raise AssertionError("reset_peak_memory_stats(7) passed")
        lib.pymemplan_memory_fraction(0.0, 0)  # PyTorch accepts 0: nothing more may be had
        assert not lib.pymemplan_alloc(2 * MiB, 0, None)
        assert "limit" in pymemplan.last_error(), pymemplan.last_error()
    """, FAKECUDA_DEVICE_COUNT="2")


def test_a_free_that_waits_on_another_streams_work_completes_in_the_history_when_its_block_can_be_reused():
    # PyTorch writes free_completed when the block returns to the pool: a replay of the
    # history (`pymemplan explain`) must not reuse it earlier than the allocator could.
    run_fake("""
        from pymemplan.traces.snapshot import snapshot_trace
        lib.pymemplan_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        fake.fakecuda_complete_stream.argtypes = [ctypes.c_void_p]
        fake.fakecuda_set_manual_events(1)
        s0, s1 = ctypes.c_void_p(0x10), ctypes.c_void_p(0x20)
        pymemplan.record_memory_history(1000)
        p = lib.pymemplan_alloc(16 * MiB, 0, s0)
        lib.pymemplan_record_stream(p, s1)
        lib.pymemplan_free(p, 16 * MiB, 0, s0)
        q = lib.pymemplan_alloc(16 * MiB, 0, s0)  # p is not done with on s1
        def ours():
            return [(e["action"], e["addr"]) for e in pymemplan.snapshot(0)["device_traces"][0]
                    if not e["action"].startswith("segment_")]
        assert ours() == [("alloc", p), ("free_requested", p), ("alloc", q)], ours()
        fake.fakecuda_complete_stream(s1)
        r = lib.pymemplan_alloc(16 * MiB, 0, s0)
        assert r == p  # reused once its event completed: completed first in the history
        assert ours()[3:] == [("free_completed", p), ("alloc", p)], ours()
        snapshot_trace(pymemplan.snapshot(0))  # a history its readers accept
        lib.pymemplan_free(q, 16 * MiB, 0, s0)  # no other stream: completed at once
        assert ours()[-2:] == [("free_requested", q), ("free_completed", q)], ours()
    """)
