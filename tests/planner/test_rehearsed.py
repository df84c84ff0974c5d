"""hcstudy/planner/rehearsed.py: the GPU check's rehearsals read back by the planner. A job whose shape was rehearsed
on the GPU type it is planned for is priced from its measured step; a micro-batch at or above one that ran out of
memory is refused when asked for, and left below by auto (the dry run, --plan-jobs, --estimate, the trainer)."""
import dataclasses

import pytest

import illustrative_check
import train_c4
from hcstudy.config import parse_config
from hcstudy.planner.memory import batch_plan
from hcstudy.contract import PlanJob, PlanRequest, load_check
from hcstudy.launcher import dry_run
from hcstudy.planner import plan_jobs, rehearsed, run_time

H100 = illustrative_check.GPU
TINY = ["--preset", "tiny", "--residual", "mhc"]


def tiny_row(micro, status="ok", path="triton", batch=4, flags=(), **changes):
    cfg = parse_config([*TINY, "--batch-size", str(batch), "--micro-batch-size", str(micro), *flags])
    step = [0.010, [0.009, 0.012]] if status == "ok" else [None, None]
    row = illustrative_check.row("mhc", 2, micro, batch, path, status, *step, 0.1, 0.1, [0.005, 0.02],
                                 False)
    return dict(row, config=rehearsed.step_config(cfg), width=cfg.width, seq_len=cfg.seq_len, **changes)


def test_a_rehearsal_prices_only_its_own_shape_and_an_out_of_memory_error_every_larger_micro_batch():
    check = {"gpu": H100, "rehearsals": [tiny_row(2), tiny_row(4, "oom"), tiny_row(3, "oom", batch=3),
                                         tiny_row(1, "oom", gpu="NVIDIA H200")]}
    cfg = parse_config([*TINY, "--micro-batch-size", "2"])
    assert rehearsed.measured_row(check, cfg, 2, "triton", H100) == check["rehearsals"][0]
    # a schedule, a seed, the run folder do not move a step: the same shape
    same = parse_config([*TINY, "--micro-batch-size", "2", "--lr", "1e-3", "--seed", "7", "--steps", "9"])
    assert rehearsed.measured_row(check, same, 2, "triton", H100) is not None
    for other in ([*TINY, "--sinkhorn-iters", "5"], [*TINY, "--stream-dtype", "bf16"], [*TINY, "--compile"],
                  [*TINY, "--batch-size", "8"], [*TINY, "--activation-checkpointing"]):
        assert rehearsed.measured_row(check, parse_config(other), 2, "triton", H100) is None, other
    assert rehearsed.measured_row(check, cfg, 1, "triton", H100) is None                 # another micro-batch
    assert rehearsed.measured_row(check, cfg, 2, "fused", H100) is None                  # another path
    assert rehearsed.measured_row(check, cfg, 2, "triton", "NVIDIA H200") is None        # another card
    assert rehearsed.measured_row(check, cfg, 2, "triton", H100, world=2) is None        # a rehearsal is one GPU
    # out of memory at 3 (global batch 3) and at 4: any global batch, the smallest
    assert rehearsed.out_of_memory_at(check, cfg, H100) == 3
    assert rehearsed.out_of_memory_at(check, cfg, "NVIDIA H200") == 1
    assert rehearsed.out_of_memory_at(check, parse_config([*TINY, "--depth", "3"]), H100) is None
    assert rehearsed.out_of_memory_at({"rehearsals": "junk"}, cfg, H100) is None


def plan(out, *jobs):
    request = PlanRequest("", 1, None, [PlanJob([*flags, "--out", str(out)], check=load_check(out)) for flags in jobs])
    return plan_jobs.answer_jobs(request)


def test_the_planner_prices_a_rehearsed_job_from_its_step_keeps_auto_below_a_failure_and_refuses_one_asked(tmp_path):
    illustrative_check.write(tmp_path, rows=[])
    check = load_check(tmp_path)
    check["rehearsals"] = [tiny_row(2), tiny_row(4, "oom")]
    illustrative_check.gpu_check.write_json_atomic(tmp_path / "gpu_check" / "result.json", check)
    answer = plan(tmp_path, [*TINY, "--micro-batch-size", "auto"], [*TINY, "--micro-batch-size", "4"],
                  ["--preset", "tiny", "--residual", "hc", "--micro-batch-size", "auto"])
    measured, asked, other = answer["jobs"]
    # auto would take the whole batch of 4 on an 80 GiB card; the rehearsal ran out of memory there
    assert measured["micro"] == 2 and measured["path"] == "triton" and measured["error"] is None
    assert measured["basis"] == run_time.MEASURED_BASIS and measured["step_point"] == 0.010
    assert measured["step_seconds"] == [0.009, 0.012]                   # the spread of its steps, not a model range
    assert asked["error"] == ("--micro-batch-size 4: the GPU check's rehearsal of mhc at depth 2 ran out of memory at "
                              f"micro-batch 4 on this {H100} (result.json in {tmp_path}/gpu_check): use a smaller one, "
                              "or auto")
    assert other["micro"] == 4 and other["basis"].startswith("modelled") and other["step_point"] is None
    assert f"Step times, {run_time.MEASURED_BASIS}" in answer["assumptions"]
    assert dry_run.time_basis(measured) == "measured: 0.01 s a step, 0.009-0.012"
    assert dry_run.time_basis(other) == "modelled"


def test_estimate_prices_a_rehearsed_shape_and_refuses_a_micro_batch_that_ran_out_of_memory(tmp_path, capsys):
    illustrative_check.write(tmp_path, rows=[])
    check = load_check(tmp_path)
    check["rehearsals"] = [tiny_row(2), tiny_row(4, "oom")]
    illustrative_check.gpu_check.write_json_atomic(tmp_path / "gpu_check" / "result.json", check)
    assert train_c4.main([*TINY, "--micro-batch-size", "auto", "--estimate", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "--micro-batch-size auto: 2 (the largest whose plan fills at most 95% of the card, below the 4 the GPU " \
           "check saw run out of memory)" in out
    assert "triton path (measured: the GPU check's rehearsal of the job's very shape on this GPU type" in out
    assert "0.01 s a step (0.009-0.012 s over 3 steps)" in out
    assert train_c4.main([*TINY, "--micro-batch-size", "4", "--estimate", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ran out of memory at micro-batch 4" in err


def test_the_trainers_auto_micro_batch_on_a_gpu_stays_below_a_rehearsals_failure(tmp_path):
    illustrative_check.write(tmp_path, rows=[])
    check = load_check(tmp_path)
    check["rehearsals"] = [tiny_row(2, "oom")]
    illustrative_check.gpu_check.write_json_atomic(tmp_path / "gpu_check" / "result.json", check)
    cfg = parse_config([*TINY, "--micro-batch-size", "auto", "--out", str(tmp_path)])
    micro, _, why = batch_plan(cfg, 1, on_gpu=True, card=80 * 2 ** 30, gpu=H100)
    assert micro == 1 and "below the 2 the GPU check saw run out of memory" in why
    assert batch_plan(cfg, 1, on_gpu=True, card=80 * 2 ** 30, gpu="NVIDIA H200")[0] == 4
    with pytest.raises(Exception, match="ran out of memory at micro-batch 2"):
        batch_plan(dataclasses.replace(cfg, micro_batch_size="2"), 1, on_gpu=True, card=80 * 2 ** 30, gpu=H100)
