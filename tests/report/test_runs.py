"""hcstudy/report/runs.py: run folders read defensively (half-written, malformed, resumed, killed, copied, not
regular files): one warning each, never a traceback or a hang."""
import csv
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from hcstudy.report import aggregate
from hcstudy.report import command
from hcstudy.report import live as report_live

from hand_written_runs import hc_seed1, hc_seed2, killed_matrix, probe, table_cells, train, write_run


ROOT = Path(__file__).resolve().parents[2]


def test_status_updated_extends_wall_time(tmp_path):
    write_run(tmp_path, "hc_d4_s1", [train(1, 100.0, 3.0, 0.5, 10), train(2, 200.0, 3.0, 0.5, 20)],
              updated=260.0)
    (row,) = aggregate.collect(tmp_path)
    assert row.runs[0].wall_s == pytest.approx(160.0)


def test_truncated_last_line_and_no_eval(tmp_path, capsys):
    write_run(tmp_path, "baseline_d4_s1", [
        {**train(1, 0.0, 4.0, 0.5, 10), **probe(1.0, 1.0)},
        {**train(2, 1.0, 3.0, 0.5, 20), **probe(1.0, 1.0)},
    ], state="running", tail='{"step": 3, "time": 2.0, "loss": 99.0, "grad_no')
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    out, err = capsys.readouterr()
    assert "unreadable" not in err          # a half-written last line is expected, not warned about
    c = table_cells(tmp_path / "report", "baseline", 4)
    assert c["final train loss"] == "3.000 (1 seed)"
    assert c["best val loss"] == "–" and c["final val loss"] == "–"
    assert c["seeds done/total"] == "0/1"
    assert "No val loss logged yet" in out


def test_garbage_line_in_the_middle_is_skipped_with_a_warning(tmp_path, capsys):
    d = write_run(tmp_path, "hc_d4_s1", [train(1, 0.0, 4.0, 0.5, 10)])
    with open(d / "metrics.jsonl", "a") as f:
        f.write("not json\n\n" + json.dumps(train(2, 1.0, 2.0, 0.5, 20)) + "\n")
    (row,) = aggregate.collect(tmp_path)
    assert row.stats["final_loss"].mean == 2.0
    assert "skipped 1 unreadable" in capsys.readouterr().err


def test_run_without_config_uses_the_run_name(tmp_path):
    write_run(tmp_path, "mhc_d12_s7", [train(1, 0.0, 4.0, 0.5, 10)], state="running", with_config=False)
    (row,) = aggregate.collect(tmp_path)
    assert (row.method, row.depth, row.runs[0].seed) == ("mhc", 12, 7)


def test_resumed_run_replaces_relogged_steps(tmp_path):
    write_run(tmp_path, "hc_d4_s1", [
        train(1, 0.0, 4.0, 0.5, 10), train(2, 1.0, 3.0, 5.0, 20), train(3, 2.0, 2.5, 9.0, 30),
        train(2, 100.0, 3.0, 0.4, 20), train(3, 101.0, 2.0, 0.3, 30), train(4, 102.0, 1.5, 0.2, 40)])
    (row,) = aggregate.collect(tmp_path)
    run = row.runs[0]
    assert run.peak_grad_norm == 0.5                 # the crashed attempt's 5.0 and 9.0 were replaced
    assert run.clip_share == 0.0
    assert run.wall_s == pytest.approx(2.0 + 2.0)    # two segments, the gap between them not counted


def test_a_run_found_twice_is_refused_with_both_paths(tmp_path, capsys):
    hc_seed1(tmp_path / "node0"), hc_seed2(tmp_path / "node0")
    copy = write_run(tmp_path / "node1", "hc_d4_s1", [train(1, 0.0, 4.0, 0.5, 10)], state="interrupted")
    assert command.main([str(tmp_path / "node0"), str(tmp_path / "node1"), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"report: one run found twice: {tmp_path / 'node0' / 'hc_d4_s1'} (completed at step 4) "
                          f"and {copy} (interrupted at step 1); keep one") and "\n" not in err
    assert not (tmp_path / "report").exists()
    # under another name, found in the parent folder: the same method, depth, seed and preset
    copy.rename(copy.with_name("hc_d4_s1_rerun"))
    assert command.main([str(tmp_path), "--no-plots"]) == 2
    assert f"and {copy.with_name('hc_d4_s1_rerun')} (interrupted" in capsys.readouterr().err
    config = json.loads((copy.with_name("hc_d4_s1_rerun") / "config.json").read_text())
    config["config"]["preset"] = "stress"                    # another arm: a run of its own
    (copy.with_name("hc_d4_s1_rerun") / "config.json").write_text(json.dumps(config))
    assert command.main([str(tmp_path), str(tmp_path / "node0"), "--no-plots"]) == 0      # overlapping: read once
    assert [len(row.runs) for row in aggregate.collect(tmp_path, tmp_path / "node0")] == [2, 1]


def test_reading_is_streaming_and_fast(tmp_path):
    """10k training lines with a probe every 10 steps: one pass, well under a second normally."""
    lines = []
    for step in range(1, 10_001):
        rec = train(step, float(step), 3.0, 0.5, step)
        if step % 10 == 0:
            rec.update(probe(1.0 + step / 1e4, 1.0))
        lines.append(rec)
    write_run(tmp_path, "hc_d48_s1", lines)
    start = time.perf_counter()
    (row,) = aggregate.collect(tmp_path)
    elapsed = time.perf_counter() - start
    assert row.stats["peak_fwd"].mean == pytest.approx(2.0)
    assert elapsed < 3.0, f"reading 10k lines took {elapsed:.2f} s"


def test_malformed_metrics_are_named_with_the_file_and_line(tmp_path, capsys):
    """An empty file, all-NaN values, strings, negative and repeated steps: each one warning naming where."""
    write_run(tmp_path, "hc_d4_s1", [])
    nan = write_run(tmp_path, "hc_d4_s2", [train(1, 0.0, math.nan, 0.5, 10), train(2, 1.0, None, 0.5, 20)])
    odd = write_run(tmp_path, "mhc_d4_s1", [
        train(1, 0.0, 4.0, 0.5, 10), {**train(2, 1.0, "abc", 0.5, 20)}, train(-3, 2.0, 1.0, 0.5, 30),
        train(3, 3.0, 2.0, 0.5, 30), train(3, 4.0, 1.5, 0.5, 30)])
    rows = aggregate.collect(tmp_path)
    err = capsys.readouterr().err
    assert f"{tmp_path / 'hc_d4_s1' / 'metrics.jsonl'}: empty, no step logged yet" in err
    assert f"{nan / 'metrics.jsonl'}: every loss value (2) is NaN, infinite or missing" in err
    assert f"{odd / 'metrics.jsonl'}:2: loss is not a number ('abc'), read as missing" in err
    assert f"{odd / 'metrics.jsonl'}:3: negative step, line skipped" in err
    assert f"{odd / 'metrics.jsonl'}:5: step 3 logs loss a second time; the later value is kept" in err
    mhc = next(row for row in rows if row.method == "mhc")
    assert mhc.runs[0].final_loss == 1.5                  # the later of the two step-3 lines
    capsys.readouterr()
    hc_seed1(tmp_path / "clean")                          # val on its own line at a training step: no warning
    aggregate.collect(tmp_path / "clean")
    assert capsys.readouterr().err == ""


JUNK = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**20),
                 st.text(max_size=5), st.booleans(), st.lists(st.floats(), max_size=3), st.just({}))


METRIC_LINE = st.one_of(
    st.fixed_dictionaries({"step": st.integers(-3, 6)},
                          optional={k: JUNK for k in ("time", "loss", "grad_norm", "clipped", "val_loss", "amax_fwd",
                                                       "amax_bwd", "tokens", "layer_gain_fwd")}).map(json.dumps),
    st.sampled_from(["", "not json", '{"step": "x"}', "[]", '{"loss": 1}', '{"step": 1, "time": "yesterday"}']))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(METRIC_LINE, max_size=8), min_size=1, max_size=3), st.sampled_from(["hc", "mhc", "baseline"]))
def test_random_metrics_files_give_a_report_never_a_traceback(tmp_path_factory, files, method):
    """Any mix of malformed lines and values in any number of runs: a table (exit 0), never a traceback."""
    root = tmp_path_factory.mktemp("fuzz")
    for seed, lines in enumerate(files):
        write_run(root, f"{method}_d4_s{seed}", [])
        (root / f"{method}_d4_s{seed}" / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    assert command.main([str(root), "--no-plots"]) == 0


HOLD_LOCK = ("import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', "
             "flush=True); time.sleep(600)")


def state_cells(root):
    """The run's state in runs.csv and in results.md's table of runs."""
    (row,) = csv.DictReader(open(root / "report" / "runs.csv"))
    cells = [line for line in (root / "report" / "results.md").read_text().splitlines()
             if line.startswith("| hc_d4_s1 |")]
    return row["state"], cells[0].split(" | ")[1]


def test_a_run_killed_on_this_host_reads_stopped_once_no_process_holds_its_lock(tmp_path):
    """kill -9 leaves status.json saying running; the kernel drops the trainer's lock (RUN/.lock) at once."""
    d = killed_matrix(tmp_path, host=socket.gethostname())
    trainer = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(d / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "held"
        assert command.main([str(tmp_path), "--no-plots"]) == 0
        assert state_cells(tmp_path) == ("running", "running")
        assert "1 running, 0 queued" in report_live.watch_view(tmp_path).splitlines()[0]
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    known = "stopped (killed?) at step 21, last checkpoint step-20: no process holds its lock on this host"
    assert state_cells(tmp_path) == ("stopped (killed?)", known)
    assert "(1 stopped (killed?))" in (tmp_path / "report" / "results.md").read_text()          # the verdict
    head, _, row, *_ = report_live.watch_view(tmp_path).splitlines()
    assert "0 done, 0 running, 0 queued, 0 failed, 1 stopped (killed?);" in head, head
    assert row.split()[:2] == ["0", "hc_d4_s1"] and row.endswith(known), row
    trainer = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(d / ".lock")], stdout=subprocess.PIPE, text=True)
    try:                         # the view's look at the lock never kept a trainer from taking it
        assert trainer.stdout.readline().strip() == "held"
    finally:
        trainer.kill()
        trainer.wait()


@pytest.mark.parametrize("stale_after, state", [(30, "stale (killed?)"), (60, "running")])
def test_a_run_on_another_host_reads_stale_once_its_status_is_older_than_stale_after(tmp_path, stale_after, state):
    """Another node's lock cannot be read from here: status.json's age is what is known."""
    d = killed_matrix(tmp_path, host="node-7")
    record = json.loads((d / "status.json").read_text())
    (d / "status.json").write_text(json.dumps(record | {"updated": time.time() - 40 * 60}))
    assert command.main([str(tmp_path), "--no-plots", "--stale-after", str(stale_after)]) == 0
    known = ("stale (killed?) at step 21, last checkpoint step-20: status.json unchanged for 40 min (written on "
             "node-7)")
    assert state_cells(tmp_path) == (state, known if state != "running" else "running")
    head = report_live.watch_view(tmp_path, stale_after_min=stale_after).splitlines()[0]
    assert ("0 running" if state != "running" else "1 running") in head, head


@pytest.mark.parametrize("line, warning", [
    ('{"step": 9223372036854775808, "loss": 1.0}', "step beyond 2**63 - 1, line skipped"),
    ('{"step": "3", "loss": 1.0}', "skipped 1 unreadable metrics line(s)"),
    ("[" * 60_000 + "]" * 60_000, "skipped 1 unreadable metrics line(s)"),
])
def test_an_out_of_range_last_line_is_kept_out_with_a_warning(tmp_path, line, warning):
    hc_seed1(tmp_path)
    with open(tmp_path / "hc_d4_s1" / "metrics.jsonl", "a") as f:
        f.write(line + "\n")
    done = subprocess.run([sys.executable, str(ROOT / "report.py"), str(tmp_path), "--no-plots"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count(warning) == 1 and "| HC | 4 | 1/1 |" in done.stdout, done.stderr


def test_a_fifo_is_not_read_and_never_blocks(tmp_path):
    d = hc_seed1(tmp_path)
    for name in ("metrics.jsonl", "status.json"):
        (d / name).unlink()
        os.mkfifo(d / name)
    done = subprocess.run([sys.executable, str(ROOT / "report.py"), str(tmp_path), "--no-plots"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("not a regular file") == 2


def test_a_residual_or_state_that_is_none_the_trainer_writes_stays_out_of_the_table(tmp_path, capsys):
    write_run(tmp_path, "hc_d4_s1", [{**train(1, 0.0, 4.0, 0.5, 10), **probe(1.0, 1.0)}], config={"residual": "nope"})
    d = write_run(tmp_path, "mhc_d4_s1", [{**train(1, 0.0, 4.0, 0.5, 10), **probe(1.0, 1.0)}])
    (d / "status.json").write_text(json.dumps({"state": ["x"], "step": 1}))
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    out, err = capsys.readouterr()
    assert err.count("residual 'nope' is none of baseline, hc, mhc") == 1
    assert err.count("state \"['x']\" is none of running") == 1
    assert "nope" not in out and "['x']" not in out and "| mHC | 4 |" in out
