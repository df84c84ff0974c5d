"""hcstudy/report/live.py: the live matrix view from matrix.log and each status.json."""
import fcntl
import json
import socket
import time
from datetime import datetime, timezone

from hcstudy.report import command
from hcstudy.report import live as report_live

from hand_written_runs import killed_matrix


def test_watch_view_from_matrix_log_and_live_status(tmp_path):
    """Two slots of 4 GPUs at $2 per GPU-hour, started 2 hours before `now`: one run done, two running (one of
    them silent for 20 minutes, though alive: its trainer on this host holds its lock), one queued, one failed."""
    (tmp_path / "matrix.log").write_text(
        "2026-12-03T10:00:00.000+0000 START run_experiments.sh pid=1 mode=full runs=9\n"
        "2026-12-03T10:00:00.000+0000 QUEUE slots=2 gpus_per_run=4 gpus=0,1,2,3,4,5,6,7 price_per_gpu_hour=2 "
        "runs=hc_d4_s1,mhc_d4_s1,hc_d4_s2,mhc_d4_s2,baseline_d4_s1\n"
        "2026-12-03T10:00:01.000+0000 LAUNCH hc_d4_s1 gpus=0,1,2,3 attempt=1\n"
        "2026-12-03T10:00:02.000+0000 LAUNCH mhc_d4_s1 gpus=4,5,6,7 attempt=1\n"
        "2026-12-03T11:00:00.000+0000 EXIT hc_d4_s1 code=0 gpus=0,1,2,3\n"
        "2026-12-03T11:00:00.000+0000 DONE hc_d4_s1 completed\n"
        "2026-12-03T11:00:01.000+0000 LAUNCH hc_d4_s2 gpus=0,1,2,3 attempt=1\n"
        "2026-12-03T11:30:00.000+0000 FAILED baseline_d4_s1 bad arguments\n")
    now = datetime(2026, 12, 3, 12, 0, tzinfo=timezone.utc).timestamp()

    def live(name, **status):
        (tmp_path / name).mkdir()
        (tmp_path / name / "status.json").write_text(json.dumps({"state": "running", **status}))
    live("hc_d4_s1", state="completed", step=100, steps=100, step_time_s=36.0, updated=now - 3600)
    live("mhc_d4_s1", step=50, steps=100, loss=3.25, amax_fwd=1.0, tokens_per_s=1234.5, step_time_s=72.0,
         eta_s=3600.0, updated=now - 1200, host=socket.gethostname())
    live("hc_d4_s2", step=10, steps=100, loss=4.5, amax_fwd=812.0, tokens_per_s=2000.0, step_time_s=36.0,
         eta_s=3240.0, updated=now - 30)
    with open(tmp_path / "mhc_d4_s1" / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        text = report_live.watch_view(tmp_path, stale_after_min=15, now=now)
    head, columns, *rows = text.splitlines()
    # queued mhc_d4_s2 takes the time of mhc_d4_s1 (100 x 72 s = 2 h) on the slot free first (hc_d4_s2's, 0.9 h):
    # 2.9 h to go, 16 GPUs' worth of money: 2 h x 8 GPUs x $2 = $32 spent, 2.9 h x 8 x $2 = $46 to go
    assert head.endswith("1 done, 2 running, 1 queued, 1 failed; 2:00:00 elapsed, 2:54:00 to go; $32 spent, "
                         "$46 to go (8 GPU(s) at $2 per GPU-hour)"), head
    assert rows[0].split() == ["4,5,6,7", "mhc_d4_s1", "50/100", "3.250", "1.000", "1,234", "1:00:00", "STALE:",
                               "status.json", "unchanged", "for", "20", "min"]
    assert rows[1].split() == ["0,1,2,3", "hc_d4_s2", "10/100", "4.500", "812", "2,000", "0:54:00"]
    assert rows[2:] == ["done: hc_d4_s1 completed", "queued: mhc_d4_s2", "failed: baseline_d4_s1 (matrix.log says why)"]
    assert command.main([str(tmp_path / "nothing"), "--watch"]) == 2


def test_a_relaunched_run_is_not_judged_by_its_last_attempts_status(tmp_path):
    """A LAUNCH newer than status.json: the trainer is starting and has not taken its lock yet."""
    d = killed_matrix(tmp_path, host=socket.gethostname())
    record = json.loads((d / "status.json").read_text())
    (d / "status.json").write_text(json.dumps(record | {"updated": time.time() - 3 * 3600}))
    (d / ".lock").touch()                       # held by no process
    head = report_live.watch_view(tmp_path).splitlines()[0]
    assert "1 running" in head and "killed" not in head, head


def test_watch_view_columns_hold_under_a_long_run_name(tmp_path):
    long = "mhc-lite_d48_s123_it100_tok_seed-study-stress"
    (tmp_path / "matrix.log").write_text(
        "2026-12-03T10:00:00.000+0000 QUEUE slots=2 gpus_per_run=1 gpus=0,1 price_per_gpu_hour=2 "
        f"runs=hc_d4_s1,{long}\n"
        "2026-12-03T10:00:01.000+0000 LAUNCH hc_d4_s1 gpus=0 attempt=1\n"
        f"2026-12-03T10:00:02.000+0000 LAUNCH {long} gpus=1 attempt=1\n")
    now = datetime(2026, 12, 3, 10, 30, tzinfo=timezone.utc).timestamp()
    for name in ("hc_d4_s1", long):
        (tmp_path / name).mkdir()
        (tmp_path / name / "status.json").write_text(json.dumps(
            {"state": "running", "step": 10, "steps": 100, "loss": 4.5, "amax_fwd": 2.0, "tokens_per_s": 2000.0,
             "eta_s": 600.0, "updated": now}))
    _, columns, *rows = report_live.watch_view(tmp_path, now=now).splitlines()
    ends = {line.index("step") + 4 if line is columns else line.index("10/100") + 6 for line in (columns, *rows)}
    assert len(ends) == 1, [columns, *rows]


def test_watch_eta_takes_the_plan_until_steps_are_timed_and_the_clock_stops_at_the_end(tmp_path):
    """One slot: the baseline runs (timed: 270 s to go), HC waits. Its pace is not the baseline's: until an HC
    step is timed it takes the trainer's plan (900 s), not the baseline's 300 s. After the END line, the elapsed
    time is the matrix's, not the time since it started."""
    log = tmp_path / "matrix.log"
    log.write_text("2026-12-03T10:00:00.000+0000 QUEUE slots=1 gpus_per_run=1 gpus=cpu price_per_gpu_hour=0 "
                   "runs=baseline_d4_s1,hc_d4_s1 planned_s=baseline_d4_s1:600,hc_d4_s1:900\n"
                   "2026-12-03T10:00:01.000+0000 LAUNCH baseline_d4_s1 gpus=cpu attempt=1\n")
    (tmp_path / "baseline_d4_s1").mkdir()
    (tmp_path / "baseline_d4_s1" / "status.json").write_text(json.dumps(
        {"state": "running", "step": 10, "steps": 100, "step_time_s": 3.0, "eta_s": 270.0}))
    now = datetime(2026, 12, 3, 10, 1, tzinfo=timezone.utc).timestamp()
    head = report_live.watch_view(tmp_path, now=now).splitlines()[0]
    assert "0:01:00 elapsed, 0:19:30 to go" in head, head
    with log.open("a") as f:
        f.write("2026-12-03T10:08:00.000+0000 DONE baseline_d4_s1 completed\n"
                "2026-12-03T10:08:01.000+0000 LAUNCH hc_d4_s1 gpus=cpu attempt=1\n"
                "2026-12-03T10:20:00.000+0000 DONE hc_d4_s1 completed\n"
                "2026-12-03T10:20:00.000+0000 END all 2 runs finished\n")
    later = datetime(2026, 12, 3, 11, 0, tzinfo=timezone.utc).timestamp()
    head = report_live.watch_view(tmp_path, now=later).splitlines()[0]
    assert "2 done, 0 running, 0 queued, 0 failed; 0:20:00 elapsed (ended), 0:00:00 to go" in head, head
