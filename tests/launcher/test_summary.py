"""hcstudy/launcher/summary.py: --summary and the end-of-matrix report."""
from pathlib import Path

from launcher_harness import events, launch, launcher_env, needs_bash


ROOT = Path(__file__).resolve().parents[2]
pytestmark = needs_bash


def test_summary_runs_nothing_and_shows_the_report(tmp_path):
    out = tmp_path / "runs"
    args = ("--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0")
    for missing_or_empty in (out, tmp_path):
        r = launch(tmp_path, "--summary", *args, "--out", missing_or_empty)
        assert r.returncode == 2 and "no matrix has run in" in r.stderr and "not started" not in r.stdout
    assert not out.exists()
    assert launch(tmp_path, *args).returncode == 0
    report = tmp_path / "report.py"
    report.write_text("import pathlib, sys\nprint('RESULTS TABLE')\n"
                      "(pathlib.Path(sys.argv[1]) / 'plots').mkdir()\n"
                      "(pathlib.Path(sys.argv[1]) / 'plots' / 'amax.png').write_bytes(b'')\n")
    r = launch(tmp_path, "--summary", *args, env=launcher_env(tmp_path, RUN_EXPERIMENTS_REPORT=report))
    assert r.returncode == 0
    assert "hc_d2_s1" in r.stdout and "completed" in r.stdout
    assert "RESULTS TABLE" in r.stdout and "amax.png" in r.stdout
    assert len(events(out, "START")) == 1, "--summary must not start a matrix"


def test_summary_of_a_run_with_a_step_beyond_int64_has_no_traceback(tmp_path):
    run = tmp_path / "runs" / "hc_d2_s1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 9223372036854775808, "loss": 1.0}\n')
    (run / "status.json").write_text('{"state": "running", "step": 1}')
    env = launcher_env(tmp_path, RUN_EXPERIMENTS_REPORT=ROOT / "report.py")
    r = launch(tmp_path, "--summary", env=env)
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert "step beyond 2**63 - 1, line skipped" in r.stderr
