"""hcstudy/contract.py: every format two processes share, written with one end and read with the other (matrix.log:
the launcher's Log and the report's live view; --plan-jobs: the launcher's request and train_c4.py's answer; the
JSON files of a run folder). The GPU check's result.json: test_gpu_check.py; durations: test_durations.py."""
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from hcstudy import contract  # noqa: E402
from hcstudy.launcher import dry_run, jobs, options, queue  # noqa: E402
from hcstudy.report import live  # noqa: E402


def test_matrix_log_written_by_the_launcher_is_read_by_the_report(tmp_path, capsys):
    log = queue.Log(tmp_path / contract.MATRIX_LOG)
    log("START", "run_experiments.sh pid=1 data=preset c4 default extra=")
    log("QUEUE", slots=2, gpus_per_run=1, gpus="0,1", price_per_gpu_hour="2.49", runs="hc_d2_s1,mhc_d2_s1,hc_d2_s2",
        planned_s="hc_d2_s1:60,mhc_d2_s1:90")
    log("LAUNCH", "cmd: CUDA_VISIBLE_DEVICES=0 python train_c4.py --gpus=9", "hc_d2_s1", gpus="0", attempt=1)
    log("LAUNCH", "cmd: CUDA_VISIBLE_DEVICES=1 python train_c4.py", "mhc_d2_s1", gpus="1", attempt=1)
    log("EXIT", "(trainer code 4 from status.json)", "hc_d2_s1", code=1, gpus="0")
    log("RETRY", "out of memory at micro-batch 8: retrying once", "hc_d2_s1")
    log("DONE", "completed", "mhc_d2_s1")
    assert "DONE mhc_d2_s1 completed" in capsys.readouterr().out        # the terminal gets the same lines
    matrix = live.read_matrix(tmp_path)
    assert matrix.runs == {"hc_d2_s1": ["queued", "0"], "mhc_d2_s1": ["done", "1"], "hc_d2_s2": ["queued", ""]}
    assert (matrix.slots, matrix.gpus_per_run, matrix.price, matrix.cpu) == (2, 1, 2.49, False)
    assert matrix.planned == {"hc_d2_s1": 60.0, "mhc_d2_s1": 90.0} and matrix.ended is None
    assert abs(matrix.started - time.time()) < 60
    log("END", "all 3 runs finished (completed or diverged)")
    assert live.read_matrix(tmp_path).ended >= matrix.started


def test_a_log_line_splits_into_event_run_fields_and_text():
    line = contract.log_line("LAUNCH", "hc_d2_s1", "cmd: CUDA_VISIBLE_DEVICES=0 x --a=b", now=0.5, gpus="0,1",
                             attempt=2)
    read = contract.read_log_line(line)
    assert (read.event, read.run, read.fields) == ("LAUNCH", "hc_d2_s1", {"gpus": "0,1", "attempt": "2"})
    assert read.text == "cmd: CUDA_VISIBLE_DEVICES=0 x --a=b" and contract.log_time(read.stamp) == 0.5
    queue_line = contract.read_log_line(contract.log_line("QUEUE", slots=1, runs=""))
    assert queue_line.run is None and queue_line.fields == {"slots": "1", "runs": ""}
    assert contract.read_log_line("garbage") is None


def test_the_launchers_plan_request_is_answered_by_the_trainer_and_read_back(tmp_path, monkeypatch):
    monkeypatch.delenv("RUN_EXPERIMENTS_TRAINER", raising=False)
    monkeypatch.chdir(ROOT)
    opt = options.parse_options(["--demo", "--residual", "hc,mhc", "--out", str(tmp_path / "runs")])
    matrix = jobs.matrix_jobs(opt)
    answer = dry_run.plan_jobs(opt, matrix, dry_run.Node(["cpu"], "cpu"))
    assert answer["gpu"] == "cpu" and answer["assumptions"]
    assert list(answer["jobs"]) == [job.name for job in matrix] == ["hc_d4_s42", "mhc_d4_s42"]
    for planned in answer["jobs"].values():
        assert planned["error"] is None and planned["micro"] > 0 and planned["batch"] % planned["micro"] == 0
        assert planned["memory"] is None and planned["path"] in ("reference", "fused")      # a CPU plan
        assert len(planned["seconds"]) == 2 and planned["seconds"][0] <= planned["seconds"][1]
    # a flag the trainer refuses comes back as the job's error, and the launcher stops before any launch
    opt = options.parse_options(["--demo", "--residual", "hc", "--out", str(tmp_path / "runs"), "--", "--lr", "x"])
    with pytest.raises(dry_run.JobsRefused, match="train_c4.py refuses hc_d4_s42"):
        dry_run.plan_jobs(opt, jobs.matrix_jobs(opt), dry_run.Node(["cpu"], "cpu"))


def test_an_answer_with_unknown_keys_is_not_one():
    with pytest.raises(TypeError):
        contract.read_plan_answer('{"gpu": "cpu", "assumptions": [], "jobs": [{"micro": 2, "nonsense": 1}]}', ["a"])
    with pytest.raises(ValueError):     # one answer per job asked
        contract.read_plan_answer('{"gpu": "cpu", "assumptions": [], "jobs": []}', ["a"])


def test_json_files_read_with_an_explicit_default_and_written_whole(tmp_path):
    warned = []
    path = tmp_path / contract.STATUS_FILE
    assert contract.read_json(path, {}) == {} and contract.read_json(path) is None and not warned
    contract.write_json_atomic(path, {"state": "running", "step": 3})
    assert contract.read_json(path, {}) == {"state": "running", "step": 3}
    assert contract.read_json(path, {}, newer_than=time.time() + 60) == {}      # left from an earlier attempt
    assert not list(tmp_path.glob(".*.tmp"))
    path.write_text('{"state": "runn')                                           # half a file
    assert contract.read_json(path, {}, warned.append) == {} and "cannot read" in warned[-1]
    path.write_text("[1, 2]")
    assert contract.read_json(path, "none") == "none"
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)                     # would block a plain open()
    assert contract.read_json(fifo, {}, warned.append) == {} and "not a regular file" in warned[-1]


@pytest.mark.parametrize("lock", ["missing", "a link", "a FIFO", "a folder"])
def test_a_run_lock_that_is_no_plain_file_tells_nothing_and_is_never_opened_through(tmp_path, lock):
    """report.py reads whether a run is alive from its lock (run_lock_free): where no trainer's lock can be, it
    says nothing (None: the run is judged by status.json's age), never hangs on a FIFO nor follows a link."""
    target = tmp_path / "elsewhere"
    target.write_text("")
    path = tmp_path / contract.RUN_LOCK
    {"missing": lambda: None, "a link": lambda: path.symlink_to(target), "a FIFO": lambda: os.mkfifo(path),
     "a folder": path.mkdir}[lock]()
    assert contract.run_lock_free(tmp_path) is None
