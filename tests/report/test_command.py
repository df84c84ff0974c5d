"""hcstudy/report/command.py: report.py's command line, its exits and its folders (several runs folders, --out, --no-
plots, --watch); and two real tiny runs through it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hcstudy.report import aggregate
from hcstudy.report import command

from hand_written_runs import hc_seed1, hc_seed2, matrix_lines, mhc_probe, probe, table_cells, train, write_run


ROOT = Path(__file__).resolve().parents[2]


def test_results_open_with_a_headline_per_depth_then_a_main_table_of_at_most_8_columns(tmp_path):
    hc_seed1(tmp_path), hc_seed2(tmp_path)
    write_run(tmp_path, "mhc_d4_s1", [{**train(1, 0.0, 4.0, 0.5, 10), **mhc_probe(1.0, 1.0, 1e-7, 1.0)},
                                      {**train(2, 1.0, 3.0, 0.5, 20), **mhc_probe(1.145, 1.0000004, 0.031, 1.16)},
                                      {"step": 2, "time": 1.5, "val_loss": 3.1}])
    write_run(tmp_path, "baseline_d8_s1", [{**train(1, 0.0, 4.0, 0.5, 10), **probe(1.0, 1.0)}])
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    lines = (tmp_path / "report" / "results.md").read_text().splitlines()
    assert lines[2] == ("**depth 4** (1 to 2 seeds): HC amplifies 100× (above 10× at step 3 / 2); "
                        "mHC 1.000 (backward 1.145 from Sinkhorn truncation).  ")
    assert lines[3] == "Final val loss: HC 3.375, mHC 3.100."
    assert lines[5].startswith("**depth 8** (1 seed): baseline only.")
    table = next(i for i, line in enumerate(lines) if line.startswith("| method |"))
    assert lines[table - 2] == "## Table" and table < 12
    assert lines[table].count("|") - 1 <= 8
    assert table_cells(tmp_path / "report", "HC", 4, "## Table")["final val loss"] == "3.375 ± 0.177"
    text = "\n".join(lines)
    assert text.index("## Table") < text.index("## Amplification") < text.index("## Full table")


def test_empty_folder_exits_2_with_one_line(tmp_path, capsys):
    assert command.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("report: no runs found under") and "\n" not in err
    assert not (tmp_path / "report").exists()


def test_missing_folder_and_bad_arguments_exit_2(tmp_path, capsys):
    assert command.main([str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert command.main([str(tmp_path), "--no-such-flag"]) == 2
    assert "usage:" in capsys.readouterr().err
    hc_seed1(tmp_path)
    assert command.main([str(tmp_path), "--heatmap-run", "nope"]) == 2
    assert "no such run" in capsys.readouterr().err


def test_runs_folders_of_two_nodes_merge_into_the_report_of_one_folder(tmp_path):
    hc_seed1(tmp_path / "flat"), hc_seed2(tmp_path / "flat")
    hc_seed1(tmp_path / "all" / "node0"), hc_seed2(tmp_path / "all" / "node1")
    assert command.main([str(tmp_path / "flat"), "--no-plots"]) == 0
    assert command.main([str(tmp_path / "all" / "node0"), str(tmp_path / "all" / "node1")]) == 0
    assert command.main([str(tmp_path / "all"), "--out", str(tmp_path / "parent"), "--no-plots"]) == 0
    merged = tmp_path / "all" / "report"                     # the default --out: beside the node folders
    assert table_cells(merged, "HC", 4)["seeds done/total"] == "2/2"
    for name in ("results.csv", "runs.csv"):                 # every number as if the runs shared one folder
        expected = (tmp_path / "flat" / "report" / name).read_text()
        assert (merged / name).read_text() == (tmp_path / "parent" / name).read_text() == expected, name
    assert {p.name for p in merged.glob("*.png")} == {"amax.png", "loss.png", "grad_norm.png"}
    assert (merged / "results.md").read_text().startswith(f"# Results: {tmp_path / 'all' / 'node0'}, ")


def test_watch_reads_one_folder(tmp_path, capsys):
    assert command.main([str(tmp_path), str(tmp_path), "--watch"]) == 2
    assert capsys.readouterr().err.strip() == ("report: --watch reads one matrix folder (its matrix.log); pass one "
                                               "RUNS_DIR")


@pytest.mark.slow
def test_two_real_tiny_runs_are_reported(tmp_path):
    """The trainer's own output, not a hand-written imitation, goes through the report."""
    runs = tmp_path / "runs"
    for residual in ("hc", "mhc"):
        result = subprocess.run([sys.executable, str(ROOT / "train_c4.py"), "--preset", "tiny", "--residual", residual,
                                 "--out", str(runs)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
    assert command.main([str(runs), "--out", str(tmp_path / "report")]) == 0
    rows = {row.method: row for row in aggregate.collect(runs)}
    assert set(rows) == {"hc", "mhc"} and all(row.depth == 2 for row in rows.values())
    mhc_metrics = [json.loads(line) for line in (runs / "mhc_d2_s42" / "metrics.jsonl").read_text().splitlines()]
    peak = max(m["amax_fwd"] for m in mhc_metrics if "amax_fwd" in m)
    assert table_cells(tmp_path / "report", "mHC", 2)["peak amax_fwd"].startswith(f"{peak:.3f}"[:4])
    for png in ("amax.png", "loss.png", "grad_norm.png", "layer_gains.png"):
        data = (tmp_path / "report" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_no_plots_leaves_no_plot_of_an_earlier_report(tmp_path):
    for method, scale in (("baseline", 1.0), ("hc", 300.0)):
        write_run(tmp_path, f"{method}_d4_s1", matrix_lines(method, scale))
    assert command.main([str(tmp_path)]) == 0
    assert (tmp_path / "report" / "amax.png").exists()
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    assert not list((tmp_path / "report").glob("*.png"))
    assert "plots skipped (--no-plots)" in (tmp_path / "report" / "results.md").read_text()
