"""Training runs the size of a GPU's memory, predicted by the planner
(benchmarks/alloc_gpu_scale.py): where each step starts, the driver calls each step makes, and
what they showed of pymemplan-planned."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import pymemplan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from alloc_gpu_scale import GpuWorkload, calls_per_step, predicted_run, verdicts, workloads  # noqa: E402

from pymemplan.planner import models  # noqa: E402
from pymemplan.traces import replay  # noqa: E402
from pymemplan.traces.trace import ALLOC, FREE  # noqa: E402


def _mlp_run(steps):
    w = models.mlp(batch=64, layers=3, width=256)
    t = pymemplan.trace(w.model, w.inputs, loss_fn=w.loss_fn, optimizer=torch.optim.AdamW,
                        device="cuda")
    return t, t._repeated_trace(steps)


def test_a_predicted_run_says_where_each_step_starts():
    t, run = _mlp_run(4)
    starts = run.meta["step_starts"]
    assert len(starts) == 4 and starts == sorted(starts) and 0 < starts[0]
    actions, ptrs = run.action.tolist(), run.ptr.tolist()
    # Before the first step: the parameters, allocated and never freed in the run.
    params = {p for a, p in zip(actions[:starts[0]], ptrs[:starts[0]]) if a == ALLOC}
    assert params and not any(a == FREE and p in params for a, p in zip(actions, ptrs))
    # Each later step starts by freeing the gradients the last one kept (zero_grad), and
    # the steps after the first (which makes the optimizer's state) are alike.
    grads = {x.id for x in t.tensors if x.category == "gradient"}
    for s in starts[1:]:
        assert actions[s] == FREE and ptrs[s] % (1 + max(x.id for x in t.tensors)) in grads
    lengths = [b - a for a, b in zip(starts[1:], starts[2:] + [len(run)])]
    assert len(set(lengths)) == 1, lengths


def test_calls_per_step_count_each_step_and_add_up_to_the_run():
    _, run = _mlp_run(4)
    for policy in ("torch", "pymemplan-vmm", "pymemplan-planned"):
        counts, stats = calls_per_step(run, policy)
        (r,) = replay(run, [policy])
        assert len(counts) == 4 and sum(counts) == r.device_allocs + r.device_frees
        assert ("arms" in stats) == (policy == "pymemplan-planned")
    # PyTorch's allocator, warm, keeps what it has.
    assert calls_per_step(run, "torch")[0][-1] == 0
    # On a device too small for the run, refused requests are skipped (with their frees), as
    # replay() counts them, rather than ending the measurement.
    (small,) = replay(run, ["pymemplan-vmm"], capacity=4 << 20)
    assert small.ooms > 0
    assert len(calls_per_step(run, "pymemplan-vmm", capacity=4 << 20)[0]) == 4


def test_a_plan_made_again_replaces_a_layout_that_leaves_requests_to_the_pool():
    """GPT-2 small at 8 x 1024 under AdamW, predicted on CUDA. The first plan is made from a
    window that held the first step's optimizer state and none of the later steps' optimizer
    temporaries; the pass after it arms, one event shorter than its period, makes it again
    (a remake), whose layout is packed 3 pages above what the old one held in that pass. The
    old layout was kept, and it left those temporaries to the pool at every step, which served
    them around the arena by moving 480 pages (960 driver calls) at each step for good. Now
    the plan made again may go up to the run's highest reserved where the old layout leaves
    requests to the pool: the warm steps make no driver call, at the same peaks."""
    run = predicted_run(GpuWorkload("gpt2_b8", lambda: models.gpt2(batch=8)), steps=6)
    counts, stats = calls_per_step(run, "pymemplan-planned")
    assert stats["remakes"] == 1 and stats["layouts_kept"] == 0, stats
    assert counts[-2:] == [0, 0], counts
    (planned, vmm) = replay(run, ["pymemplan-planned", "pymemplan-vmm"])
    assert planned.steady_reserved_over_live < 1.0001, planned.steady_reserved_over_live
    assert planned.peak_reserved_bytes <= vmm.peak_reserved_bytes
    # pymemplan-vmm, with no plan, moves pages at every step of the same run.
    assert calls_per_step(run, "pymemplan-vmm")[0][-1] > 0


def test_a_plan_waits_where_the_pool_just_served_a_pass_for_less():
    """BERT-base at 32 x 512 under AdamW, predicted on CUDA. The first plan is made from a
    window that held the first step's one-off requests, and packs 16,900 MiB where the pool
    served the pass before it in 16,754 (live: 16,745). It was armed all the same, within
    plan_slack (1%) of the live bytes, and its pass took the run to 1.0093 of live before the
    plan made again from that pass replaced it. Where the pool has just served a whole pass
    of the plan's period, the highest reserved measures such a pass, and the plan is held to
    it: the plan made again from the next pass serves, at the pool's peak."""
    run = predicted_run(GpuWorkload("bert_b32", lambda: models.bert(batch=32)), steps=6)
    (planned, vmm) = replay(run, ["pymemplan-planned", "pymemplan-vmm"])
    page = 2 << 20
    assert planned.peak_reserved_bytes <= vmm.peak_reserved_bytes + page, (
        planned.reserved_over_live, vmm.reserved_over_live)
    assert planned.steady_reserved_over_live < 1.001, planned.steady_reserved_over_live
    counts, stats = calls_per_step(run, "pymemplan-planned")
    assert stats["arms"] >= 1 and counts[-2:] == [0, 0], counts


def test_a_plan_made_again_larger_keeps_its_arena():
    """GPT-2 small at 12 x 1024 under AdamW, predicted on CUDA. The plan made again a pass
    after it first armed (a remake) packs a little more than the first one, whose arena was
    the size of its own layout: a new arena was made, and every page of the step moved into it
    (19,464 page maps and unmaps in that step). An arena's address range now holds any plan
    the device could: the remake arms in the same range, mapping only what it adds."""
    run = predicted_run(GpuWorkload("gpt2_b12", lambda: models.gpt2(batch=12)), steps=5)
    counts, stats = calls_per_step(run, "pymemplan-planned")
    assert counts[3] < 1_000 and counts[-1] == 0, counts  # 19,464 at step 3 before
    assert stats["remakes"] == 1 and stats["arenas_made"] == 1, stats


def test_plans_of_several_lengths_take_turns_in_one_arena():
    """GPT-2 small at batch 8, the sequence length changing at every step (512, 1024, 256,
    768, 1024, 512, 768, 256), predicted on CUDA. Plans of each length are made and adopted
    by their first requests; each one larger than the arena got a new one, and one adopted
    while the last plan's blocks were alive in the arena retired it into the pool: every page
    of the next planned step moved to a new address range (12,756, 8,116 and 6,489 page maps
    and unmaps in the last three steps). Now one arena serves every plan, and a plan adopted
    by its first requests arms in it beside the few blocks still alive there."""
    w = GpuWorkload("gpt2_b8_varlen", lambda seq: models.gpt2(batch=8, seq_len=seq),
                    shapes=(512, 1024, 256, 768, 1024, 512, 768, 256))
    run = predicted_run(w)
    counts, stats = calls_per_step(run, "pymemplan-planned")
    assert sum(counts[-3:]) < 3_000, counts
    assert stats["arenas_made"] == 1 and stats["arms"] >= 5, stats
    (planned, vmm) = replay(run, ["pymemplan-planned", "pymemplan-vmm"])
    assert planned.peak_reserved_bytes <= vmm.peak_reserved_bytes, (planned.reserved_over_live,
                                                                     vmm.reserved_over_live)


def test_a_plan_made_again_before_its_blocks_are_freed_learns_them_at_its_next_arming():
    """ViT-B/16 under AdamW, 24 steps of 32, 48 or 64 images drawn at random, predicted on CUDA.
    A plan that left requests of unknown lifetime to the pool is made again at its cut from the
    step it served (a refinement). The gradients live across that cut, to the next step's
    zero_grad: their lifetimes could come only from the step one period back, another batch
    size's, so the plan made again lacked them as well, left them to the pool at every step it
    served, and was made again at each, its layout moving pages (14,014 page maps and unmaps
    over the second half). Its next arming now looks their lifetimes up, since freed."""
    w = workloads()["vit_b_16_varbatch_long"]  # the benchmark's run of 24 drawn batch sizes
    assert w.steps == 24 and set(w.shapes) == {32, 48, 64}
    run = predicted_run(w)
    counts, stats = calls_per_step(run, "pymemplan-planned")
    vmm, _ = calls_per_step(run, "pymemplan-vmm")
    half = w.steps // 2
    assert sum(counts[half:]) <= 1.5 * sum(vmm[half:]), (counts, vmm)  # 14,014 against 2,572
    (planned, pool) = replay(run, ["pymemplan-planned", "pymemplan-vmm"])
    assert planned.peak_reserved_bytes <= pool.peak_reserved_bytes


def test_verdicts_name_the_targets():
    row = {"policies": {
        "torch": {"peak_reserved_bytes": 110},
        "pymemplan-vmm": {"peak_reserved_bytes": 104, "reserved_over_live": 1.04,
                          "steady_reserved_over_live": None, "steady_calls_per_step": 3.0},
        "pymemplan-planned": {"peak_reserved_bytes": 101, "reserved_over_live": 1.01,
                              "steady_reserved_over_live": 1.005, "steady_calls_per_step": 0.0}}}
    v = verdicts(row)
    assert v["pymemplan-vmm"] == {"within_3pct": False, "at_most_torch": True,
                                  "no_calls_when_warm": False}
    assert v["pymemplan-planned"] == {"within_3pct": True, "at_most_torch": True,
                                      "no_calls_when_warm": True, "steady_within_1pct": True}


def test_an_unknown_workload_is_named_in_the_error(capsys):
    import alloc_gpu_scale

    with pytest.raises(SystemExit):
        sys.argv = ["alloc_gpu_scale.py", "--only", "gpt2_b8", "no_such_model"]
        alloc_gpu_scale.main()
    assert "no_such_model" in capsys.readouterr().err
