"""CuPy allocating from pymemplan's pool, the one PyTorch uses after pymemplan.enable().

    import pymemplan, pymemplan.cupy
    pymemplan.enable()          # PyTorch
    pymemplan.cupy.use()        # CuPy: same pool, same stats and snapshots

One pool for both libraries means memory CuPy frees can serve PyTorch and back, instead
of each library caching its own.

Out of memory raises CuPy's OutOfMemoryError with pymemplan's message: CuPy allocates
through ``pymemplan_try_alloc``, which never throws (ctypes could not catch it), whatever
oom_action says for PyTorch.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from .allocator import _library
from .allocator._oom import OOM_PREFIX


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise ImportError(
            "pymemplan.cupy needs CuPy, which is not installed. Install the wheel that matches "
            "the CUDA major version of your driver (the 'CUDA Version' nvidia-smi prints): "
            "`pip install cupy-cuda12x` for CUDA 12, `pip install cupy-cuda11x` for CUDA 11.") from e
    return cupy


class _Block:
    """Owns one pymemplan block; CuPy holds it as the UnownedMemory's owner.

    When CuPy drops its last reference, the finalizer hands the block back to pymemplan.
    """

    __slots__ = ("__weakref__",)


def _out_of_memory(cupy: Any, size: int, device: int, message: str) -> BaseException:
    oom = getattr(cupy.cuda.memory, "OutOfMemoryError", None)
    if oom is None:
        return MemoryError(message)
    # CuPy's signature is (size, total, limit); its own message would lose ours.
    reserved = _library.read_json(_library.load().pymemplan_stats_json, device, "stats").get(
        "reserved_bytes.all.current", 0)
    error = oom(size, reserved)
    error.args = (message,)
    return error


# cudaStreamPerThread: one handle that means each calling thread's own default stream.
_PER_THREAD_STREAM = 0x2

# Every CuPy stream the pool has served, kept alive for the process. The pool knows a stream
# by its handle and may still use it after its blocks are freed: it records events on it
# before another stream takes its free blocks, and synchronizes it before unmapping their
# pages. A `cupy.cuda.Stream` destroys its handle when collected; a call on that handle is
# undefined in the driver, and a new stream given the same handle would be taken for the old
# one, whose freed blocks it could then reuse before the old stream's work on them is done.
# Streams are few; a program making a new one per iteration keeps each (about what a CUDA
# stream costs in the driver), which is the price of never touching a destroyed one.
_streams: dict[int, Any] = {}


def allocator() -> Callable[[int], Any]:
    """The function CuPy calls for memory: size -> cupy.cuda.MemoryPointer from pymemplan."""
    cupy = _import_cupy()
    lib = _library.load()

    def malloc(size: int) -> Any:
        device = cupy.cuda.runtime.getDevice()
        if size == 0:  # the plugin gives no memory for 0 bytes, and CuPy needs none
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device), 0)
        current = cupy.cuda.get_current_stream()
        stream = current.ptr
        if stream == _PER_THREAD_STREAM:
            raise RuntimeError(
                "pymemplan.cupy: CuPy is using the per-thread default stream "
                "(CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1). Its handle is the same in every "
                "thread, so the pool could hand a block freed by one thread to another while "
                "the first thread's kernels still use it. Unset that variable, or run on "
                "streams of your own (with cupy.cuda.Stream(): ...).")
        if stream:
            _streams.setdefault(stream, current)
        ptr = lib.pymemplan_try_alloc(size, device, stream or None)
        if not ptr:
            message = _library.last_error()
            if not message.startswith(OOM_PREFIX):  # a driver failure or a bad device
                raise RuntimeError(message or f"pymemplan: allocating {size} bytes failed")
            raise _out_of_memory(cupy, size, device, message)
        owner = _Block()
        release = weakref.finalize(owner, lib.pymemplan_free, ptr, size, device, stream or None)
        release.atexit = False  # at exit the driver may be gone, and the process frees it all
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, size, owner, device), 0)

    return malloc


def use() -> None:
    """Make CuPy allocate from pymemplan: ``cupy.cuda.set_allocator(...)``.

    Raises ImportError (with the pip command) without CuPy, PluginLoadError without the plugin.
    """
    cupy = _import_cupy()
    malloc = allocator()
    cupy.cuda.set_allocator(malloc)
