"""libfakecuda.so, the fake CUDA driver the CUDA code path is tested against, checked on its own.

The tests load a private copy of the library, so its process-wide state is separate from any
copy that other tests load through PYMEMPLAN_LIBCUDA in the same pytest process.
"""

from __future__ import annotations

import ctypes as C
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, NOT_INITIALIZED = 0, 1, 2, 3
NO_DEVICE, INVALID_DEVICE, INVALID_CONTEXT = 100, 101, 201
INVALID_HANDLE, NOT_FOUND, NOT_READY = 400, 500, 600


def _installed_library() -> Path | None:
    try:
        import pymemplan
    except ImportError:
        return None
    # An editable install puts built files next to the sources' package path entries.
    for entry in list(getattr(pymemplan, "__path__", [])) + [Path(pymemplan.__file__).parent]:
        candidate = Path(entry) / "_testing" / "libfakecuda.so"
        if candidate.is_file():
            return candidate
    return None


@pytest.fixture(scope="session")
def libfakecuda_path(tmp_path_factory) -> Path:
    """The installed library, else one built from this checkout with CMake."""
    found = _installed_library()
    if found is not None and found.stat().st_mtime >= (ROOT / "csrc/testing/fake_cuda.cpp").stat().st_mtime:
        return found
    if shutil.which("cmake") is None:
        if found is not None:
            return found
        pytest.skip("libfakecuda.so is not installed and cmake is not available to build it")
    build = tmp_path_factory.mktemp("fakecuda-build")
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DPYMEMPLAN_PYTHON=OFF",
                    "-DCMAKE_BUILD_TYPE=Release"], check=True, capture_output=True)
    r = subprocess.run(["cmake", "--build", str(build), "-j2", "--target", "fakecuda"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return build / "libfakecuda.so"


class MemLocation(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class MemAllocationProp(C.Structure):  # CUmemAllocationProp
    class _Flags(C.Structure):
        _fields_ = [("compressionType", C.c_ubyte), ("gpuDirectRDMACapable", C.c_ubyte),
                    ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]

    _fields_ = [("type", C.c_int), ("requestedHandleTypes", C.c_int), ("location", MemLocation),
                ("win32HandleMetaData", C.c_void_p), ("allocFlags", _Flags)]


class MemAccessDesc(C.Structure):  # CUmemAccessDesc
    _fields_ = [("location", MemLocation), ("flags", C.c_int)]


def _prop(device: int = 0) -> MemAllocationProp:
    p = MemAllocationProp()
    p.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = 1  # CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = device
    return p


def _rw(device: int = 0) -> MemAccessDesc:
    d = MemAccessDesc()
    d.location.type = 1
    d.location.id = device
    d.flags = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return d


_SIGNATURES = {
    "cuInit": [C.c_uint],
    "cuDriverGetVersion": [C.POINTER(C.c_int)],
    "cuDeviceGetCount": [C.POINTER(C.c_int)],
    "cuDeviceGet": [C.POINTER(C.c_int), C.c_int],
    "cuDeviceTotalMem_v2": [C.POINTER(C.c_size_t), C.c_int],
    "cuDevicePrimaryCtxRetain": [C.POINTER(C.c_void_p), C.c_int],
    "cuDevicePrimaryCtxRelease_v2": [C.c_int],
    "cuCtxGetCurrent": [C.POINTER(C.c_void_p)],
    "cuCtxSetCurrent": [C.c_void_p],
    "cuCtxGetDevice": [C.POINTER(C.c_int)],
    "cuMemAlloc_v2": [C.POINTER(C.c_ulonglong), C.c_size_t],
    "cuMemFree_v2": [C.c_ulonglong],
    "cuMemGetInfo_v2": [C.POINTER(C.c_size_t), C.POINTER(C.c_size_t)],
    "cuEventCreate": [C.POINTER(C.c_void_p), C.c_uint],
    "cuEventDestroy_v2": [C.c_void_p],
    "cuEventRecord": [C.c_void_p, C.c_void_p],
    "cuEventQuery": [C.c_void_p],
    "cuEventSynchronize": [C.c_void_p],
    "cuStreamSynchronize": [C.c_void_p],
    "cuGetErrorName": [C.c_int, C.POINTER(C.c_char_p)],
    "cuGetErrorString": [C.c_int, C.POINTER(C.c_char_p)],
    "cuGetProcAddress_v2": [C.c_char_p, C.POINTER(C.c_void_p), C.c_int, C.c_ulonglong,
                            C.POINTER(C.c_int)],
    "cuGetProcAddress": [C.c_char_p, C.POINTER(C.c_void_p), C.c_int, C.c_ulonglong],
    "cuMemGetAllocationGranularity": [C.POINTER(C.c_size_t), C.c_void_p, C.c_int],
    "cuMemAddressReserve": [C.POINTER(C.c_ulonglong), C.c_size_t, C.c_size_t, C.c_ulonglong,
                            C.c_ulonglong],
    "cuMemAddressFree": [C.c_ulonglong, C.c_size_t],
    "cuMemCreate": [C.POINTER(C.c_ulonglong), C.c_size_t, C.c_void_p, C.c_ulonglong],
    "cuMemRelease": [C.c_ulonglong],
    "cuMemMap": [C.c_ulonglong, C.c_size_t, C.c_size_t, C.c_ulonglong, C.c_ulonglong],
    "cuMemUnmap": [C.c_ulonglong, C.c_size_t],
    "cuMemSetAccess": [C.c_ulonglong, C.c_size_t, C.c_void_p, C.c_size_t],
}

_CONTROL = {
    "fakecuda_reset": ([], None),
    "fakecuda_set_device_count": ([C.c_int], None),
    "fakecuda_set_capacity": ([C.c_size_t], None),
    "fakecuda_fail_alloc_at": ([C.c_int], None),
    "fakecuda_fail_alloc_error": ([C.c_int], None),
    "fakecuda_fail_create_at": ([C.c_int], None),
    "fakecuda_set_event_delay": ([C.c_int], None),
    "fakecuda_set_manual_events": ([C.c_int], None),
    "fakecuda_complete_stream": ([C.c_void_p], None),
    "fakecuda_complete_all": ([], None),
    "fakecuda_bytes_in_use": ([C.c_int], C.c_size_t),
    "fakecuda_live_allocations": ([C.c_int], C.c_int),
    "fakecuda_num_allocs": ([], C.c_longlong),
    "fakecuda_num_frees": ([], C.c_longlong),
    "fakecuda_live_events": ([], C.c_int),
    "fakecuda_pending_events": ([], C.c_int),
    "fakecuda_live_handles": ([C.c_int], C.c_int),
    "fakecuda_live_mappings": ([], C.c_int),
    "fakecuda_live_reservations": ([], C.c_int),
    "fakecuda_primary_ctx_refcount": ([C.c_int], C.c_int),
    "fakecuda_initialized": ([], C.c_int),
}


class Fake:
    """ctypes bindings with small helpers that return values and assert on errors."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = C.CDLL(str(path))
        for name, args in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, C.c_int
        for name, (args, res) in _CONTROL.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, res

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def init(self):
        assert self.lib.cuInit(0) == SUCCESS

    def ctx(self, device: int = 0) -> int:
        c = C.c_void_p()
        assert self.lib.cuDevicePrimaryCtxRetain(C.byref(c), device) == SUCCESS
        assert self.lib.cuCtxSetCurrent(c) == SUCCESS
        return c.value

    def alloc(self, nbytes: int) -> tuple[int, int]:
        p = C.c_ulonglong()
        r = self.lib.cuMemAlloc_v2(C.byref(p), nbytes)
        return r, p.value

    def event(self) -> int:
        e = C.c_void_p()
        assert self.lib.cuEventCreate(C.byref(e), 0x2) == SUCCESS
        return e.value

    def create(self, nbytes: int, device: int = 0) -> tuple[int, int]:
        h = C.c_ulonglong()
        p = _prop(device)
        r = self.lib.cuMemCreate(C.byref(h), nbytes, C.byref(p), 0)
        return r, h.value

    def reserve(self, nbytes: int) -> int:
        p = C.c_ulonglong()
        assert self.lib.cuMemAddressReserve(C.byref(p), nbytes, 0, 0, 0) == SUCCESS
        return p.value

    def set_rw(self, ptr: int, nbytes: int) -> int:
        d = _rw()
        return self.lib.cuMemSetAccess(ptr, nbytes, C.byref(d), 1)

    def mem_info(self) -> tuple[int, int]:
        free, total = C.c_size_t(), C.c_size_t()
        assert self.lib.cuMemGetInfo_v2(C.byref(free), C.byref(total)) == SUCCESS
        return free.value, total.value


@pytest.fixture(scope="module")
def private_copy(libfakecuda_path, tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("fakecuda") / "libfakecuda.so"
    shutil.copyfile(libfakecuda_path, copy)
    return copy


@pytest.fixture(scope="module")
def _loaded(private_copy) -> Fake:
    return Fake(private_copy)


@pytest.fixture
def fake(_loaded) -> Fake:
    _loaded.fakecuda_reset()
    yield _loaded
    _loaded.fakecuda_reset()


def test_init_is_required(fake):
    count = C.c_int(-1)
    assert fake.fakecuda_initialized() == 0
    assert fake.cuDeviceGetCount(C.byref(count)) == NOT_INITIALIZED
    r, _ = fake.alloc(4096)
    assert r == NOT_INITIALIZED
    assert fake.cuCtxGetCurrent(C.byref(C.c_void_p())) == NOT_INITIALIZED
    # These work before cuInit, as in the driver.
    version = C.c_int()
    assert fake.cuDriverGetVersion(C.byref(version)) == SUCCESS and version.value == 12040
    name = C.c_char_p()
    assert fake.cuGetErrorName(NOT_INITIALIZED, C.byref(name)) == SUCCESS
    fn = C.c_void_p()
    assert fake.cuGetProcAddress(b"cuInit", C.byref(fn), 12000, 0) == SUCCESS and fn.value
    assert fake.cuInit(1) == INVALID_VALUE
    fake.init()
    fake.init()  # idempotent
    assert fake.fakecuda_initialized() == 1
    assert fake.cuDeviceGetCount(C.byref(count)) == SUCCESS and count.value == 1


def test_devices_and_contexts(fake):
    fake.fakecuda_set_device_count(2)
    fake.fakecuda_set_capacity(32 * MiB)
    fake.init()
    dev, total = C.c_int(), C.c_size_t()
    assert fake.cuDeviceGet(C.byref(dev), 1) == SUCCESS and dev.value == 1
    assert fake.cuDeviceGet(C.byref(dev), 2) == INVALID_DEVICE
    assert fake.cuDeviceTotalMem_v2(C.byref(total), 1) == SUCCESS and total.value == 32 * MiB
    assert fake.cuCtxGetDevice(C.byref(dev)) == INVALID_CONTEXT  # no current context yet
    cur = C.c_void_p(1)
    assert fake.cuCtxGetCurrent(C.byref(cur)) == SUCCESS and cur.value is None

    c0, c1 = C.c_void_p(), C.c_void_p()
    assert fake.cuDevicePrimaryCtxRetain(C.byref(c0), 0) == SUCCESS
    assert fake.cuDevicePrimaryCtxRetain(C.byref(c1), 1) == SUCCESS
    again = C.c_void_p()
    assert fake.cuDevicePrimaryCtxRetain(C.byref(again), 1) == SUCCESS
    assert c0.value and c1.value and c0.value != c1.value and again.value == c1.value
    assert fake.fakecuda_primary_ctx_refcount(1) == 2
    assert fake.cuDevicePrimaryCtxRelease_v2(1) == SUCCESS
    assert fake.fakecuda_primary_ctx_refcount(1) == 1

    assert fake.cuCtxSetCurrent(c1) == SUCCESS
    assert fake.cuCtxGetDevice(C.byref(dev)) == SUCCESS and dev.value == 1
    assert fake.cuCtxGetCurrent(C.byref(cur)) == SUCCESS and cur.value == c1.value
    assert fake.cuCtxSetCurrent(C.c_void_p(c1.value + 8)) == INVALID_CONTEXT

    seen = {}

    def other_thread():  # the current context is per thread
        c = C.c_void_p(1)
        seen["rc"] = fake.cuCtxGetCurrent(C.byref(c))
        seen["ctx"] = c.value

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert seen == {"rc": SUCCESS, "ctx": None}

    assert fake.cuCtxSetCurrent(None) == SUCCESS
    assert fake.cuCtxGetDevice(C.byref(dev)) == INVALID_CONTEXT
    assert fake.cuDevicePrimaryCtxRelease_v2(0) == SUCCESS
    assert fake.cuDevicePrimaryCtxRelease_v2(0) == INVALID_CONTEXT  # not retained any more


def test_alloc_free_and_errors(fake):
    fake.fakecuda_set_capacity(32 * MiB)
    fake.init()
    r, _ = fake.alloc(4096)
    assert r == INVALID_CONTEXT
    fake.ctx(0)
    r, _ = fake.alloc(0)
    assert r == INVALID_VALUE
    r, p = fake.alloc(3 * MiB + 1)
    assert r == SUCCESS and p % (2 * MiB) == 0
    C.memset(p, 0xAB, 3 * MiB + 1)  # the memory is real
    assert C.string_at(p + 3 * MiB - 2, 3) == b"\xab\xab\xab"
    r, q = fake.alloc(512)
    assert r == SUCCESS and q != p and q % 512 == 0
    assert fake.fakecuda_bytes_in_use(0) == 3 * MiB + 513
    assert fake.fakecuda_live_allocations(0) == 2
    assert fake.mem_info() == (32 * MiB - (3 * MiB + 513), 32 * MiB)

    assert fake.cuMemFree_v2(p) == SUCCESS
    assert fake.cuMemFree_v2(p) == INVALID_VALUE  # double free
    assert fake.cuMemFree_v2(q + 8) == INVALID_VALUE  # not a pointer we handed out
    assert fake.cuMemFree_v2(q) == SUCCESS
    assert fake.fakecuda_bytes_in_use(0) == 0 and fake.fakecuda_live_allocations(0) == 0
    assert (fake.fakecuda_num_allocs(), fake.fakecuda_num_frees()) == (2, 2)


def test_capacity_is_per_device_and_refuses_with_oom(fake):
    fake.fakecuda_set_device_count(2)
    fake.fakecuda_set_capacity(8 * MiB)
    fake.init()
    fake.ctx(0)
    r, a = fake.alloc(6 * MiB)
    assert r == SUCCESS
    r, _ = fake.alloc(3 * MiB)
    assert r == OUT_OF_MEMORY
    r, b = fake.alloc(2 * MiB)  # exactly fills the device
    assert r == SUCCESS and fake.mem_info()[0] == 0
    fake.ctx(1)
    r, c = fake.alloc(8 * MiB)  # device 1 has its own budget
    assert r == SUCCESS
    assert fake.fakecuda_bytes_in_use(1) == 8 * MiB and fake.fakecuda_live_allocations(1) == 1
    for ptr in (a, b, c):
        assert fake.cuMemFree_v2(ptr) == SUCCESS
    assert fake.fakecuda_num_allocs() == 3  # the refused one is not counted


def test_fail_alloc_at(fake):
    fake.init()
    fake.ctx(0)
    fake.fakecuda_fail_alloc_at(3)
    results = [fake.alloc(4096)[0] for _ in range(4)]
    assert results == [SUCCESS, SUCCESS, OUT_OF_MEMORY, SUCCESS]  # once, then allocations go on
    fake.fakecuda_fail_alloc_error(INVALID_VALUE)  # a non-OOM driver failure
    fake.fakecuda_fail_alloc_at(1)
    assert fake.alloc(4096)[0] == INVALID_VALUE
    assert fake.alloc(4096)[0] == SUCCESS
    fake.fakecuda_fail_alloc_at(2)
    fake.fakecuda_fail_alloc_at(0)  # disarmed
    assert [fake.alloc(4096)[0] for _ in range(3)] == [SUCCESS] * 3
    assert fake.fakecuda_num_allocs() == 7 and fake.fakecuda_live_allocations(0) == 7


def test_event_delay(fake):
    fake.init()
    fake.ctx(0)
    e = fake.event()
    assert fake.fakecuda_live_events() == 1
    assert fake.cuEventQuery(e) == SUCCESS  # never recorded: complete
    assert fake.cuEventRecord(e, None) == SUCCESS
    assert fake.cuEventQuery(e) == SUCCESS and fake.fakecuda_pending_events() == 0  # delay 0
    fake.fakecuda_set_event_delay(2)
    assert fake.cuEventRecord(e, None) == SUCCESS
    assert fake.fakecuda_pending_events() == 1
    assert [fake.cuEventQuery(e) for _ in range(4)] == [NOT_READY, NOT_READY, SUCCESS, SUCCESS]
    assert fake.fakecuda_pending_events() == 0
    assert fake.cuEventRecord(e, None) == SUCCESS
    assert fake.cuEventSynchronize(e) == SUCCESS  # completes it
    assert fake.cuEventQuery(e) == SUCCESS
    assert fake.cuEventDestroy_v2(e) == SUCCESS
    assert fake.cuEventDestroy_v2(e) == INVALID_HANDLE
    assert fake.cuEventQuery(e) == INVALID_HANDLE
    assert fake.fakecuda_live_events() == 0
    bad = C.c_void_p()
    assert fake.cuEventCreate(C.byref(bad), 0x100) == INVALID_VALUE


def test_manual_events_and_stream_synchronize(fake):
    fake.init()
    fake.ctx(0)
    fake.fakecuda_set_manual_events(1)
    s1, s2 = C.c_void_p(0x1000), C.c_void_p(0x2000)
    a, b, c, d = (fake.event() for _ in range(4))
    assert fake.cuEventRecord(a, s1) == SUCCESS
    assert fake.cuEventRecord(b, s1) == SUCCESS
    assert fake.cuEventRecord(c, s2) == SUCCESS
    assert fake.cuEventRecord(d, None) == SUCCESS
    assert all(fake.cuEventQuery(x) == NOT_READY for x in (a, b, c, d) for _ in range(5))
    assert fake.fakecuda_pending_events() == 4
    fake.fakecuda_complete_stream(s1)
    assert [fake.cuEventQuery(x) for x in (a, b, c, d)] == [SUCCESS, SUCCESS, NOT_READY, NOT_READY]
    assert fake.cuStreamSynchronize(s2) == SUCCESS
    assert [fake.cuEventQuery(x) for x in (c, d)] == [SUCCESS, NOT_READY]
    assert fake.cuEventRecord(a, s1) == SUCCESS  # recorded again: pending again
    assert fake.fakecuda_pending_events() == 2
    fake.fakecuda_complete_all()
    assert fake.fakecuda_pending_events() == 0
    assert all(fake.cuEventQuery(x) == SUCCESS for x in (a, b, c, d))
    fake.fakecuda_set_manual_events(0)
    assert fake.cuEventRecord(a, s1) == SUCCESS and fake.cuEventQuery(a) == SUCCESS
    for x in (a, b, c, d):
        assert fake.cuEventDestroy_v2(x) == SUCCESS


def test_get_proc_address_maps_base_names_to_versions(fake):
    def addr(name: str) -> int:
        return C.cast(getattr(fake.lib, name), C.c_void_p).value

    versioned = {
        "cuMemAlloc": "cuMemAlloc_v2", "cuMemFree": "cuMemFree_v2",
        "cuMemGetInfo": "cuMemGetInfo_v2", "cuDeviceTotalMem": "cuDeviceTotalMem_v2",
        "cuEventDestroy": "cuEventDestroy_v2",
        "cuDevicePrimaryCtxRelease": "cuDevicePrimaryCtxRelease_v2",
        "cuGetProcAddress": "cuGetProcAddress_v2",
    }
    plain = ["cuInit", "cuDeviceGet", "cuDeviceGetCount", "cuDevicePrimaryCtxRetain",
             "cuCtxGetCurrent", "cuCtxSetCurrent", "cuCtxGetDevice", "cuEventCreate",
             "cuEventRecord", "cuEventQuery", "cuEventSynchronize", "cuStreamSynchronize",
             "cuGetErrorName", "cuGetErrorString", "cuDriverGetVersion", "cuMemCreate",
             "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemAddressReserve",
             "cuMemAddressFree", "cuMemGetAllocationGranularity"]
    cases = dict(versioned) | {n: n for n in plain} | {v: v for v in versioned.values()}
    for asked, implementation in cases.items():
        fn, status = C.c_void_p(), C.c_int(-1)
        assert fake.cuGetProcAddress_v2(asked.encode(), C.byref(fn), 12040, 0,
                                        C.byref(status)) == SUCCESS, asked
        assert fn.value == addr(implementation) and status.value == 0, asked
        fn2 = C.c_void_p()
        assert fake.cuGetProcAddress(asked.encode(), C.byref(fn2), 12000, 0) == SUCCESS
        assert fn2.value == fn.value
    fn, status = C.c_void_p(1), C.c_int(-1)
    assert fake.cuGetProcAddress_v2(b"cuLaunchKernel", C.byref(fn), 12040, 0,
                                    C.byref(status)) == NOT_FOUND
    assert fn.value is None and status.value == 1
    assert fake.cuGetProcAddress(b"fakecuda_reset", C.byref(fn), 12000, 0) == NOT_FOUND
    # What the resolver gets works: cuMemAlloc through the table, on an initialised driver.
    fake.init()
    fake.ctx(0)
    fn = C.c_void_p()
    assert fake.cuGetProcAddress(b"cuMemAlloc", C.byref(fn), 12000, 0) == SUCCESS
    mem_alloc = C.CFUNCTYPE(C.c_int, C.POINTER(C.c_ulonglong), C.c_size_t)(fn.value)
    p = C.c_ulonglong()
    assert mem_alloc(C.byref(p), 1024) == SUCCESS and fake.cuMemFree_v2(p.value) == SUCCESS


def test_error_names_and_strings(fake):
    def name(code):
        s = C.c_char_p()
        return fake.cuGetErrorName(code, C.byref(s)), s.value

    def text(code):
        s = C.c_char_p()
        return fake.cuGetErrorString(code, C.byref(s)), s.value

    assert name(SUCCESS) == (SUCCESS, b"CUDA_SUCCESS")
    assert name(OUT_OF_MEMORY) == (SUCCESS, b"CUDA_ERROR_OUT_OF_MEMORY")
    assert name(INVALID_VALUE) == (SUCCESS, b"CUDA_ERROR_INVALID_VALUE")
    assert name(NOT_INITIALIZED) == (SUCCESS, b"CUDA_ERROR_NOT_INITIALIZED")
    assert name(INVALID_CONTEXT) == (SUCCESS, b"CUDA_ERROR_INVALID_CONTEXT")
    assert name(INVALID_DEVICE) == (SUCCESS, b"CUDA_ERROR_INVALID_DEVICE")
    assert name(INVALID_HANDLE) == (SUCCESS, b"CUDA_ERROR_INVALID_HANDLE")
    assert name(NOT_FOUND) == (SUCCESS, b"CUDA_ERROR_NOT_FOUND")
    assert name(NOT_READY) == (SUCCESS, b"CUDA_ERROR_NOT_READY")
    assert text(OUT_OF_MEMORY) == (SUCCESS, b"out of memory")
    assert text(NOT_READY) == (SUCCESS, b"device not ready")
    assert name(12345) == (INVALID_VALUE, None)
    assert text(12345) == (INVALID_VALUE, None)


def test_vmm_round_trip_and_aliasing(fake):
    fake.fakecuda_set_capacity(64 * MiB)
    fake.init()
    fake.ctx(0)
    g = C.c_size_t()
    prop = _prop()
    assert fake.cuMemGetAllocationGranularity(C.byref(g), C.byref(prop), 0) == SUCCESS
    assert g.value == 2 * MiB
    size = 4 * MiB
    r1, r2 = fake.reserve(size), fake.reserve(8 * MiB)
    assert r1 % (2 * MiB) == 0 and r2 % (2 * MiB) == 0 and fake.fakecuda_live_reservations() == 2
    rc, h = fake.create(size)
    assert rc == SUCCESS and fake.fakecuda_bytes_in_use(0) == size
    assert fake.fakecuda_live_handles(0) == 1

    assert fake.cuMemMap(r1, size, 0, h, 0) == SUCCESS
    assert fake.cuMemMap(r2 + 2 * MiB, size, 0, h, 0) == SUCCESS  # the same pages, twice
    assert fake.cuMemMap(r1, size, 0, h, 0) == INVALID_VALUE  # already mapped there
    assert fake.cuMemMap(r1 + 1024, 2 * MiB, 0, h, 0) == INVALID_VALUE  # not aligned
    assert fake.cuMemMap(r2, 2 * MiB, 2 * MiB, h, 0) == INVALID_VALUE  # offset must be 0
    assert fake.cuMemMap(r2 + 6 * MiB, size, 0, h, 0) == INVALID_VALUE  # beyond the reservation
    assert fake.cuMemMap(r2, 2 * MiB, 0, h + 99, 0) == INVALID_HANDLE
    assert fake.fakecuda_live_mappings() == 2
    assert fake.cuMemSetAccess(r2, 4 * MiB, C.byref(_rw()), 1) == INVALID_VALUE  # r2 head unmapped
    assert fake.set_rw(r1, size) == SUCCESS
    assert fake.set_rw(r2 + 2 * MiB, size) == SUCCESS

    C.memset(r1, 0x5A, size)  # writing through one mapping ...
    assert C.string_at(r2 + 2 * MiB, 16) == b"\x5a" * 16  # ... shows through the other
    C.memmove(r2 + 2 * MiB + size - 3, b"end", 3)
    assert C.string_at(r1 + size - 3, 3) == b"end"

    assert fake.cuMemAddressFree(r1, size) == INVALID_VALUE  # still mapped: unmap first
    assert fake.cuMemUnmap(r1, 2 * MiB) == INVALID_VALUE  # only whole mappings
    assert fake.cuMemUnmap(r1, size) == SUCCESS
    assert fake.cuMemUnmap(r1, size) == INVALID_VALUE
    assert fake.cuMemRelease(h) == SUCCESS  # still mapped at r2: the memory lives on
    assert fake.cuMemRelease(h) == INVALID_HANDLE
    assert fake.cuMemMap(r1, size, 0, h, 0) == INVALID_HANDLE
    assert C.string_at(r2 + 2 * MiB, 4) == b"\x5a" * 4
    assert fake.fakecuda_bytes_in_use(0) == size and fake.fakecuda_live_handles(0) == 1
    assert fake.cuMemUnmap(r2 + 2 * MiB, size) == SUCCESS
    assert fake.fakecuda_bytes_in_use(0) == 0 and fake.fakecuda_live_handles(0) == 0
    assert fake.cuMemAddressFree(r1, size) == SUCCESS
    assert fake.cuMemAddressFree(r2, 4 * MiB) == INVALID_VALUE  # not the reserved size
    assert fake.cuMemAddressFree(r2, 8 * MiB) == SUCCESS
    assert fake.fakecuda_live_reservations() == 0 and fake.fakecuda_live_mappings() == 0


def test_vmm_unmap_spans_consecutive_mappings(fake):
    fake.fakecuda_set_capacity(64 * MiB)
    fake.init()
    base = fake.reserve(8 * MiB)
    handles = [fake.create(2 * MiB)[1] for _ in range(4)]
    for i, h in enumerate(handles):
        assert fake.cuMemMap(base + i * 2 * MiB, 2 * MiB, 0, h, 0) == SUCCESS
        assert fake.cuMemRelease(h) == SUCCESS
    assert fake.set_rw(base, 8 * MiB) == SUCCESS  # one call over four mappings
    C.memset(base, 1, 8 * MiB)
    assert fake.fakecuda_bytes_in_use(0) == 8 * MiB
    assert fake.cuMemUnmap(base + 2 * MiB, 4 * MiB) == SUCCESS  # the middle two
    assert fake.fakecuda_bytes_in_use(0) == 4 * MiB and fake.fakecuda_live_mappings() == 2
    assert fake.cuMemUnmap(base, 8 * MiB) == INVALID_VALUE  # has a hole now
    assert fake.cuMemUnmap(base, 2 * MiB) == SUCCESS
    assert fake.cuMemUnmap(base + 6 * MiB, 2 * MiB) == SUCCESS
    assert fake.fakecuda_live_handles(0) == 0 and fake.fakecuda_bytes_in_use(0) == 0
    assert fake.cuMemAddressFree(base, 8 * MiB) == SUCCESS


def test_vmm_create_counts_against_capacity(fake):
    fake.fakecuda_set_device_count(2)
    fake.fakecuda_set_capacity(8 * MiB)
    fake.init()
    fake.ctx(0)
    rc, h1 = fake.create(4 * MiB)
    assert rc == SUCCESS
    assert fake.mem_info() == (4 * MiB, 8 * MiB)
    rc, p = fake.alloc(2 * MiB)
    assert rc == SUCCESS
    assert fake.create(4 * MiB)[0] == OUT_OF_MEMORY  # 6 of 8 MiB used
    rc, h2 = fake.create(2 * MiB)
    assert rc == SUCCESS and fake.mem_info()[0] == 0
    assert fake.alloc(1)[0] == OUT_OF_MEMORY
    rc, h3 = fake.create(8 * MiB, device=1)  # the device comes from prop.location.id
    assert rc == SUCCESS and fake.fakecuda_bytes_in_use(1) == 8 * MiB
    assert fake.create(2 * MiB, device=2)[0] == INVALID_DEVICE
    assert fake.create(3 * MiB)[0] == INVALID_VALUE  # not a multiple of the granularity
    for h in (h1, h2, h3):
        assert fake.cuMemRelease(h) == SUCCESS
    assert fake.cuMemFree_v2(p) == SUCCESS
    assert fake.mem_info() == (8 * MiB, 8 * MiB) and fake.fakecuda_bytes_in_use(1) == 0
    fake.fakecuda_fail_create_at(2)
    rc, h = fake.create(2 * MiB)
    assert rc == SUCCESS and fake.create(2 * MiB)[0] == OUT_OF_MEMORY
    assert fake.cuMemRelease(h) == SUCCESS


def test_reset_forgets_everything(fake):
    fake.fakecuda_set_capacity(32 * MiB)
    fake.fakecuda_set_manual_events(1)
    fake.init()
    fake.ctx(0)
    assert fake.alloc(MiB)[0] == SUCCESS
    e = fake.event()
    assert fake.cuEventRecord(e, None) == SUCCESS
    base = fake.reserve(2 * MiB)
    assert fake.cuMemMap(base, 2 * MiB, 0, fake.create(2 * MiB)[1], 0) == SUCCESS
    fake.fakecuda_reset()
    assert fake.fakecuda_initialized() == 0
    assert fake.fakecuda_bytes_in_use(0) == 0 and fake.fakecuda_live_allocations(0) == 0
    assert fake.fakecuda_live_events() == 0 and fake.fakecuda_pending_events() == 0
    assert fake.fakecuda_live_handles(0) == 0 and fake.fakecuda_live_mappings() == 0
    assert fake.fakecuda_live_reservations() == 0
    assert (fake.fakecuda_num_allocs(), fake.fakecuda_num_frees()) == (0, 0)
    fake.init()
    cur = C.c_void_p(1)
    assert fake.cuCtxGetCurrent(C.byref(cur)) == SUCCESS and cur.value is None
    total = C.c_size_t()
    assert fake.cuDeviceTotalMem_v2(C.byref(total), 0) == SUCCESS and total.value == 16 << 30


def test_threads_allocate_concurrently(fake):
    fake.fakecuda_set_capacity(64 * MiB)
    fake.init()
    errors = []

    def worker():
        try:
            fake.ctx(0)
            for _ in range(300):
                rc, p = fake.alloc(8192)
                assert rc == SUCCESS
                C.memset(p, 7, 8192)
                assert fake.cuMemFree_v2(p) == SUCCESS
        except AssertionError as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert fake.fakecuda_num_allocs() == fake.fakecuda_num_frees() == 1200
    assert fake.fakecuda_bytes_in_use(0) == 0


_CHILD = r"""
import ctypes as C, json, sys
lib = C.CDLL(sys.argv[1])
lib.fakecuda_bytes_in_use.restype = C.c_size_t
out = {"init": lib.cuInit(0)}
if out["init"] == 0:
    n, total, ctx, p = C.c_int(), C.c_size_t(), C.c_void_p(), C.c_ulonglong()
    lib.cuDeviceGetCount(C.byref(n))
    lib.cuDeviceTotalMem_v2(C.byref(total), 0)
    lib.cuDevicePrimaryCtxRetain(C.byref(ctx), 0)
    lib.cuCtxSetCurrent(ctx)
    out["count"], out["total"] = n.value, total.value
    out["allocs"] = [lib.cuMemAlloc_v2(C.byref(p), C.c_size_t(4096)) for _ in range(3)]
    e = C.c_void_p()
    lib.cuEventCreate(C.byref(e), 0)
    lib.cuEventRecord(e, None)
    out["queries"] = [lib.cuEventQuery(e) for _ in range(3)]
    lib.fakecuda_complete_all()
    out["after_complete"] = lib.cuEventQuery(e)
print(json.dumps(out))
"""


def _child(path: Path, **env) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FAKECUDA_")}
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True,
                       env=environ | env, timeout=60)
    assert r.returncode == 0, r.stderr
    return {"stderr": r.stderr, **json.loads(r.stdout)}


def test_environment_configures_a_subprocess(private_copy):
    out = _child(private_copy, FAKECUDA_DEVICE_COUNT="3", FAKECUDA_CAPACITY="48MiB",
                 FAKECUDA_FAIL_ALLOC_AT="2", FAKECUDA_FAIL_ALLOC_ERROR="1",
                 FAKECUDA_EVENT_DELAY="1")
    assert out["init"] == SUCCESS and out["count"] == 3 and out["total"] == 48 * MiB
    assert out["allocs"] == [SUCCESS, INVALID_VALUE, SUCCESS]
    assert out["queries"] == [NOT_READY, SUCCESS, SUCCESS]
    out = _child(private_copy, FAKECUDA_MANUAL_EVENTS="1", FAKECUDA_CAPACITY="10000")
    assert out["total"] == 10000 and out["count"] == 1
    assert out["queries"] == [NOT_READY] * 3 and out["after_complete"] == SUCCESS
    assert out["allocs"] == [SUCCESS, SUCCESS, OUT_OF_MEMORY]  # 3 x 4096 > 10000
    out = _child(private_copy, FAKECUDA_CAPACITY="lots")
    assert out["init"] == INVALID_VALUE and "FAKECUDA_CAPACITY=lots" in out["stderr"]
    assert _child(private_copy, FAKECUDA_DEVICE_COUNT="0")["init"] == NO_DEVICE


_SEGV_CHILD = r"""
import ctypes as C, sys
lib = C.CDLL(sys.argv[1])
class Prop(C.Structure):
    _fields_ = [("type", C.c_int), ("handles", C.c_int), ("loc_type", C.c_int), ("loc_id", C.c_int),
                ("meta", C.c_void_p), ("flags", C.c_ulonglong)]
assert lib.cuInit(0) == 0
p, h = C.c_ulonglong(), C.c_ulonglong()
prop = Prop(1, 0, 1, 0)
assert lib.cuMemAddressReserve(C.byref(p), C.c_size_t(2 << 20), C.c_size_t(0), C.c_ulonglong(0), C.c_ulonglong(0)) == 0
assert lib.cuMemCreate(C.byref(h), C.c_size_t(2 << 20), C.byref(prop), C.c_ulonglong(0)) == 0
assert lib.cuMemMap(p, C.c_size_t(2 << 20), C.c_size_t(0), h, C.c_ulonglong(0)) == 0
print("mapped", flush=True)
C.memset(p.value, 1, 16)  # no cuMemSetAccess yet: faults, as on a GPU
print("wrote")
"""


def test_mapping_is_inaccessible_until_set_access(private_copy):
    r = subprocess.run([sys.executable, "-c", _SEGV_CHILD, str(private_copy)],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "mapped"
    assert r.returncode == -signal.SIGSEGV
