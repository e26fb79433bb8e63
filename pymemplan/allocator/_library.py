"""Finding and loading libpymemplan_alloc.so, the plugin PyTorch and CuPy allocate through.

The library is built with the package and installed next to ``pymemplan/_core*.so``. It is
loaded with ctypes once per process; ``torch.cuda.memory.CUDAPluggableAllocator`` dlopens
the same file, so both see one allocator per device.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from typing import Any, Callable

LIBRARY_NAME = "libpymemplan_alloc.so"
# The fake CUDA driver used by the tests (csrc/testing/fake_cuda.cpp), relative to the package.
FAKE_DRIVER_NAME = os.path.join("_testing", "libfakecuda.so")

_REINSTALL_HINT = (
    "It is built and installed together with the pymemplan package: reinstall pymemplan "
    "(`pip install --force-reinstall pymemplan`, or from a source checkout "
    "`pip install --no-build-isolation -e .`), and check that the build printed no error.")


class PluginError(RuntimeError):
    """A call into libpymemplan_alloc.so failed; the message is the plugin's own."""


class PluginLoadError(PluginError):
    """libpymemplan_alloc.so cannot be found or loaded."""


# Every function of csrc/plugin/pymemplan_alloc.h: name -> (restype, argtypes).
# Declaring them all makes ctypes convert arguments (a Python int to ssize_t, None to NULL)
# instead of guessing, and keeps 64-bit pointers from being truncated to int.
_c_stream = ctypes.c_void_p  # cudaStream_t
_c_buffer = ctypes.POINTER(ctypes.c_char)  # accepts ctypes.create_string_buffer(...)
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    # The CUDAPluggableAllocator interface.
    "pymemplan_alloc": (ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, _c_stream]),
    "pymemplan_free": (None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, _c_stream]),
    "pymemplan_init": (None, [ctypes.c_int]),
    "pymemplan_reset": (None, []),
    "pymemplan_memory_fraction": (None, [ctypes.c_double, ctypes.c_int]),
    "pymemplan_record_stream": (None, [ctypes.c_void_p, _c_stream]),
    "pymemplan_base_alloc": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]),
    # The C API for Python.
    "pymemplan_try_alloc": (ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, _c_stream]),
    "pymemplan_configure": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p]),
    "pymemplan_stats_json": (ctypes.c_long, [ctypes.c_int, _c_buffer, ctypes.c_size_t]),
    "pymemplan_snapshot_json": (ctypes.c_long, [ctypes.c_int, _c_buffer, ctypes.c_size_t]),
    "pymemplan_reset_peak_stats": (ctypes.c_int, [ctypes.c_int]),
    "pymemplan_reset_accumulated_stats": (ctypes.c_int, [ctypes.c_int]),
    "pymemplan_set_memory_limit": (ctypes.c_int, [ctypes.c_int, ctypes.c_size_t]),
    "pymemplan_empty_cache": (ctypes.c_int, [ctypes.c_int]),
    "pymemplan_mark_step": (ctypes.c_int, [ctypes.c_int]),
    "pymemplan_share_pages": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]),
    "pymemplan_export_plans": (ctypes.c_long, [ctypes.c_int, _c_buffer, ctypes.c_size_t]),
    "pymemplan_import_plans": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p,
                                              ctypes.POINTER(ctypes.c_size_t)]),
    "pymemplan_stage_plans": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p]),
    "pymemplan_record_history": (ctypes.c_int, [ctypes.c_int, ctypes.c_size_t]),
    "pymemplan_history_json": (ctypes.c_long, [ctypes.c_int, _c_buffer, ctypes.c_size_t]),
    "pymemplan_last_error": (ctypes.c_char_p, []),
    "pymemplan_device_count": (ctypes.c_int, []),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def _package_dirs() -> list[str]:
    # Every directory of the package: an editable install splits it between the source tree
    # (Python files) and site-packages (the built libraries).
    import pymemplan

    return [os.path.abspath(d) for d in pymemplan.__path__]


def _find(relative: str) -> str | None:
    for d in _package_dirs():
        candidate = os.path.join(d, relative)
        if os.path.isfile(candidate):
            return candidate
    return None


def library_path() -> str:
    """The path of libpymemplan_alloc.so inside the installed package.

    Raises PluginLoadError, saying where it looked and how to fix it, when it is missing.
    """
    path = _find(LIBRARY_NAME)
    if path is None:
        raise PluginLoadError(
            f"pymemplan's CUDA allocator plugin {LIBRARY_NAME} is missing: looked in "
            f"{', '.join(_package_dirs())}. {_REINSTALL_HINT}")
    return path


def fake_driver_path() -> str | None:
    """The path of the test-only fake CUDA driver libfakecuda.so, or None if not built."""
    return _find(FAKE_DRIVER_NAME)


def load() -> ctypes.CDLL:
    """libpymemplan_alloc.so, loaded once, with every C function's types declared."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            path = library_path()
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                raise PluginLoadError(f"cannot load {path}: {e}. {_REINSTALL_HINT}") from e
            for name, (restype, argtypes) in SIGNATURES.items():
                try:
                    fn = getattr(lib, name)
                except AttributeError:
                    raise PluginLoadError(
                        f"{path} does not export {name}(): the library is older or newer than "
                        f"this Python package. {_REINSTALL_HINT}") from None
                fn.restype = restype
                fn.argtypes = argtypes
            _lib = lib
    return _lib


def function_address(name: str) -> int:
    """The address of one exported C function, as PyTorch's set_*_fn hooks expect it."""
    address = ctypes.cast(getattr(load(), name), ctypes.c_void_p).value
    assert address is not None, name
    return address


def last_error() -> str:
    """The plugin's last error in this thread (an OOM message, a bad pointer, ...), or ""."""
    raw = load().pymemplan_last_error()
    return raw.decode("utf-8", "replace") if raw else ""


def check(rc: int, what: str) -> None:
    """Raise PluginError with the plugin's message when a C API call returned -1."""
    if rc < 0:
        raise PluginError(f"{what} failed: {last_error() or 'no message from the plugin'}")


def read_json(fn: Callable[..., int], device: int, what: str, initial: int = 1 << 16) -> Any:
    """Call one of the (device, buf, len) -> needed-length JSON functions and parse it."""
    return json.loads(read_text(fn, device, what, initial))


def read_text(fn: Callable[..., int], device: int, what: str, initial: int = 1 << 16) -> str:
    """Call one of the (device, buf, len) -> needed-length functions; its text."""
    size = initial
    while True:
        buf = ctypes.create_string_buffer(size)
        needed = fn(device, buf, size)
        check(needed, what)
        if needed < size:
            return buf.raw[:needed].decode()
        # Too small: the return value is the length it needs. The state may grow between
        # the two calls, so leave room and loop rather than trust one retry.
        size = needed + needed // 4 + 1024
