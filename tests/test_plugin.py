"""libpymemplan_alloc.so's C ABI over the fake CUDA driver: the real CudaDevice code path,
on CPUs. Each test runs in its own process, since the driver is loaded once per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pymemplan._core

PKG = Path(pymemplan._core.__file__).resolve().parent
PLUGIN = PKG / "libpymemplan_alloc.so"
FAKE = PKG / "_testing" / "libfakecuda.so"
MiB = 1 << 20

PRELUDE = f"""
import ctypes, json, threading
MiB = 1 << 20
fake = ctypes.CDLL({str(FAKE)!r}, mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL({str(PLUGIN)!r})
lib.pymemplan_alloc.restype = ctypes.c_void_p
lib.pymemplan_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.pymemplan_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.pymemplan_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
lib.pymemplan_last_error.restype = ctypes.c_char_p
lib.pymemplan_stats_json.restype = ctypes.c_long
lib.pymemplan_stats_json.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
lib.pymemplan_snapshot_json.restype = ctypes.c_long
lib.pymemplan_snapshot_json.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
lib.pymemplan_set_memory_limit.argtypes = [ctypes.c_int, ctypes.c_size_t]
fake.fakecuda_bytes_in_use.restype = ctypes.c_size_t
fake.fakecuda_num_allocs.restype = ctypes.c_longlong
fake.fakecuda_complete_stream.argtypes = [ctypes.c_void_p]

def read_json(fn, device=0):
    n = fn(device, None, 0)
    assert n >= 0, lib.pymemplan_last_error()
    buf = ctypes.create_string_buffer(n + 1)
    assert fn(device, buf, n + 1) == n
    return json.loads(buf.value)

def stats():
    return read_json(lib.pymemplan_stats_json)

def snapshot():
    return read_json(lib.pymemplan_snapshot_json)

def err():
    return lib.pymemplan_last_error().decode()

def alloc(n, stream=None):
    return lib.pymemplan_alloc(n, 0, stream)

def free(p, stream=None):
    lib.pymemplan_free(p, 0, 0, stream)
"""


def run(body: str, *, config: str = "oom_action:null", policy: str = "pymemplan",
        **env) -> subprocess.CompletedProcess:
    code = PRELUDE + (f"assert lib.pymemplan_configure({policy.encode()!r}, {config.encode()!r}) "
                      "== 0, err()\n")
    code += textwrap.dedent(body)
    environ = {**os.environ, "PYMEMPLAN_LIBCUDA": str(FAKE), "FAKECUDA_CAPACITY": str(256 * MiB),
               **{k: str(v) for k, v in env.items()}}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environ, timeout=120)


def ok(body: str, **kw) -> str:
    r = run(body, **kw)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


pytestmark = pytest.mark.skipif(not (PLUGIN.exists() and FAKE.exists()),
                                reason="plugin or fake driver not built (reinstall the package)")


def test_allocates_reuses_and_returns_memory_to_the_driver():
    ok("""
        p = alloc(3 * MiB)
        assert p and p % 512 == 0
        ctypes.memset(p, 7, 3 * MiB)   # the fake driver's memory is real host memory
        q = alloc(100)
        free(p)
        assert alloc(3 * MiB) == p     # cached block reused, no new driver allocation
        s = stats()
        assert s["num_device_alloc"] == 2 and s["allocated_bytes.all.current"] == 3 * MiB + 512
        assert fake.fakecuda_bytes_in_use(0) == s["reserved_bytes.all.current"]
        free(p); free(q)
        assert lib.pymemplan_empty_cache(0) == 0
        assert fake.fakecuda_bytes_in_use(0) == 0 and stats()["reserved_bytes.all.current"] == 0
        assert alloc(0) is None        # empty tensors own no memory
    """)


def test_block_waiting_on_an_event_is_not_handed_out_until_it_completes():
    ok("""
        fake.fakecuda_set_manual_events(1)
        s0, s1 = ctypes.c_void_p(0x10), ctypes.c_void_p(0x20)
        p = alloc(16 * MiB, s0)
        lib.pymemplan_record_stream(p, s1)
        free(p, s0)
        assert snapshot()["segments"][0]["blocks"][0]["state"] == "active_pending_free"
        q = alloc(16 * MiB, s0)
        assert q != p
        fake.fakecuda_complete_stream(s1)
        r = alloc(16 * MiB, s0)
        assert r == p, "block not reused after its event completed"
    """)


def test_free_whose_stream_event_is_refused_leaves_the_block_allocated_and_intact():
    # cuEventRecord refuses a stream of another context (a tensor recorded on another GPU's
    # stream). The free fails, says so, and changes nothing: the block is still allocated
    # and counted, not lost half-freed; once the event can be recorded, it frees normally.
    r = run("""
        s0, s1 = ctypes.c_void_p(0x10), ctypes.c_void_p(0x20)
        p = alloc(16 * MiB, s0)
        lib.pymemplan_record_stream(p, s1)
        before = stats()
        fake.fakecuda_fail_record_at(1)
        free(p, s0)
        after = stats()
        assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"] > 0
        assert after["active_bytes.all.current"] == before["active_bytes.all.current"]
        assert snapshot()["segments"][0]["blocks"][0]["state"] == "active_allocated"
        free(p, s0)                                   # the event is recorded this time
        assert stats()["allocated_bytes.all.current"] == 0
        assert alloc(16 * MiB, s0) == p
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr.count("cuEventRecord failed: CUDA_ERROR_INVALID_HANDLE") == 1, r.stderr


def test_record_stream_with_another_gpus_stream_waits_on_that_stream():
    # cuEventRecord takes only an event of the stream's own context: an event of the block's
    # device cannot be recorded on device 1's stream. One is made in that stream's context,
    # and the block waits on it like on any other.
    r = run("""
        fake.fakecuda_stream_create.restype = ctypes.c_void_p
        fake.fakecuda_set_manual_events(1)
        s0 = ctypes.c_void_p(fake.fakecuda_stream_create(0))
        s1 = ctypes.c_void_p(fake.fakecuda_stream_create(1))
        p = alloc(16 * MiB, s0)
        lib.pymemplan_record_stream(p, s1)
        free(p, s0)
        assert snapshot()["segments"][0]["blocks"][0]["state"] == "active_pending_free"
        assert alloc(16 * MiB, s0) != p               # device 1's stream may still use it
        fake.fakecuda_complete_stream(s1)
        assert alloc(16 * MiB, s0) == p
    """, FAKECUDA_DEVICE_COUNT=2)
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr


def test_oom_ladder_and_message():
    out = ok("""
        ps = [alloc(40 * MiB) for _ in range(6)]       # 240 of 256 MiB
        for p in ps[:3]:
            free(p)                                     # 120 MiB cached
        big = alloc(200 * MiB)                          # ladder: release cache, retry -> fails
        assert big is None
        s = stats()
        assert s["num_ooms"] == 1 and s["num_alloc_retries"] == 1
        assert s["num_device_free"] == 3
        print(err())
        ok = alloc(100 * MiB)                           # after releasing cache this fits
        assert ok
    """)
    for needle in ("out of memory", "tried to allocate 200.00 MiB", "Allocated 120.00 MiB",
                   "reserved 120.00 MiB", "largest free block", "capacity 256.00 MiB"):
        assert needle in out, (needle, out)


def test_memory_limit():
    out = ok("""
        assert lib.pymemplan_set_memory_limit(0, 64 * MiB) == 0
        assert alloc(48 * MiB)
        assert alloc(32 * MiB) is None
        print(err())
    """)
    assert "memory limit" in out


def test_oom_raises_by_default():
    # oom_action:raise throws std::runtime_error out of pymemplan_alloc: PyTorch turns it into a
    # RuntimeError. Called from ctypes, nothing can catch it, so the process aborts with it.
    r = run("alloc(1 << 40)", config="")
    assert r.returncode != 0
    assert "pymemplan: out of memory" in r.stderr


def test_try_alloc_never_throws_even_under_raise():
    out = ok("""
        lib.pymemplan_try_alloc.restype = ctypes.c_void_p
        lib.pymemplan_try_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        assert lib.pymemplan_try_alloc(1 << 40, 0, None) is None
        print(err())
        assert lib.pymemplan_try_alloc(MiB, 0, None)
    """, config="")
    assert "pymemplan: out of memory" in out


def test_driver_failures_name_the_driver_error():
    out = ok("""
        fake.fakecuda_fail_alloc_error(1)      # CUDA_ERROR_INVALID_VALUE
        fake.fakecuda_fail_alloc_at(1)
        assert alloc(30 * MiB) is None
        print(err())
        assert alloc(30 * MiB)                 # the allocator still works afterwards
    """)
    assert "cuMemAlloc failed: CUDA_ERROR_INVALID_VALUE" in out


def test_invalid_free_is_reported_and_harmless(capfd):
    r = run("""
        p = alloc(MiB)
        free(p + 512)
        print("after:", err())
        free(p)
        assert stats()["allocated_bytes.all.current"] == 0
    """)
    assert r.returncode == 0, r.stderr
    assert "points inside a block" in r.stderr and "after: " in r.stdout


@pytest.mark.parametrize("policy", ["pymemplan", "pymemplan-vmm"])
def test_allocating_during_a_cuda_graph_capture_is_refused_cleanly(policy):
    # A graph replays on the addresses it captured: memory from the shared pool would be
    # handed to eager tensors and overwritten at replay. Refused, with what to do instead,
    # and without a call the driver forbids during a capture (which would invalidate it).
    ok("""
        fake.fakecuda_capture_violations.restype = ctypes.c_longlong
        s = ctypes.c_void_p(0x30)
        p = alloc(4 * MiB, s)
        fake.fakecuda_set_capturing(s, 1)
        assert alloc(4 * MiB, s) is None
        e = err()
        assert "capturing a CUDA graph" in e and "reduce-overhead" in e, e
        assert lib.pymemplan_alloc(4 * MiB, 0, s) is None  # oom_action:null: no exception
        assert fake.fakecuda_capture_violations() == 0
        fake.fakecuda_set_capturing(s, 0)
        q = alloc(4 * MiB, s)
        assert q is not None, err()
        free(q, s); free(p, s)
        assert stats()["allocated_bytes.all.current"] == 0
    """, policy=policy)


@pytest.mark.parametrize("policy", ["pymemplan", "pymemplan-vmm"])
def test_a_free_during_a_capture_waits_for_the_capture_to_end_and_breaks_nothing(policy):
    # A block used on another stream, freed while that stream captures a graph: its event
    # cannot go into the capture (the driver would refuse to query it ever after). It is
    # recorded once the capture has ended; the block is reused after that work completes.
    ok("""
        fake.fakecuda_capture_violations.restype = ctypes.c_longlong
        fake.fakecuda_set_manual_events(1)
        s0, s1 = ctypes.c_void_p(0x10), ctypes.c_void_p(0x20)
        p = alloc(16 * MiB, s0)
        lib.pymemplan_record_stream(p, s1)
        fake.fakecuda_set_capturing(s1, 1)
        free(p, s0)
        fake.fakecuda_set_capturing(s1, 0)
        assert fake.fakecuda_capture_violations() == 0
        q = alloc(16 * MiB, s0)
        assert q is not None and q != p, "reused before the captured stream's work was done"
        # The allocation above recorded the deferred event (the capture had ended): its
        # work done, the block is reused.
        fake.fakecuda_complete_stream(s1)
        r = alloc(16 * MiB, s0)
        assert r == p, "block never reused after the capture ended"
        for x in (q, r):
            free(x, s0)
        fake.fakecuda_complete_all()
        assert alloc(16 * MiB, s0) is not None, err()
    """, policy=policy)


def test_concurrent_callers():
    ok("""
        errors = []
        def work(seed):
            import random
            rng = random.Random(seed)
            mine = []
            try:
                for _ in range(2000):
                    if mine and rng.random() < 0.5:
                        free(mine.pop())
                    else:
                        p = alloc(rng.randint(1, 256 * 1024))
                        assert p, err()
                        mine.append(p)
                for p in mine:
                    free(p)
            except Exception as e:
                errors.append(e)
        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        assert not errors, errors
        assert stats()["allocated_bytes.all.current"] == 0
    """, FAKECUDA_CAPACITY=1 << 30)


def test_no_driver_is_a_clear_error_not_a_crash():
    r = run("""
        assert alloc(MiB) is None
        print(err())
        assert lib.pymemplan_device_count() == -1
    """, PYMEMPLAN_LIBCUDA="/nonexistent/libcuda.so.1")
    assert r.returncode == 0, r.stderr
    assert "cannot load the CUDA driver /nonexistent/libcuda.so.1" in r.stdout


def test_bad_config_is_rejected():
    r = run("", config="max_split_size_mb:abc")
    assert r.returncode != 0 and "bad value 'abc'" in r.stderr
    r = run("", config="oom_action:explode")
    assert r.returncode != 0 and "expected raise or null" in r.stderr


def test_a_list_of_divisions_configures_the_plugin_as_pytorch_reads_it():
    # Commas inside the brackets belong to the value (PyTorch's list form).
    ok("""
        p = alloc(600 * MiB + 1)
        assert p, err()
        assert stats()["allocated_bytes.all.current"] == 640 * MiB
        free(p)
    """, policy="torch", config="roundup_power2_divisions:[256:1,>:4],oom_action:null",
       FAKECUDA_CAPACITY=1 << 30)


# --- Virtual memory (pymemplan-vmm) through the driver's cuMem* calls ---

VMM_PRELUDE = """
fake.fakecuda_live_handles.restype = ctypes.c_int
fake.fakecuda_live_mappings.restype = ctypes.c_int
fake.fakecuda_live_reservations.restype = ctypes.c_int
for name in ("create_calls", "map_calls", "set_access_calls", "unmap_calls"):
    getattr(fake, "fakecuda_" + name).restype = ctypes.c_longlong
calls = lambda: (fake.fakecuda_map_calls(), fake.fakecuda_set_access_calls(),
                 fake.fakecuda_unmap_calls())
"""


def run_vmm(body: str, config: str = "oom_action:null", policy: str = "pymemplan-vmm", **env):
    code = PRELUDE + VMM_PRELUDE + (
        f"assert lib.pymemplan_configure({policy.encode()!r}, {config.encode()!r}) == 0, "
        "err()\n")
    code += textwrap.dedent(body)
    environ = {**os.environ, "PYMEMPLAN_LIBCUDA": str(FAKE), "FAKECUDA_CAPACITY": str(64 * MiB),
               **{k: str(v) for k, v in env.items()}}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=environ, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_vmm_maps_pages_on_demand_and_memory_is_usable():
    run_vmm("""
        p = alloc(30 * MiB)
        assert p
        ctypes.memset(p, 3, 30 * MiB)                 # written through the mapped pages
        assert fake.fakecuda_live_handles(0) == 15 and fake.fakecuda_live_mappings() == 15
        assert fake.fakecuda_live_reservations() == 1
        q = alloc(3 * MiB)                            # packed after p, sharing its last page
        ctypes.memset(q, 4, 3 * MiB)
        assert ctypes.string_at(p + 30 * MiB - 1, 1) == b"\\x03"
        s = stats()
        assert s["reserved_bytes.all.current"] == fake.fakecuda_bytes_in_use(0) == 17 * 2 * MiB
        seg = snapshot()["segments"][0]
        assert seg["is_expandable"] and seg["mapped_size"] == 34 * MiB
        free(p); free(q)
        assert lib.pymemplan_empty_cache(0) == 0
        assert fake.fakecuda_live_handles(0) == 0 and fake.fakecuda_live_mappings() == 0
        assert fake.fakecuda_live_reservations() == 0 and fake.fakecuda_bytes_in_use(0) == 0
    """)


def test_vmm_pages_are_open_to_every_peer_that_can_reach_them():
    # cuMemMap memory is not covered by cudaDeviceEnablePeerAccess: without an access
    # descriptor per peer, a copy to another GPU or a peer kernel reading the tensor faults.
    body = """
        fake.fakecuda_access_mask.restype = ctypes.c_ulonglong
        fake.fakecuda_access_mask.argtypes = [ctypes.c_void_p]
        p = lib.pymemplan_alloc(4 * MiB, 1, None)     # on device 1 of three
        assert p, err()
        print(fake.fakecuda_access_mask(p), fake.fakecuda_access_mask(p + 3 * MiB))
        lib.pymemplan_free(p, 0, 1, None)
    """
    assert ok(body, policy="pymemplan-vmm", FAKECUDA_DEVICE_COUNT=3).split() == ["7", "7"]
    # Peers that cannot reach it are left out: only the owner.
    assert ok(body, policy="pymemplan-vmm", FAKECUDA_DEVICE_COUNT=3,
              FAKECUDA_PEER_ACCESS=0).split() == ["2", "2"]


def test_vmm_pages_are_rdma_capable_where_the_device_supports_it():
    # As PyTorch's expandable segments: NCCL can then register the pages with the NIC. Where
    # the device cannot, asking for it would fail cuMemCreate, so it is not asked.
    body = """
        p = alloc(4 * MiB)
        assert p, err()
        print(fake.fakecuda_rdma_capable(ctypes.c_void_p(p)))
        free(p)
    """
    assert ok(body, policy="pymemplan-vmm", FAKECUDA_RDMA_VMM=1).split() == ["1"]
    assert ok(body, policy="pymemplan-vmm").split() == ["0"]


def test_a_device_without_virtual_memory_still_serves_the_classic_policy():
    # The driver has the calls, but the device reports no virtual memory management
    # (some vGPU profiles, WSL): the classic policy must not depend on it, and asking for
    # virtual memory says what to use instead.
    out = ok("""
        p = alloc(3 * MiB)
        assert p, err()
        ctypes.memset(p, 5, 3 * MiB)
        free(p)
        print(stats()["reserved_bytes.all.current"] > 0)
    """, FAKECUDA_VMM_SUPPORTED=0)
    assert out.split() == ["True"]
    for policy in ("pymemplan-vmm", "pymemplan-planned"):
        out = ok("""
            assert not alloc(3 * MiB)
            print(err())
        """, policy=policy, FAKECUDA_VMM_SUPPORTED=0)
        assert "no virtual memory support" in out and "vmm:False" in out


def test_vmm_stitches_freed_pages_into_a_larger_request():
    # 64 MiB device: after freeing every other 8 MiB block, 32 MiB is free in four holes.
    # A 32 MiB request cannot fit a hole, but their pages can be mapped behind it.
    run_vmm("""
        ps = [alloc(8 * MiB) for _ in range(8)]
        assert all(ps), err()
        for p in ps[::2]:
            free(p)
        big = alloc(32 * MiB)
        assert big, err()
        ctypes.memset(big, 1, 32 * MiB)
        assert fake.fakecuda_bytes_in_use(0) == 64 * MiB
        assert stats()["num_ooms"] == 0
    """)


def test_vmm_failing_page_creation_midway_leaves_nothing_mapped():
    out = run_vmm("""
        p = alloc(48 * MiB)                 # 24 pages of 64 MiB
        assert p
        assert alloc(32 * MiB) is None      # runs out after 8 more pages: all undone
        assert "out of memory" in err()
        assert fake.fakecuda_live_handles(0) == 24 and fake.fakecuda_live_mappings() == 24
        assert fake.fakecuda_bytes_in_use(0) == 48 * MiB == stats()["reserved_bytes.all.current"]
        fake.fakecuda_fail_alloc_error(1)   # CUDA_ERROR_INVALID_VALUE: a driver failure
        fake.fakecuda_fail_create_at(3)
        assert alloc(12 * MiB) is None
        print(err())
        assert fake.fakecuda_live_handles(0) == 24 and fake.fakecuda_live_mappings() == 24
        free(p)
        q = alloc(32 * MiB)                 # and it still works
        assert q, err()
        ctypes.memset(q, 5, 32 * MiB)
    """)
    assert "cuMemCreate failed: CUDA_ERROR_INVALID_VALUE" in out


def test_vmm_maps_and_unmaps_a_run_of_pages_with_one_access_and_one_unmap_call():
    # cuMemSetAccess updates the device's page tables: one call per run of pages, as torch's
    # expandable segments make per range, not one per 2 MiB page. Unmapping too.
    run_vmm("""
        m0, a0, u0 = calls()
        p = alloc(30 * MiB)                           # 15 pages in one run
        assert p, err()
        assert calls() == (m0 + 15, a0 + 1, u0)       # a cuMemMap per physical page
        ctypes.memset(p, 3, 30 * MiB)
        free(p)
        assert lib.pymemplan_empty_cache(0) == 0
        assert calls() == (m0 + 15, a0 + 1, u0 + 1)
        assert fake.fakecuda_live_mappings() == 0 and fake.fakecuda_live_handles(0) == 0
    """)


def test_vmm_moves_physical_pages_without_releasing_and_creating_them_again():
    # At its peak, vmm unmaps unused pages to map them behind a new request: the physical
    # pages themselves move (cuMemUnmap + cuMemMap), no cuMemRelease + cuMemCreate each.
    run_vmm("""
        fake.fakecuda_create_calls.restype = ctypes.c_longlong
        x = alloc(16 * MiB)
        keep = alloc(4 * MiB)
        free(x)                                       # 8 pages unused, 10 held: the peak
        c0 = fake.fakecuda_create_calls()
        y = alloc(18 * MiB)                           # fits only above x's place
        assert y, err()
        ctypes.memset(y, 7, 18 * MiB)
        assert fake.fakecuda_create_calls() == c0 + 1  # 8 pages moved, 1 new
        assert fake.fakecuda_live_handles(0) == 11 == stats()["reserved_bytes.all.current"] // (2 * MiB)
        free(y); free(keep)
        assert lib.pymemplan_empty_cache(0) == 0
        assert fake.fakecuda_live_handles(0) == 0 and fake.fakecuda_bytes_in_use(0) == 0
    """)


def test_vmm_failing_map_midway_through_a_run_leaves_nothing_mapped():
    out = run_vmm("""
        p = alloc(8 * MiB)
        assert p, err()
        fake.fakecuda_fail_map_at(3)                  # the third page of the next run
        assert alloc(12 * MiB) is None
        print(err())
        assert fake.fakecuda_live_handles(0) == 4 and fake.fakecuda_live_mappings() == 4
        assert fake.fakecuda_bytes_in_use(0) == 8 * MiB == stats()["reserved_bytes.all.current"]
        q = alloc(12 * MiB)                           # and it still works
        assert q, err()
        ctypes.memset(q, 5, 12 * MiB)
        ctypes.memset(p, 6, 8 * MiB)
    """)
    assert "cuMemMap failed: CUDA_ERROR_INVALID_VALUE" in out


@pytest.mark.parametrize("call", ["map", "access"])
def test_vmm_mapping_out_of_memory_is_retried_then_an_oom(call):
    # cuMemMap and cuMemSetAccess need device memory for page tables, and return
    # CUDA_ERROR_OUT_OF_MEMORY when it is short. Like a cuMemCreate OOM, that gives cached
    # memory back and maps once more; failing again, the request is an OOM, not a driver error.
    out = run_vmm(f"""
        fake.fakecuda_fail_map_error(2)               # CUDA_ERROR_OUT_OF_MEMORY
        p = alloc(8 * MiB)
        keep = alloc(4 * MiB)
        free(p)                                       # 4 pages cached
        fake.fakecuda_fail_{call}_at(1)
        q = alloc(14 * MiB)                           # 7 pages: the first mapping fails
        assert q, err()
        ctypes.memset(q, 5, 14 * MiB)
        ctypes.memset(keep, 6, 4 * MiB)
        assert stats()["num_alloc_retries"] == 1 and stats()["num_ooms"] == 0
        fake.fakecuda_fail_map_at(1)                  # the first try fails in cuMemMap,
        fake.fakecuda_fail_access_at(1)               # the retry in cuMemSetAccess
        assert alloc(20 * MiB) is None
        print(err())
        assert stats()["num_ooms"] == 1
        assert fake.fakecuda_bytes_in_use(0) == stats()["reserved_bytes.all.current"]
        assert fake.fakecuda_live_mappings() == fake.fakecuda_live_handles(0)
        r = alloc(20 * MiB)                           # and it still works
        assert r, err()
        ctypes.memset(r, 7, 20 * MiB)
        assert ctypes.string_at(q, 1) == b"\\x05" and ctypes.string_at(keep, 1) == b"\\x06"
    """)
    assert "out of memory" in out and "CUDA_ERROR" not in out


@pytest.mark.parametrize("policy", ["pymemplan-vmm", "pymemplan-planned"])
def test_two_threads_allocating_at_once_turn_automatic_page_sharing_off(policy):
    # Page sharing moves live bytes and remaps their page; a kernel another thread launches
    # meanwhile could write the page as it moves. Two threads inside the allocator at once
    # show a program where that can happen: automatic sharing goes off, once, with a message.
    out = run_vmm("""
        import os, tempfile, time
        log = tempfile.TemporaryFile()
        os.dup2(log.fileno(), 2)                      # the plugin's messages go to stderr
        def said():
            log.seek(0)
            return log.read().decode()
        stop = []
        def churn():
            while not stop:
                free(alloc(4 * MiB))
        threads = [threading.Thread(target=churn) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while "share_pages" not in said() and time.time() < deadline:
            time.sleep(0.01)
        stop.append(1)
        for t in threads:
            t.join()
        print(said())
        assert stats()["allocated_bytes.all.current"] == 0
    """, policy=policy)
    assert out.count("two threads allocate on device 0 at once") == 1, out
    assert "automatic page sharing (share_pages) is now off" in out


def test_torch_expandable_segments_run_over_the_driver():
    # The model of PyTorch's expandable segments through the real driver path: one address
    # range (80 MiB for this 64 MiB device) mapped 20 MiB at a time, in place.
    out = run_vmm("""
        p = alloc(30 * MiB)
        assert p, err()
        ctypes.memset(p, 3, 30 * MiB)
        assert fake.fakecuda_bytes_in_use(0) == 40 * MiB == stats()["reserved_bytes.all.current"]
        free(p)
        q = alloc(50 * MiB)                 # the freed block grows: 20 MiB more, same address
        assert q == p, err()
        ctypes.memset(q, 4, 50 * MiB)
        assert fake.fakecuda_bytes_in_use(0) == 60 * MiB
        assert alloc(20 * MiB) is None      # 10 MiB free after q, 4 MiB left on the device
        assert "out of memory" in err()
        free(q)
        assert lib.pymemplan_empty_cache(0) == 0
        assert fake.fakecuda_bytes_in_use(0) == 0 and fake.fakecuda_live_mappings() == 0
        fake.fakecuda_fail_alloc_error(1)   # CUDA_ERROR_INVALID_VALUE on the third page
        fake.fakecuda_fail_create_at(3)
        assert alloc(30 * MiB) is None
        print(err())
        assert fake.fakecuda_live_handles(0) == 0 and fake.fakecuda_live_mappings() == 0
        assert stats()["reserved_bytes.all.current"] == 0
        r = alloc(30 * MiB)                 # and it still works
        assert r == p, err()
        ctypes.memset(r, 5, 30 * MiB)
    """, policy="torch", config="oom_action:null,expandable_segments:True")
    assert "cuMemCreate failed: CUDA_ERROR_INVALID_VALUE" in out


def test_planned_policy_runs_in_the_plugin():
    r = run("""
        p = alloc(5 * MiB)
        ctypes.memset(p, 1, 5 * MiB)
        free(p)
        assert stats()["allocated_bytes.all.current"] == 0
        lib.pymemplan_empty_cache(0)
        assert fake.fakecuda_bytes_in_use(0) == 0
    """, policy="pymemplan-planned", config="min_period:32")
    assert r.returncode == 0, r.stderr


def test_share_pages_keeps_every_byte_and_gives_pages_back():
    """share_pages over the fake driver, whose memory is real: the live half of one page is
    copied into the free half of another, and both addresses map that page. Every block reads
    what was written before, writes through one address do not reach another block, and
    nothing leaks once all is freed."""
    ok("""
        lib.pymemplan_share_pages.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
        fake.fakecuda_ctx_synchronizations.restype = ctypes.c_longlong
        fake.fakecuda_bytes_copied.restype = ctypes.c_longlong
        ptrs = [alloc(MiB) for _ in range(8)]
        assert all(ptrs) and ptrs == [ptrs[0] + i * MiB for i in range(8)], ptrs
        kept = []
        for page in range(4):  # the front half of even pages lives on, the back half of odd
            front, back = ptrs[2 * page], ptrs[2 * page + 1]
            free(back if page % 2 == 0 else front)
            kept.append(front if page % 2 == 0 else back)
        for i, p in enumerate(kept):
            ctypes.memset(p, 17 + i, MiB)
        reserved = stats()["reserved_bytes.all.current"]
        handles = fake.fakecuda_live_handles(0)

        given = ctypes.c_size_t()
        assert lib.pymemplan_share_pages(-1, ctypes.byref(given)) == 0, err()
        assert given.value == 4 * MiB
        assert stats()["reserved_bytes.all.current"] == reserved - 4 * MiB
        assert fake.fakecuda_live_handles(0) == handles - 2
        assert fake.fakecuda_ctx_synchronizations() >= 1 and fake.fakecuda_bytes_copied() == 2 * MiB
        for i, p in enumerate(kept):
            assert ctypes.string_at(p, MiB) == bytes([17 + i]) * MiB, f"block {i} changed"
        ctypes.memset(kept[0], 99, MiB)  # same physical page as kept[1], other half
        assert ctypes.string_at(kept[1], MiB) == bytes([18]) * MiB
        more = [alloc(MiB) for _ in range(6)]
        for j, p in enumerate(more):
            ctypes.memset(p, 50 + j, MiB)
        expect = [99, 18, 19, 20]
        for p, v in zip(kept, expect):
            assert ctypes.string_at(p, MiB) == bytes([v]) * MiB, "a new block overlaps a shared page"
        for j, p in enumerate(more):
            assert ctypes.string_at(p, MiB) == bytes([50 + j]) * MiB
        free(kept[0])  # the pair (0, 1) ends; kept[1] keeps its bytes
        assert ctypes.string_at(kept[1], MiB) == bytes([18]) * MiB
        for p in kept[1:] + more:
            free(p)
        assert stats()["allocated_bytes.all.current"] == 0
        assert lib.pymemplan_empty_cache(0) == 0
        assert fake.fakecuda_bytes_in_use(0) == 0 and fake.fakecuda_live_mappings() == 0
        assert fake.fakecuda_live_handles(0) == 0
    """, policy="pymemplan-vmm")


# --- Work queued on streams (fakecuda_launch): nothing touches memory a stream may still use ---

HAZARDS = """
fake.fakecuda_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
fake.fakecuda_hazards.restype = ctypes.c_longlong
fake.fakecuda_last_hazard.restype = ctypes.c_char_p

def launch(stream, p, n):
    # A kernel using the block on its stream: the fake counts a hazard where memory is not
    # mapped, or another stream's queued work may still use it.
    assert fake.fakecuda_launch(stream, p, n) == 0, fake.fakecuda_last_hazard().decode()
"""


def test_the_fake_driver_sees_memory_used_before_queued_work_is_done():
    # The detector the next test relies on, shown to fire: a block used on a second stream
    # while the first stream's kernel is queued, and pages unmapped under queued work.
    ok(HAZARDS + textwrap.dedent("""
        fake.fakecuda_set_manual_events(1)
        s1, s2 = ctypes.c_void_p(0x10), ctypes.c_void_p(0x20)
        p = alloc(4 * MiB, s1)
        launch(s1, p, 4 * MiB)
        assert fake.fakecuda_launch(s2, p + MiB, MiB) == 1
        assert b"launch on" in fake.fakecuda_last_hazard()
        fake.fakecuda_complete_stream(s1)
        launch(s2, p, MiB)                      # s1 is done: no hazard
        fake.fakecuda_complete_stream(s2)
        assert fake.fakecuda_launch(None, p + 8 * MiB, MiB) == 1   # past the mapped pages
        # A freed block's pages, unmapped by hand while its stream's kernel is queued: what
        # the allocator must never do.
        q = alloc(8 * MiB, s1)
        launch(s1, q, 8 * MiB)
        fake.cuMemUnmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        hazards = fake.fakecuda_hazards()
        assert fake.cuMemUnmap(q, 2 * MiB) == 0
        assert fake.fakecuda_hazards() == hazards + 1
        assert b"cuMemUnmap" in fake.fakecuda_last_hazard()
    """), policy="pymemplan-vmm")


STREAM_PROGRAM = """
import random
rng = random.Random(SEED)
fake.fakecuda_set_manual_events(1)   # queued work completes only when the test says so
streams = [ctypes.c_void_p(0x10), ctypes.c_void_p(0x20), ctypes.c_void_p(0x30)]
sizes = [512, 4096, 100 * 1024, MiB - 512, 3 * MiB + 4096, 6 * MiB, 12 * MiB]

def fill(p, n, byte):
    ctypes.memset(p, byte, min(n, 64 * 1024))
    if n > 64 * 1024:
        ctypes.memset(p + n - 64 * 1024, byte, 64 * 1024)

def intact(p, n, byte):
    head = ctypes.string_at(p, min(n, 64 * 1024))
    tail = ctypes.string_at(p + n - min(n, 64 * 1024), min(n, 64 * 1024))
    return head == tail[:0] + bytes([byte]) * len(head) and tail == bytes([byte]) * len(tail)

# One step's program, made once and run STEPS times, so that plans find it and arm; some
# blocks of the first step live to the end (parameters, optimizer state).
program, opened = [], []
for i in range(220):
    if opened and rng.random() < 0.45:
        program.append(("free", opened.pop(rng.randrange(len(opened)))))
    else:
        program.append(("alloc", i, rng.choice(sizes), rng.randrange(3)))
        opened.append(i)
program += [("free", i) for i in opened]

live, kept, byte = {}, [], 0
for step in range(STEPS):
    for op in program:
        if op[0] == "alloc":
            _, name, n, s = op
            if step > 0 and name % 23 == 0:
                continue                       # made once, in the first step only
            p = alloc(n, streams[s])
            if not p:
                continue                       # out of memory under the limit: allowed
            byte = byte % 251 + 1
            launch(streams[s], p, n)
            fill(p, n, byte)
            other = rng.randrange(3) if rng.random() < 0.15 else s
            if other != s:
                # Also used on another stream. The program orders that stream after this one
                # (wait_stream) and back; the fake has no waits between streams, so the
                # stream waited for completes instead.
                fake.fakecuda_complete_stream(streams[s])
                lib.pymemplan_record_stream(p, streams[other])
                launch(streams[other], p, n)
            live[name] = (p, n, s, byte, other)
        elif op[1] in live:
            p, n, s, b, other = live.pop(op[1])
            if step == 0 and op[1] % 23 == 0:
                kept.append((p, n, s, b))
                continue
            assert intact(p, n, b), f"block {op[1]} of step {step} was overwritten"
            if other != s:
                fake.fakecuda_complete_stream(streams[other])
            launch(streams[s], p, n)           # its last kernel, queued as it is freed
            free(p, streams[s])
        if rng.random() < 0.05:
            fake.fakecuda_complete_stream(rng.choice(streams))
    for p, n, s, b in kept:
        assert intact(p, n, b), "a long-lived block was overwritten"
for p, n, s, b, *_ in kept + list(live.values()):
    free(p, streams[s])
fake.fakecuda_complete_all()
assert lib.pymemplan_empty_cache(0) == 0
assert fake.fakecuda_hazards() == 0, fake.fakecuda_last_hazard().decode()
assert stats()["allocated_bytes.all.current"] == 0
print(stats()["num_alloc_retries"], stats()["num_ooms"], fake.fakecuda_unmap_calls())
"""


@pytest.mark.parametrize("policy,config", [
    ("pymemplan", ""), ("pymemplan-vmm", ""), ("pymemplan-planned", ""),
    ("pymemplan-vmm", "cross_stream_reuse:False"), ("torch", ""),
    ("torch", "expandable_segments:True"), ("gmlake", "")])
def test_no_memory_is_touched_while_a_stream_may_still_use_it(policy, config):
    """Three streams whose kernels complete only when the test says, under a memory limit
    that makes the pool reclaim and unmap what is cached: every block handed out is free of
    other streams' queued work, no page is unmapped or copied under queued work, and every
    block keeps its bytes. The real code path over the fake driver, for each policy."""
    fake_unmaps = []
    for seed in (1, 2):
        out = ok(HAZARDS + f"SEED, STEPS = {seed}, 5\n"
                 "assert lib.pymemplan_set_memory_limit(0, 96 * MiB) == 0, err()\n"
                 + STREAM_PROGRAM,
                 policy=policy, config=",".join(x for x in ("oom_action:null", config) if x))
        fake_unmaps.append(out.split())
    if policy.startswith("pymemplan-") or policy == "gmlake" or "expandable" in config:
        # The limit makes the virtual-memory policies give pages back under queued work.
        assert any(int(u[2]) > 0 for u in fake_unmaps), fake_unmaps


BASE_ALLOC = """
lib.pymemplan_base_alloc.restype = ctypes.c_void_p
lib.pymemplan_base_alloc.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
"""


def test_cuda_ipc_gets_the_segment_that_holds_a_block():
    # PyTorch's getBaseAllocation: a CUDA tensor sent to another process goes as the device
    # allocation holding it (cudaIpcGetMemHandle exports whole allocations) and an offset.
    # Without the hook PyTorch takes the block for the allocation, offset 0: the receiver would
    # open the segment and read its first bytes instead.
    ok(BASE_ALLOC + textwrap.dedent("""
        a, b = alloc(3 * MiB), alloc(3 * MiB)   # one medium segment holds both
        seg, = [s for s in snapshot()["segments"]
                if s["address"] <= b < s["address"] + s["total_size"]]
        assert seg["address"] <= a < seg["address"] + seg["total_size"] and b != seg["address"]
        size = ctypes.c_size_t()
        assert lib.pymemplan_base_alloc(b, ctypes.byref(size)) == seg["address"]
        assert size.value == seg["total_size"]
    """))


@pytest.mark.parametrize("case", ["virtual", "foreign"])
def test_cuda_ipc_of_memory_that_cannot_be_exported_fails_clearly(case):
    # Pages of virtual-memory segments are not exportable by cudaIpcGetMemHandle (PyTorch
    # refuses its expandable segments the same way); a pointer pymemplan does not own has no
    # answer. Either throws, which PyTorch turns into a RuntimeError; from ctypes, nothing
    # catches it and the process ends with the message.
    body = "p = alloc(3 * MiB)\nlib.pymemplan_base_alloc(p if %r == 'virtual' else 0x1000, None)\n" % case
    r = run(BASE_ALLOC + body, policy="pymemplan-vmm" if case == "virtual" else "pymemplan")
    assert r.returncode != 0
    expected = "cannot be shared between processes" if case == "virtual" else "not allocated by pymemplan"
    assert expected in r.stderr, r.stderr
