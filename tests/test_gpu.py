"""pymemplan inside PyTorch on a real GPU. Skipped without one; benchmarks/gpu_check.py runs
them on a GPU machine. Each test runs in a fresh process: the allocator must be chosen before
CUDA is initialized."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def run(code: str, **env) -> str:
    import os

    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env={**os.environ, **env}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_tensors_come_from_our_pool_and_stats_follow():
    out = run("""
        import pymemplan, torch
        pymemplan.enable()
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        s = pymemplan.memory_stats()
        assert s["allocated_bytes.all.current"] >= 64 << 20, s
        assert s["reserved_bytes.all.current"] >= s["allocated_bytes.all.current"]
        y = (x.float() + 1).sum()          # real kernels on our memory
        assert int(y.item()) == (64 << 20)
        del x
        torch.cuda.synchronize()
        pymemplan.empty_cache()
        print(pymemplan.memory_stats()["allocated_bytes.all.current"] > 0)
    """)
    assert out.strip() in ("True", "False")


def test_training_step_matches_native_numerics():
    code = """
        import torch, pymemplan{enable}
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
        opt = torch.optim.Adam(m.parameters())
        x = torch.randn(256, 512, device="cuda")
        for _ in range(3):
            m(x).square().mean().backward(); opt.step(); opt.zero_grad()
        print(float(m(x).square().mean()))
    """
    ours = run(code.format(enable="; pymemplan.enable()"))
    native = run(code.format(enable=""))
    assert abs(float(ours) - float(native)) <= 1e-5 * abs(float(native))


def test_oom_is_an_error_with_our_message():
    out = run("""
        import pymemplan, torch
        pymemplan.enable()
        pymemplan.set_memory_limit("256MiB")
        try:
            torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
        except RuntimeError as e:
            print("OOM:", e)
    """)
    assert "OOM: " in out and "pymemplan: out of memory" in out and "memory limit" in out


def test_record_stream_keeps_memory_until_the_other_stream_is_done():
    run("""
        import pymemplan, torch
        pymemplan.enable()
        s = torch.cuda.Stream()
        x = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(s):
            torch.cuda._sleep(100_000_000)
            x.add_(1)
        x.record_stream(s)
        ptr = x.data_ptr()
        del x
        y = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
        assert y.data_ptr() != ptr, "memory reused while another stream may use it"
    """)


def test_share_pages_keeps_tensor_contents_under_queued_work():
    """share_pages on real memory: half-page tensors at alternating halves of pages, one of
    them still being written by a kernel queued on a side stream; after sharing, every tensor
    holds what was written, and kernels on both addresses of a shared page see their own."""
    run("""
        import pymemplan, torch
        pymemplan.enable(policy="pymemplan-vmm")
        MiB = 1 << 20
        blocks = [torch.empty(MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
        base = blocks[0].data_ptr()
        assert [b.data_ptr() - base for b in blocks] == [i * MiB for i in range(8)]
        kept = [blocks[2 * p + (p % 2)] for p in range(4)]
        del blocks
        for i, t in enumerate(kept):
            t.fill_(17 + i)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(50_000_000)
            kept[1].add_(1)  # still queued when share_pages copies kept[1]'s page
        kept[1].record_stream(s)
        before = pymemplan.memory_reserved()
        assert pymemplan.share_pages() == 4 * MiB
        assert pymemplan.memory_reserved() == before - 4 * MiB
        expect = [17, 19, 19, 20]
        for t, v in zip(kept, expect):
            assert bool((t == v).all()), (t[:4], v)
        kept[0].fill_(99)
        kept[1].sub_(1)
        torch.cuda.synchronize()
        assert bool((kept[0] == 99).all()) and bool((kept[1] == 17 + 1).all())
    """)


def test_vmm_moves_pages_under_queued_work_without_faults():
    """At its peak, vmm unmaps idle pages to map them behind a new request. A page may go
    only once the kernels queued before its tensor was freed are done (an event after the
    free, or a wait): here every tensor is freed while a kernel still writes it, and the next
    request moves its pages. Unmapped too early, the kernel faults or another tensor's bytes
    change; the sums below would differ."""
    out = run("""
        import pymemplan, torch
        pymemplan.enable(policy="pymemplan-vmm")
        MiB = 1 << 20
        acc = torch.zeros(1, dtype=torch.float64, device="cuda")
        p = torch.empty(5 * MiB, device="cuda")          # 20 MiB, then a hole under it
        q = torch.empty(MiB // 2, device="cuda")
        del p
        moved = pymemplan.memory_stats()["num_device_free"]
        expect = 0.0
        for i in range(40):
            for n in (6 * MiB, 9 * MiB // 2):             # 24 and 18 MiB: above, then the hole
                t = torch.empty(n, device="cuda")
                torch.cuda._sleep(2_000_000)              # the device falls behind the host
                t.fill_(i % 7 + 1)
                acc += t.sum(dtype=torch.float64)
                expect += n * (i % 7 + 1)
                del t                                     # freed with its kernels queued
        torch.cuda.synchronize()
        moved = pymemplan.memory_stats()["num_device_free"] - moved
        assert moved > 0, "no page moved: the test did not exercise what it is for"
        assert float(acc.item()) == expect, (float(acc.item()), expect)
        print(moved)
    """)
    assert int(out.split()[-1]) > 0


def test_cuda_graph_capture_is_refused_with_our_message_and_nothing_breaks():
    # An allocation inside torch.cuda.graph fails with what to do instead; the capture is
    # abandoned, and the allocator serves eager work afterwards.
    out = run("""
        import pymemplan, torch
        pymemplan.enable("pymemplan-vmm")
        x = torch.randn(1 << 20, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y = x * 2  # warm-up on the side stream, as torch.cuda.graph recommends
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                z = x * 3
        except RuntimeError as e:
            # Ours, or ending the abandoned capture failed while ours propagated.
            assert "capturing a CUDA graph" in f"{e} {e.__context__}", e
            print("refused")
        del y
        w = (x + 1).sum()
        torch.cuda.synchronize()
        print(float(w) != 0.0)
    """)
    assert out.split() == ["refused", "True"]
