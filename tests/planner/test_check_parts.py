"""hcstudy/check_parts.py: the GPU check's parts planned within their budgets and run in one process at a few
thousand parameters (the check's --cpu-tiny sizes); an out-of-memory error as a rehearsal's result."""
import time
import weakref

import pytest
import torch

from hcstudy.config import parse_config
from hcstudy import check_parts, contract
from hcstudy.model import GPT
from hcstudy.planner import rehearsed

from check_contexts import H100, MODELLED, by_name, tiny  # noqa: F401 (tiny: a fixture)
from helpers import tiny_config


def test_the_plan_rehearses_every_arm_at_both_depths_and_once_one_micro_batch_over_the_plan(tiny):
    ctx, parts = tiny
    assert [p.name for p in parts] == [
        "start-up: this process", "planning", "kernel tests", "environment", "timings", "rehearsal baseline d2", "rehearsal mhc d2",
        "rehearsal hc d2", "variant baseline d2 --cross-entropy fused", "variant baseline d2 --compile",
        "variant baseline d2 --compile --compile-scope model", "rehearsal baseline d3", "rehearsal mhc d3",
        "rehearsal hc d3", "over the plan mhc d3"]
    named = by_name(parts)
    deep, over = named["rehearsal mhc d3"], named["over the plan mhc d3"]
    # the planner's micro-batch for this card (the whole batch of 4 fits the pretend 2 GiB) and its path on the CPU
    assert deep.micro == 4 and deep.path == "fused" and deep.flags[-2:] == ["--micro-batch-size", "4"]
    assert over.micro == deep.micro + 1 and over.over_plan and "--batch-size" in over.flags
    assert ctx.config(over.flags).batch_size % over.micro == 0           # the global batch rounded to a multiple
    assert named["variant baseline d2 --compile"].variant == ["--compile"] and not named["rehearsal hc d2"].required
    # a step at the modelled slow end x the margin, each warm-up and timed step; a compiled one adds the compile
    base = named["rehearsal baseline d2"]
    steps = (check_parts.WARM_STEPS + check_parts.TIMED_STEPS) * MODELLED[1] * check_parts.STEP_MARGIN
    assert base.budget_s == pytest.approx(ctx.build_s(ctx.config(base.flags)) + steps + check_parts.FREE_S, abs=0.1)
    assert named["variant baseline d2 --compile"].budget_s == pytest.approx(base.budget_s + check_parts.COMPILE_S,
                                                                             abs=0.1)
    assert all(p.included for p in parts) and all(p.budget_s > 0 for p in parts)


def test_optional_parts_are_left_out_in_priority_order_when_the_budget_is_short(tiny):
    ctx, parts = tiny
    required = sum(p.budget_s for p in parts if p.required)
    named = by_name(parts)
    levers = [p for p in parts if p.name.startswith("variant baseline d2")]
    hc = named["rehearsal hc d2"].budget_s
    short = by_name(check_parts.plan_parts(ctx, required + sum(p.budget_s for p in levers) + hc + 0.05))  # not both hc
    assert all(short[p.name].included for p in levers) and short["rehearsal hc d2"].included
    assert not short["rehearsal hc d3"].included and short["over the plan mhc d3"].included
    lines = check_parts.plan_lines(list(short.values()), 570)
    assert lines[-2] == "left out, over the 570 s budget: rehearsal hc d3"
    assert lines[-1] == f"total: {sum(p.budget_s for p in short.values() if p.included):.0f} s"
    assert not any("rehearsal hc d3" in line for line in lines[:-2])


def test_an_out_of_memory_error_is_the_rehearsals_result_its_memory_is_freed_and_the_next_one_trains(tiny,
                                                                                                   monkeypatch):
    ctx, parts = tiny
    built, real_step = [], check_parts.Stepper.step

    def build(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append(weakref.ref(self.model))
    real_init = check_parts.Stepper.__init__
    monkeypatch.setattr(check_parts.Stepper, "__init__", build)

    def out_of_memory(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(check_parts.Stepper, "step", out_of_memory)
    alive_when_freed = []
    real_free = check_parts.free_memory
    monkeypatch.setattr(check_parts, "free_memory",
                        lambda device: alive_when_freed.append([ref() is not None for ref in built]) or real_free(device))
    part = by_name(parts)["rehearsal mhc d3"]
    row = check_parts.rehearse(ctx, part, time.time() + 600)
    assert row["status"] == "oom" and row["reason"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert row["step_s"] is None and row["micro_batch"] == 4 and row["kernels"] == "fused"
    # freed before the next shape: nothing holds the model then, not the error's traceback, not the stepper
    assert alive_when_freed == [[], [False]]
    monkeypatch.setattr(check_parts.Stepper, "step", lambda self: (_ for _ in ()).throw(RuntimeError("CUDA error")))
    assert check_parts.rehearse(ctx, part, time.time() + 600)["status"] == "failed"
    monkeypatch.setattr(check_parts.Stepper, "step", real_step)
    row = check_parts.rehearse(ctx, part, time.time() + 600)
    assert row["status"] == "ok" and row["steps_timed"] == check_parts.TIMED_STEPS and row["reason"] == ""
    low, high = row["step_s_spread"]
    assert low <= row["step_s"] <= high and row["tokens_per_s"] == pytest.approx(4 * 32 / row["step_s"])
    assert row["config"] == rehearsed.step_config(ctx.config(part.flags)) and row["modelled_step_s"] == MODELLED
    assert row["mfu"] is None and row["peak_alloc_gib"] is None          # no peak FLOPs or device memory on a CPU
    assert list(row) == list(contract.REHEARSAL_KEYS)


def test_the_parts_run_in_one_process_each_arm_built_once_for_all_its_paths(tiny, monkeypatch):
    ctx, parts = tiny
    monkeypatch.setattr(check_parts, "SMALL_WARM", 1)
    monkeypatch.setattr(check_parts, "SMALL_TIMED", 1)
    built = []
    real_init = check_parts.Stepper.__init__
    monkeypatch.setattr(check_parts.Stepper, "__init__",
                        lambda self, ctx, cfg, *a, **k: built.append(cfg.residual) or real_init(self, ctx, cfg, *a, **k))
    chosen = [p for p in parts if p.name in ("environment", "timings", "rehearsal baseline d2", "over the plan mhc d3")]
    events = []
    check_parts.run_parts(ctx, chosen, time.time() + 600, events.append, skip=set())
    timed = [(e["method"], e["path"]) for e in events if e["event"] == "timing"]
    assert timed == [("baseline", "reference"), ("hc", "reference"), ("hc", "fused"), ("mhc", "reference"),
                     ("mhc", "fused")]
    assert built == ["baseline", "hc", "mhc", "baseline", "mhc"]        # one model per arm, then one per rehearsal
    rows = [e["row"] for e in events if e["event"] == "rehearsal"]
    assert [(r["method"], r["status"]) for r in rows] == [("baseline", "ok"), ("mhc", "oom")]
    assert "simulated by --cpu-tiny" in rows[1]["reason"] and rows[1]["over_plan"]
    assert [e["part"] for e in events if e["event"] == "end"] == [p.name for p in chosen]
    # no time left: nothing runs, each rehearsal recorded out of time with its shape
    events = []
    check_parts.run_parts(ctx, chosen, time.time(), events.append, skip={"environment"})
    rows = [e["row"] for e in events if e["event"] == "rehearsal"]
    assert [r["status"] for r in rows] == ["out-of-time"] * 2 and rows[0]["micro_batch"] == 4
    assert not [e for e in events if e["event"] in ("start", "timing", "environment")]


def test_a_required_part_keeps_its_time_from_the_optional_ones_before_it(tiny, monkeypatch):
    ctx, parts = tiny
    ran = []
    monkeypatch.setattr(check_parts, "run_part", lambda ctx, part, *a: ran.append(part.name))
    lever, last = by_name(parts)["variant baseline d2 --compile"], by_name(parts)["over the plan mhc d3"]
    check_parts.run_parts(ctx, [lever, last], time.time() + last.budget_s + lever.budget_s / 2, lambda e: None, set())
    assert ran == ["over the plan mhc d3"]


def test_the_rehearsed_losses_become_what_cross_entropy_auto_takes(tmp_path):
    """The baseline's rehearsal with the plain loss and its --cross-entropy fused variant at the same depth: result.json's
    "cross_entropy", which auto reads (cross_entropy.choose); a loss that did not train leaves auto at plain."""
    from hcstudy.kernels import cross_entropy

    def row(variant, step_s, status="ok", depth=32, method="baseline"):
        return dict(method=method, depth=depth, variant=list(variant), step_s=step_s, status=status)
    cfg = parse_config(["--residual", "baseline"])
    for rows, expected in (([row((), 0.50), row(check_parts.FUSED_LOSS, 0.42)], "fused"),
                           ([row((), 0.40), row(check_parts.FUSED_LOSS, 0.42)], "plain"),
                           ([row((), 0.50), row(check_parts.FUSED_LOSS, None, "oom")], "plain"),
                           ([row((), 0.50, depth=48), row(check_parts.FUSED_LOSS, 0.42)], "plain"),
                           ([row((), 0.50, method="mhc"), row(check_parts.FUSED_LOSS, 0.42)], "plain")):
        timings = check_parts.loss_timings(rows)
        assert cross_entropy.choose(cfg, H100, {"gpu": H100, "cross_entropy": timings})[0] == expected, rows
    assert check_parts.loss_timings([row((), 0.5), row(check_parts.FUSED_LOSS, 0.4)]) == {
        "plain": {"step_s": 0.5}, "fused": {"step_s": 0.4}}


def test_a_model_switched_to_another_path_checkpoints_as_that_path_needs():
    """One model serves every path the check times: on the formulas' path checkpointing recomputes the connection
    with its sublayer, on a kernel path the sublayer alone (hcstudy/model.py, Block.checkpointed)."""
    model = GPT(tiny_config("mhc", activation_checkpointing=True), kernels="reference")
    assert {block.checkpointed for block in model.blocks} == {"connection"}
    check_parts.take_path(model, "fused")
    assert {block.checkpointed for block in model.blocks} == {"sublayer"}
    check_parts.take_path(model, "reference")
    assert {block.checkpointed for block in model.blocks} == {"connection"}
