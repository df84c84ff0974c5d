"""report.py, the entry point: run as a script, and imported without side effects."""
import subprocess
import sys
from pathlib import Path

from hand_written_runs import hc_seed1


ROOT = Path(__file__).resolve().parents[2]


def test_cli_prints_table_and_has_no_traceback(tmp_path):
    empty = subprocess.run([sys.executable, str(ROOT / "report.py"), str(tmp_path)],
                           capture_output=True, text=True)
    assert empty.returncode == 2 and "Traceback" not in empty.stderr
    hc_seed1(tmp_path)
    done = subprocess.run([sys.executable, str(ROOT / "report.py"), str(tmp_path), "--no-plots"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "| HC | 4 | 1/1 |" in done.stdout and "**depth 4**" in done.stdout


def test_import_has_no_side_effects(tmp_path):
    code = "import sys, report; assert 'matplotlib' not in sys.modules; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert res.stdout == "ok\n" and res.stderr == ""
    assert list(tmp_path.iterdir()) == []
