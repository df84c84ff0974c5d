"""report.py on hand-written run folders: every number in the table is checked against a value
computed by hand here (not by report.py's own helpers)."""
import csv
import fcntl
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from hcstudy.report import aggregate  # noqa: E402
from hcstudy.report import command  # noqa: E402
from hcstudy.report import live as report_live  # noqa: E402
from hcstudy.report import plots  # noqa: E402
from hcstudy.report import published  # noqa: E402
from hcstudy.report import runs as report_runs  # noqa: E402
from hcstudy.report import verdict  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --- writing run folders -----------------------------------------------------------------------

def write_run(root, name, lines, state="completed", config=None, world_size=1, device="cuda",
              tail="", with_config=True, updated=None, device_at_top=False):
    """A run folder as train_c4.py writes it; `tail` is appended raw (e.g. a half-written line)."""
    method, depth, seed = name.split("_")
    d = root / name
    d.mkdir(parents=True)
    if with_config:
        cfg = {"residual": method, "depth": int(depth[1:]), "seed": int(seed[1:]), "width": 64, "steps": 10,
               "batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "expansion": 4, "run_name": name,
               "grad_clip": 1.0, **(config or {})}
        record = {"config": cfg, "n_params": 1000, "world_size": world_size, "versions": {}, "git_commit": "x"}
        (record if device_at_top else cfg)["device"] = device       # train_c4.py writes it at the top
        (d / "config.json").write_text(json.dumps(record))
    text = "".join(json.dumps(rec) + "\n" for rec in lines) + tail     # json writes NaN/Infinity
    (d / "metrics.jsonl").write_text(text)
    last = max((rec["step"] for rec in lines), default=0)
    (d / "status.json").write_text(json.dumps({"state": state, "step": last, "exit_code": 0,
                                               "reason": None, "updated": updated}))
    return d


def probe(fwd, bwd, l0f=1.0, l0b=1.0):
    return {"amax_fwd": fwd, "amax_bwd": bwd, "amax_l0_fwd": l0f, "amax_l0_bwd": l0b,
            "amax_fwd_abs": fwd, "amax_bwd_abs": bwd, "min_row_sum": 1.0, "min_col_sum": 1.0}


def train(step, t, loss, gn, tokens):
    return {"step": step, "time": t, "loss": loss, "lr": 1e-4, "grad_norm": gn, "clipped": gn > 1.0,
            "tokens": tokens, "tokens_per_s": 10.0, "mfu": None, "mem_peak_gb": None}


def hc_seed1(root):
    """Training + probe lines share a step; val on its own lines. Time span 31 s."""
    return write_run(root, "hc_d4_s1", [
        {**train(1, 1000.0, 5.0, 2.0, 100), **probe(1.0, 1.0)},
        train(2, 1010.0, 4.0, 0.5, 200),
        {"step": 2, "time": 1011.0, "val_loss": 4.5},
        {**train(3, 1020.0, 3.0, 3.0, 300), **probe(12.0, 5.0, 1.5, 1.2)},
        {**train(4, 1030.0, 2.0, 0.9, 400), **probe(150.0, 120.0, 1.4, 1.3)},
        {"step": 4, "time": 1031.0, "val_loss": 3.5},
    ])


def hc_seed2(root):
    """The 10x level is crossed by amax_bwd only (step 2); 100x never; val best before final."""
    return write_run(root, "hc_d4_s2", [
        {**train(1, 2000.0, 6.0, 0.5, 100), **probe(1.0, 1.0)},
        {**train(2, 2010.0, 3.0, 4.0, 200), **probe(8.0, 11.0, 1.1, 1.0)},
        {"step": 2, "time": 2011.0, "val_loss": 3.0},
        {**train(3, 2020.0, 3.5, 0.8, 300), **probe(50.0, 40.0, 1.7, 1.9)},
        train(4, 2030.0, 3.0, 0.7, 400),
        {"step": 4, "time": 2041.0, "val_loss": 3.25},
    ])


def table_cells(out_dir, label, depth, section="## Full table"):
    """{header: cell} of the row `label` (e.g. 'HC') at `depth` of the first table after `section` in results.md."""
    lines = (out_dir / "results.md").read_text().split(section + "\n", 1)[1].splitlines()
    header = next(ln for ln in lines if ln.startswith("| method |"))
    heads = [h.strip() for h in header.strip("|").split("|")]
    for ln in lines:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if len(cells) == len(heads) and cells[0] == label and cells[1] == str(depth):
            return dict(zip(heads, cells))
    raise AssertionError(f"no row {label} depth {depth} in results.md")


def sample_std(a, b):
    return abs(a - b) / math.sqrt(2)      # ddof=1 standard deviation of two values


# --- numbers -----------------------------------------------------------------------------------

def test_rows_match_hand_computed_values(tmp_path):
    hc_seed1(tmp_path), hc_seed2(tmp_path)
    (row,) = aggregate.collect(tmp_path)
    assert (row.method, row.depth, row.done, len(row.runs)) == ("hc", 4, 2, 2)
    expect = {  # field: (seed 1, seed 2)
        "final_loss": (2.0, 3.0), "best_val": (3.5, 3.0), "final_val": (3.5, 3.25),
        "peak_fwd": (150.0, 50.0), "peak_bwd": (120.0, 40.0), "peak_l0_fwd": (1.5, 1.7),
        "peak_l0_bwd": (1.3, 1.9), "peak_grad_norm": (3.0, 4.0), "clip_share": (0.5, 0.25),
        "tokens": (400, 400)}
    for name, (a, b) in expect.items():
        st = row.stats[name]
        assert st.n == 2, name
        assert st.mean == pytest.approx((a + b) / 2), name
        assert st.std == pytest.approx(sample_std(a, b)), name
    s1, s2 = row.runs
    assert s1.first_above == {10.0: 3, 100.0: 4, 1000.0: None}
    assert s2.first_above == {10.0: 2, 100.0: None, 1000.0: None}
    assert s1.wall_s == pytest.approx(31.0) and s2.wall_s == pytest.approx(41.0)


def test_markdown_table_cells(tmp_path):
    hc_seed1(tmp_path), hc_seed2(tmp_path)
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    c = table_cells(tmp_path / "report", "HC", 4)
    assert c["seeds done/total"] == "2/2"
    assert c["final train loss"] == "2.500 ± 0.707"
    assert c["best val loss"] == "3.250 ± 0.354"
    assert c["final val loss"] == "3.375 ± 0.177"
    assert c["peak amax_fwd"] == "100 ± 71"
    assert c["peak amax_bwd"] == "80.0 ± 56.6"
    assert c["amax_fwd per seed"] == "150 / 50.0"
    assert c["amax_bwd per seed"] == "120 / 40.0"
    assert c["first >10× step (per seed)"] == "3 / 2"
    assert c["first >100× step (per seed)"] == "4 / never"
    assert c["peak amax_l0_fwd"] == "1.600 ± 0.141"
    assert c["peak amax_l0_bwd"] == "1.600 ± 0.424"
    assert c["peak grad norm (pre-clip)"] == "3.500 ± 0.707"
    assert c["clipped steps"] == "37.5% ± 17.7%"
    assert c["diverged"] == "0"
    assert c["tokens/run"] == "400"
    # wall (31 s + 41 s) / 2 per run; 1 GPU each -> (31 + 41) / 3600 GPU-hours in total
    assert c["wall h/run"] == "0.01 ± 0.00"
    assert c["GPU-h total"] == "0.02"
    assert not list((tmp_path / "report").glob("*.png"))          # --no-plots
    rows = list(csv.DictReader(open(tmp_path / "report" / "results.csv")))
    assert float(rows[0]["gpu_hours"]) == pytest.approx(72 / 3600)
    assert rows[0]["first_above_100_per_seed"] == "4;never"


def test_single_seed_says_1_seed_not_a_dash_for_its_std(tmp_path):
    hc_seed1(tmp_path)
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    c = table_cells(tmp_path / "report", "HC", 4)
    assert c["final train loss"] == "2.000 (1 seed)"
    assert c["peak amax_fwd"] == "150 (1 seed)"
    assert "± –" not in (tmp_path / "report" / "results.md").read_text()
    (row,) = aggregate.collect(tmp_path)
    assert math.isnan(row.stats["final_loss"].std)


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


def mhc_probe(used_bwd, converged_bwd, col_err, bound):
    return {**probe(1.0, used_bwd), "amax_study": used_bwd, "amax_fwd_converged": 1.0,
            "amax_bwd_converged": converged_bwd, "sinkhorn_col_err": col_err, "sinkhorn_bwd_bound": bound}


def test_mhc_over_two_seeds_gives_its_sinkhorn_errors_with_their_spread(tmp_path):
    """Every table's cells over seeds, the truncation columns too (a std was passed to a one-argument format)."""
    for seed, col_err in ((1, 0.031), (2, 0.045)):
        write_run(tmp_path, f"mhc_d4_s{seed}", [{**train(1, 0.0, 4.0, 0.5, 10), **mhc_probe(1.1, 1.0, col_err, 1.2)}])
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    cells = table_cells(tmp_path / "report", "mHC", 4, "## Amplification: three readings")
    assert cells["mHC Sinkhorn column error"] == "0.038 ± 0.0099"


def test_threshold_must_be_exceeded_not_reached(tmp_path):
    write_run(tmp_path, "hc_d4_s1", [
        {**train(1, 0.0, 4.0, 0.5, 10), **probe(10.0, 9.0)},
        {**train(2, 1.0, 3.0, 0.5, 20), **probe(100.0, 10.5)},
        {**train(3, 2.0, 3.0, 0.5, 30), **probe(99.0, 100.5)}])
    (row,) = aggregate.collect(tmp_path)
    assert row.runs[0].first_above == {10.0: 2, 100.0: 3, 1000.0: None}


def test_gpu_hours_world_size_cpu_and_pauses(tmp_path):
    gap = report_runs.GAP_S
    lines = [train(1, 0.0, 3.0, 0.5, 10), train(2, gap, 3.0, 0.5, 20), train(3, 2 * gap, 3.0, 0.5, 30),
             train(4, 3 * gap + 1, 3.0, 0.5, 40),       # requeued: a pause over GAP_S is not counted
             train(5, 3 * gap + 601, 3.0, 0.5, 50)]
    write_run(tmp_path, "mhc_d4_s1", lines, world_size=8)
    write_run(tmp_path, "mhc_d8_s1", lines[:3], device="cpu")
    write_run(tmp_path, "hc_d8_s1", lines[:3], device="cpu", device_at_top=True, world_size=1)
    rows = {(r.method, r.depth): r for r in aggregate.collect(tmp_path)}
    assert rows["mhc", 4].runs[0].wall_s == pytest.approx(2 * gap + 600)
    assert rows["mhc", 4].gpu_hours == pytest.approx((2 * gap + 600) / 3600 * 8)
    assert rows["mhc", 8].runs[0].wall_s == pytest.approx(2 * gap)
    assert rows["mhc", 8].gpu_hours == 0 and rows["mhc", 8].cpu_only
    assert rows["hc", 8].gpu_hours == 0 and rows["hc", 8].cpu_only
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    assert table_cells(tmp_path / "report", "mHC", 8)["GPU-h total"] == "cpu"
    assert table_cells(tmp_path / "report", "mHC", 4)["GPU-h total"] == "5.33"   # 2400 s x 8 GPUs
    assert table_cells(tmp_path / "report", "HC", 8)["GPU-h total"] == "cpu"


def test_status_updated_extends_wall_time(tmp_path):
    write_run(tmp_path, "hc_d4_s1", [train(1, 100.0, 3.0, 0.5, 10), train(2, 200.0, 3.0, 0.5, 20)],
              updated=260.0)
    (row,) = aggregate.collect(tmp_path)
    assert row.runs[0].wall_s == pytest.approx(160.0)


# --- tolerated input ---------------------------------------------------------------------------

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


def test_diverged_run_is_listed_as_diverged(tmp_path):
    hc_seed1(tmp_path)
    write_run(tmp_path, "hc_d4_s2", [
        {**train(1, 0.0, 5.0, 0.5, 10), **probe(1.0, 1.0)},
        {**train(2, 1.0, 4.0, 50.0, 20), **probe(900.0, 800.0)},
        {"step": 2, "time": 1.5, "val_loss": 3.9},
        {**train(3, 2.0, float("nan"), float("inf"), 30), **probe(float("inf"), float("nan"))},
    ], state="diverged")
    assert "NaN" in (tmp_path / "hc_d4_s2" / "metrics.jsonl").read_text()
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    c = table_cells(tmp_path / "report", "HC", 4)
    assert c["diverged"] == "1: s2@3"
    assert c["seeds done/total"] == "1/2"
    assert c["final train loss"] == "2.000 (1 seed)"
    assert c["final val loss"] == "3.500 (1 seed)"      # the diverged run's last val is left out
    assert c["best val loss"] == "3.700 ± 0.283"        # but its best val counts: (3.5 + 3.9) / 2
    assert c["peak amax_fwd"] == "inf"
    assert c["peak amax_bwd"] == "460 ± 481"       # (120 + 800) / 2 ± 680 / sqrt(2), NaN ignored
    text = (tmp_path / "report" / "results.md").read_text()
    assert "| hc_d4_s2 | diverged | 3 |" in text
    assert "1 of 2 HC runs diverged" in text
    assert "composite forward gain peaked at inf× (non-finite in at least one of 2 seeds" in text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=8))
def test_stat_is_mean_and_sample_std(values):
    got = aggregate.Stat.of(values)
    assert got.n == len(values)
    assert got.mean == pytest.approx(statistics.fmean(values), rel=1e-9, abs=1e-6)
    if len(values) > 1:
        assert got.std == pytest.approx(statistics.stdev(values), rel=1e-6, abs=1e-6)
    else:
        assert math.isnan(got.std)


def test_plot_curves_average_seeds_step_by_step():
    a = (np.array([1, 2, 3]), np.array([1.0, 2.0, 3.0]))
    b = (np.array([2, 3, 4]), np.array([4.0, np.nan, 8.0]))      # NaN is skipped, not averaged
    band = plots.bin_curves([a, b])
    assert band.x.tolist() == [1, 2, 3, 4]
    assert band.line.tolist() == [1.0, 3.0, 3.0, 8.0]
    assert band.seed_lo.tolist() == [1.0, 2.0, 3.0, 8.0] and band.seed_hi.tolist() == [1.0, 4.0, 3.0, 8.0]
    long = (np.arange(1000), np.arange(1000, dtype=float))
    band = plots.bin_curves([long], window=100)
    assert band.x.size == 10 and band.line[0] == pytest.approx(np.mean(np.arange(100)), abs=1.0)


# --- verdict -----------------------------------------------------------------------------------

def test_verdict_states_numbers_and_missing_methods(tmp_path):
    hc_seed1(tmp_path), hc_seed2(tmp_path)
    for seed, dev in ((1, 0.0005), (2, 0.002)):
        write_run(tmp_path, f"mhc_d4_s{seed}", [
            {**train(1, 0.0, 4.0, 0.5, 10), **probe(1.0, 1.0 + dev)},
            {**train(2, 1.0, 3.0, 0.5, 20), **probe(1.0, 1.0 - dev / 2)}])
    write_run(tmp_path, "baseline_d8_s1", [{**train(1, 0.0, 4.0, 0.5, 10), **probe(1.0, 1.0)}])
    lines = verdict.verdict(aggregate.collect(tmp_path))
    d4, d8 = lines
    assert d4.startswith("**depth 4**")
    assert "HC: composite forward gain peaked at 100× (mean of 2 seeds, ± 71 sample std; " \
           "highest 150× in seed 1)" in d4
    assert "first above 10× at step 3 / 2 (per seed); first above 100× at step 4 / never (per seed)" in d4
    assert "mHC: composite gains stayed within 1 ± 0.002" in d4
    assert "No baseline runs at depth 4." in d4
    assert "baseline: 1 by definition" in d8
    assert "No HC runs at depth 8." in d8 and "No mHC runs at depth 8." in d8


def test_amplification_table_shows_the_three_readings_and_mhc_truncation(tmp_path):
    hc_seed1(tmp_path)
    with_study = tmp_path / "hc_d4_s1" / "metrics.jsonl"
    with_study.write_text(with_study.read_text() + json.dumps({"step": 5, "time": 1040.0, **probe(160.0, 100.0),
                                                               "amax_fwd_abs": 300.0, "amax_study": 240.0}) + "\n")
    write_run(tmp_path, "mhc_d4_s1", [{**train(1, 0.0, 4.0, 0.5, 10), **mhc_probe(1.0, 1.0, 1e-7, 1.0)},
                                      {**train(2, 1.0, 3.0, 0.5, 20), **mhc_probe(1.145, 1.0000004, 0.031, 1.16)}])
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    text = (tmp_path / "report" / "results.md").read_text()
    lines = text.split("## Amplification: three readings")[1].split("\n## ")[0]
    header = next(ln for ln in lines.splitlines() if ln.startswith("| method |"))
    heads = [h.strip() for h in header.strip("|").split("|")]
    rows = {ln.split("|")[1].strip(): dict(zip(heads, (c.strip() for c in ln.strip("|").split("|"))))
            for ln in lines.splitlines() if ln.startswith("| HC |") or ln.startswith("| mHC |")}
    hc, mhc = rows["HC"], rows["mHC"]
    assert (hc["amax_fwd (paper)"], hc["amax_bwd (paper)"], hc["abs-value bound"], hc["study recipe"]) == \
        ("160 (1 seed)", "120 (1 seed)", "300 (1 seed)", "240 (1 seed)")
    assert hc["first >100× (per seed)"] == "4" and hc["first >1000× (per seed)"] == "never"
    assert hc["mHC converged"] == "–"
    assert (mhc["amax_bwd (paper)"], mhc["mHC converged"], mhc["mHC Sinkhorn column error"],
            mhc["mHC truncation bound"]) == ("1.145 (1 seed)", "1.000 (1 seed)", "0.031 (1 seed)", "1.160 (1 seed)")
    (line,) = verdict.verdict(aggregate.collect(tmp_path))
    assert "the as-used backward gain (up to 1.145) stays under the bound 1.160 that Sinkhorn column errors " \
           "of up to 0.031 allow: its distance from 1 is truncation" in line


def test_mhc_gain_beyond_the_truncation_bound_is_not_explained_away(tmp_path):
    write_run(tmp_path, "mhc_d4_s1", [{**train(1, 0.0, 4.0, 0.5, 10), **mhc_probe(1.5, 1.0, 0.01, 1.02)}])
    (line,) = verdict.verdict(aggregate.collect(tmp_path))
    assert "exceeds the truncation bound: more than Sinkhorn truncation explains" in line


def test_arms_are_kept_apart_and_mixed_precision_is_flagged(tmp_path):
    write_run(tmp_path, "hc_d4_s1", [{**train(1, 0.0, 4.0, 0.5, 10), **probe(20.0, 20.0)}],
              config={"preset": "c4", "data_seed": 1234})
    stress = write_run(tmp_path, "hc_d4_s2", [{**train(1, 0.0, 4.0, 0.5, 10), **probe(900.0, 20.0)}],
                       config={"preset": "stress", "data_seed": 1234})
    record = json.loads((stress / "config.json").read_text())
    (stress / "config.json").write_text(json.dumps({**record, "precision": {"matmuls": "bf16"}}))
    rows = aggregate.collect(tmp_path)
    assert [(r.label, r.stats["peak_fwd"].mean) for r in rows] == [("HC [c4]", 20.0), ("HC [stress]", 900.0)]
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    text = (tmp_path / "report" / "results.md").read_text()
    assert "**c4 arm, depth 4**" in text and "**stress arm, depth 4**" in text
    assert "Seeds varied the initialisation only; every run read the data in one order (--data-seed 1234)" in text
    assert "do not share one precision policy" in text and "unrecorded: hc_d4_s1" in text


def test_verdict_without_probe_lines(tmp_path):
    write_run(tmp_path, "hc_d4_s1", [train(1, 0.0, 4.0, 0.5, 10)], state="running")
    (line,) = verdict.verdict(aggregate.collect(tmp_path))
    assert "HC: 1 seed (1 running) but no probe lines yet." in line


# --- plots -------------------------------------------------------------------------------------

def with_layers(lines, depth, gain):
    for i, rec in enumerate(lines):
        if "amax_fwd" in rec:
            rec["layer_gain_fwd"] = [gain ** ((k % 3) - 1) * (1 + 0.1 * i) for k in range(2 * depth)]
            rec["layer_gain_bwd"] = [1.0 + 0.01 * k for k in range(2 * depth)]
    return lines


def matrix_lines(method, scale, n=60):
    lines = []
    for step in range(1, n + 1):
        rec = train(step, float(step), 5.0 - step / n + 0.05 * (step % 3), 0.3 + (step % 7) / 5, step * 10)
        if step % 5 == 0:
            rec.update(probe(scale ** (step / n), scale ** (step / n) * 0.9))
        if step % 10 == 0:
            lines.append({"step": step, "time": step + 0.5, "val_loss": 4.9 - step / n})
        lines.append(rec)
    return with_layers(lines, 4, 1.5 if method == "hc" else 1.0)


def test_plots_are_valid_pngs(tmp_path):
    for method, scale in (("baseline", 1.0), ("hc", 300.0), ("mhc", 1.0)):
        for seed in (1, 2):
            write_run(tmp_path, f"{method}_d4_s{seed}", matrix_lines(method, scale * seed))
    out = tmp_path / "out"
    assert command.main([str(tmp_path), "--out", str(out)]) == 0
    for name in ("amax.png", "loss.png", "grad_norm.png", "layer_gains.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        assert len(data) > 5_000, name
        assert f"]({name})" in (out / "results.md").read_text()
    assert (out / "results.csv").read_text().startswith("method,depth,")
    assert "hc_d4_s2" in (out / "runs.csv").read_text()


def drawn_figures(monkeypatch):
    """The figures report.py saves, kept for inspection instead of written."""
    figures = []
    monkeypatch.setattr(plots, "save", lambda fig, path: figures.append(fig) or path)
    return figures


def test_loss_and_grad_norm_are_averaged_over_a_window_the_titles_name(tmp_path, monkeypatch):
    for method in ("baseline", "hc", "mhc"):
        write_run(tmp_path, f"{method}_d4_s1", matrix_lines(method, 50.0, n=600))
    runs = report_runs.load_runs(tmp_path)
    figures = drawn_figures(monkeypatch)
    plots.plot_loss(runs, tmp_path / "loss.png"), plots.plot_grad_norm(runs, tmp_path / "grad_norm.png")
    (train_ax, val_ax), (grad_ax,) = figures[0].axes[:2], figures[1].axes[:1]
    assert train_ax.get_title() == "depth 4: train loss (mean over 10-step windows)"       # 600 steps / 60
    assert val_ax.get_title() == "depth 4: validation loss (every logged step)"           # 60 evaluations
    assert grad_ax.get_title() == "depth 4: pre-clip gradient norm (mean over 10-step windows)"
    assert "400 step bins" not in figures[0].get_suptitle()
    baseline = next(line for line in train_ax.get_lines() if line.get_label().startswith("baseline"))
    x, y = baseline.get_data()
    assert len(x) == 60 and x[0] == pytest.approx(5.5)           # steps 1-10, centred at 5.5
    raw = [5.0 - step / 600 + 0.05 * (step % 3) for step in range(11, 21)]
    assert y[1] == pytest.approx(sum(raw) / 10)                   # the mean of steps 11-20


def test_every_method_line_stays_visible_where_they_coincide(tmp_path, monkeypatch):
    for method in ("baseline", "hc", "mhc"):
        write_run(tmp_path, f"{method}_d4_s1", matrix_lines(method, 1.0 if method != "hc" else 50.0))
    figures = drawn_figures(monkeypatch)
    plots.plot_amax(report_runs.load_runs(tmp_path), tmp_path / "amax.png")
    lines = {ln.get_label().split()[0]: ln for ln in figures[0].axes[0].get_lines()
             if ln.get_label().endswith("(1 seed)")}
    assert set(lines) == {"baseline", "HC", "mHC"}
    assert len({ln.get_linewidth() for ln in lines.values()}) == 1          # no thick line covers a thin one
    assert len({ln.get_marker() for ln in lines.values()}) == 3
    # baseline and mHC lie on each other at 1: their markers sit at different steps
    marked = {name: set(ln.get_xdata()[ln.get_markevery()[0]::ln.get_markevery()[1]]) for name, ln in lines.items()}
    assert marked["baseline"] and marked["mHC"] and not marked["baseline"] & marked["mHC"]


def test_heatmap_defaults_to_the_largest_hc_run_and_can_be_named(tmp_path):
    for seed, scale in ((1, 10.0), (2, 500.0)):
        write_run(tmp_path, f"hc_d4_s{seed}", matrix_lines("hc", scale))
    write_run(tmp_path, "mhc_d4_s1", matrix_lines("mhc", 1.0))
    runs = report_runs.load_runs(tmp_path)
    assert plots.pick_heatmap_run(runs).name == "hc_d4_s2"
    assert plots.pick_heatmap_run(runs, "mhc_d4_s1").name == "mhc_d4_s1"
    with pytest.raises(report_runs.ReportError, match="no such run"):
        plots.pick_heatmap_run(runs, "nope")


def test_no_layer_lists_skips_heatmap_with_a_note(tmp_path):
    hc_seed1(tmp_path)
    assert command.main([str(tmp_path)]) == 0
    assert (tmp_path / "report" / "amax.png").exists()
    assert not (tmp_path / "report" / "layer_gains.png").exists()
    assert "layer_gains.png not written" in (tmp_path / "report" / "results.md").read_text()


# --- command line ------------------------------------------------------------------------------

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


def test_cli_prints_table_and_has_no_traceback(tmp_path):
    empty = subprocess.run([sys.executable, str(ROOT / "report.py"), str(tmp_path)],
                           capture_output=True, text=True)
    assert empty.returncode == 2 and "Traceback" not in empty.stderr
    hc_seed1(tmp_path)
    done = subprocess.run([sys.executable, str(ROOT / "report.py"), str(tmp_path), "--no-plots"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "| HC | 4 | 1/1 |" in done.stdout and "**depth 4**" in done.stdout


# --- several runs folders (one per node, or a parent holding their copies) ----------------------

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


def test_watch_reads_one_folder(tmp_path, capsys):
    assert command.main([str(tmp_path), str(tmp_path), "--watch"]) == 2
    assert capsys.readouterr().err.strip() == ("report: --watch reads one matrix folder (its matrix.log); pass one "
                                               "RUNS_DIR")


def test_import_has_no_side_effects(tmp_path):
    code = "import sys, report; assert 'matplotlib' not in sys.modules; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert res.stdout == "ok\n" and res.stderr == ""
    assert list(tmp_path.iterdir()) == []


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


# --- the matrix view ---------------------------------------------------------------------------

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


HOLD_LOCK = ("import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', "
             "flush=True); time.sleep(600)")


def killed_matrix(root, **status):
    """A matrix whose launcher died with its job: matrix.log's last word on hc_d4_s1 is its LAUNCH, 2 hours ago, and
    the run's status.json says running at step 21 with checkpoint step-20."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000%z", time.localtime(now - 7200))
    (root / "matrix.log").write_text(
        f"{stamp} QUEUE slots=1 gpus_per_run=1 gpus=0 price_per_gpu_hour=0 runs=hc_d4_s1\n"
        f"{stamp} LAUNCH hc_d4_s1 gpus=0 attempt=1\n")
    d = write_run(root, "hc_d4_s1", [train(step, float(step), 4.0, 0.5, 10 * step) for step in range(1, 22)],
                  state="running", updated=now)
    record = json.loads((d / "status.json").read_text())
    (d / "status.json").write_text(json.dumps(record | {"step": 21, "steps": 40, "last_checkpoint_step": 20,
                                                        **status}))
    return d


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


# --- out-of-range values and files that are not regular: one warning each, never a traceback or a hang ---------

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


def test_arms_at_one_are_named_and_the_log_axis_has_labelled_minor_ticks(tmp_path, monkeypatch):
    for method in ("baseline", "hc", "mhc"):
        write_run(tmp_path, f"{method}_d4_s1", matrix_lines(method, 1.0 if method != "hc" else 50.0))
    figures = drawn_figures(monkeypatch)
    plots.plot_amax(report_runs.load_runs(tmp_path), tmp_path / "amax.png")
    forward = figures[0].axes[0]
    # in the legend, not written by the line at 1 (there it sat on the x axis)
    assert forward.get_legend().get_title().get_text() == "at 1, one over another: baseline, mHC"
    assert not [t for t in forward.texts if t.get_text().startswith("at 1")]
    minor = {tick.get_text() for tick in forward.yaxis.get_minorticklabels()}
    assert {"2", "5", "20"} <= minor, minor


def test_published_figures_name_the_forward_and_the_backward_reading_apart(tmp_path):
    write_run(tmp_path, "mhc_d4_s1", [{**train(1, 1.0, 5.0, 1.0, 10), **probe(1.0, 1.15)}])
    rows = aggregate.aggregate([aggregate.summarize(r) for r in report_runs.load_runs(tmp_path)])
    assert published.published_matches(rows, "mhc", None, ("peak_fwd", "peak_bwd"), "token") == [
        "amax_fwd 1.000 / amax_bwd 1.150 (mHC, depth 4)"]
    assert "mHC amax_fwd 1.000 / amax_bwd 1.150 (mHC, depth 4) against at most about 1.6" in \
        published.reference_verdict(rows)


def test_no_plots_leaves_no_plot_of_an_earlier_report(tmp_path):
    for method, scale in (("baseline", 1.0), ("hc", 300.0)):
        write_run(tmp_path, f"{method}_d4_s1", matrix_lines(method, scale))
    assert command.main([str(tmp_path)]) == 0
    assert (tmp_path / "report" / "amax.png").exists()
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    assert not list((tmp_path / "report").glob("*.png"))
    assert "plots skipped (--no-plots)" in (tmp_path / "report" / "results.md").read_text()


# --- the stream readings: the streams table, streams.png, depth_trend.png ----------------------------------------

def stream_readings(dominance, streams, rank, res, uniform, permutation):
    """A probe's ten stream readings: the table's six columns, and 0.1 for the others (in results.csv only)."""
    return {"stream_dominance": dominance, "effective_streams": streams, "effective_rank": rank,
            "res_to_identity": res, "composite_to_uniform": uniform, "composite_to_permutation": permutation,
            "stream_dominance_mean": 0.1, "effective_streams_min": 0.1, "effective_rank_min": 0.1,
            "res_to_identity_mean": 0.1}


def stream_lists(depth, value):
    return {key: [value] * (2 * depth) for key in ("layer_gain_fwd", "layer_gain_bwd", "layer_stream_dominance",
                                                   "layer_effective_streams", "layer_effective_rank",
                                                   "layer_res_to_identity")}


def stream_run(root, name, gains, final=None, dominance_list=None):
    """Two probes: the first logs 0.9 for every reading and list, the last `final` and lists of `dominance_list`
    (the report reads the last); `gains` = the last probe's (amax_fwd, amax_bwd). None: not logged (older runs)."""
    depth = int(name.split("_")[1][1:])
    first, last = {**train(1, 1.0, 5.0, 0.5, 10), **probe(1.0, 1.0)}, {**train(2, 2.0, 4.0, 0.5, 20), **probe(*gains)}
    if final is not None:
        first.update(stream_readings(*[0.9] * 6), **stream_lists(depth, 0.9))
        last.update(final, **stream_lists(depth, dominance_list))
    return write_run(root, name, [first, last])


def stream_matrix(root, depths=(4, 8)):
    """Baseline (no readings), HC and mHC at each depth, seeds 1 and 2; at depth 8 an older HC run (seed 3)."""
    for depth in depths:
        for seed in (1, 2):
            stream_run(root, f"baseline_d{depth}_s{seed}", (1.0, 1.0))
            stream_run(root, f"mhc_d{depth}_s{seed}", (1.0, 1.1), stream_readings(0.3, 3.9, 3.8, 0.2, 0.01, 0.99),
                       0.25)
    stream_run(root, "hc_d4_s1", (100.0, 300.0), stream_readings(0.5, 2.5, 1.25, 0.75, 1200.0, 1.5), 0.3)
    stream_run(root, "hc_d4_s2", (200.0, 100.0), stream_readings(0.8, 2.0, 1.5, 0.25, 1800.0, 2.5), 0.5)
    if 8 in depths:
        stream_run(root, "hc_d8_s1", (2000.0, 1000.0), stream_readings(0.6, 2.0, 1.0, 1.0, 5000.0, 4.0), 0.6)
        stream_run(root, "hc_d8_s2", (1000.0, 4000.0), stream_readings(0.7, 1.5, 1.0, 1.25, 7000.0, 6.0), 0.8)
        stream_run(root, "hc_d8_s3", (1500.0, 10.0))


def test_the_streams_table_gives_the_last_probe_mean_and_std_and_dashes_where_not_logged(tmp_path):
    stream_matrix(tmp_path)
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    hc = table_cells(tmp_path / "report", "HC", 4, "## Streams")
    # seeds (0.5, 0.8): mean 0.65, sample std 0.3 / sqrt(2) = 0.212; and so on column by column
    assert hc == {"method": "HC", "depth": "4", "stream dominance (max over sublayers)": "0.650 ± 0.212",
                  "effective streams": "2.250 ± 0.354", "effective rank": "1.375 ± 0.177",
                  "H_res to I (max over sublayers)": "0.500 ± 0.354", "composite to J/n": "1,500 ± 424",
                  "composite to permutation": "2.000 ± 0.707"}
    # the older run (seed 3) logged none: two of three seeds have a value
    assert table_cells(tmp_path / "report", "HC", 8, "## Streams")["composite to J/n"] == "6,000 ± 1,414 (n=2)"
    baseline = table_cells(tmp_path / "report", "baseline", 4, "## Streams")
    assert set(list(baseline.values())[2:]) == {"–"}
    text = (tmp_path / "report" / "results.md").read_text()
    assert "1/n = shared evenly, 1 = one stream holds everything" in text and "averaged the streams into one" in text
    assert table_cells(tmp_path / "report", "HC", 4, "## Table").keys() == {
        "method", "depth", "seeds done/total", "final val loss", "peak amax_fwd", "peak amax_bwd",
        "first >10× step (per seed)", "diverged"}                # the main table stays as it was
    rows = {(r["method"], r["depth"]): r for r in csv.DictReader(open(tmp_path / "report" / "results.csv"))}
    assert float(rows["hc", "4"]["composite_to_permutation_mean"]) == pytest.approx(2.0)
    assert float(rows["hc", "8"]["stream_dominance_std"]) == pytest.approx(sample_std(0.6, 0.7))
    assert rows["baseline", "4"]["stream_dominance_n"] == "0"


def test_runs_without_stream_readings_give_a_report_that_says_so(tmp_path):
    stream_run(tmp_path, "hc_d4_s1", (50.0, 40.0))
    stream_run(tmp_path, "baseline_d4_s1", (1.0, 1.0))
    assert command.main([str(tmp_path)]) == 0
    text = (tmp_path / "report" / "results.md").read_text()
    assert "No run here logged the stream readings" in text
    assert "streams.png not written: no run logged the per-sublayer stream lists" in text
    assert "depth_trend.png not written: it needs peak gains at two model depths or more; these runs have them at " \
           "depth 4." in text
    assert not (tmp_path / "report" / "streams.png").exists() and not (tmp_path / "report" / "depth_trend.png").exists()
    assert (tmp_path / "report" / "amax.png").exists()


def test_both_figures_are_written_and_shown_in_results(tmp_path):
    stream_matrix(tmp_path)
    assert command.main([str(tmp_path)]) == 0
    text = (tmp_path / "report" / "results.md").read_text()
    for name in ("streams.png", "depth_trend.png"):
        assert (tmp_path / "report" / name).read_bytes()[:8] == PNG_SIGNATURE
        assert f"]({name})" in text
    assert "| public 1.7B study, stress record | study's HC | 48 | 3,814 |" in text


def test_one_depth_has_streams_but_no_depth_trend(tmp_path):
    stream_matrix(tmp_path, depths=(4,))
    assert command.main([str(tmp_path)]) == 0
    assert (tmp_path / "report" / "streams.png").exists()
    assert not (tmp_path / "report" / "depth_trend.png").exists()
    assert "- depth_trend.png not written: it needs peak gains at two model depths or more; these runs have them " \
           "at depth 4." in (tmp_path / "report" / "results.md").read_text()


def band_heights(ax, color):
    """The y values of the corners of the one seed band filled in `color` on ax."""
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_rgb
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)
               and np.allclose(c.get_facecolor()[0][:3], to_rgb(color))]
    return band.get_paths()[0].vertices[:, 1]


def test_streams_figure_draws_each_arms_last_lists_per_depth(tmp_path, monkeypatch):
    stream_matrix(tmp_path)
    stream_run(tmp_path, "hc_d12_s1", (5.0, 5.0))                     # an older run: no row of empty panels
    figures = drawn_figures(monkeypatch)
    plots.plot_streams(report_runs.load_runs(tmp_path), tmp_path / "streams.png")
    axes = figures[0].axes
    assert [ax.get_title() for ax in axes] == [f"depth {d}: {what}" for d in (4, 8) for what in (
        "stream dominance", "effective streams", "effective rank", "H_res to I")]
    lines = {ln.get_label(): ln for ln in axes[0].get_lines()}
    assert set(lines) == {"HC (2 seeds)", "mHC (2 seeds)"}              # the baseline has no streams
    x, y = lines["HC (2 seeds)"].get_data()
    assert list(x) == list(range(8)) and np.allclose(y, 0.4)           # the last lists' (0.3, 0.5) mean, not 0.9
    assert lines["HC (2 seeds)"].get_color() == "tab:red"               # the arm's colour in every figure
    assert {round(v, 6) for v in band_heights(axes[0], "tab:red")} == {0.3, 0.5}
    # depth 8: the older run logged no lists, two seeds draw the line
    assert {ln.get_label() for ln in axes[4].get_lines()} == {"HC (2 seeds)", "mHC (2 seeds)"}


def test_depth_trend_draws_our_mean_and_band_beside_the_published_figures(tmp_path, monkeypatch):
    stream_matrix(tmp_path)
    summaries = [aggregate.summarize(r) for r in report_runs.load_runs(tmp_path)]
    figures = drawn_figures(monkeypatch)
    plots.plot_depth_trend(summaries, tmp_path / "depth_trend.png")
    (ax,) = figures[0].axes
    assert ax.get_yscale() == "log"
    hc = next(ln for ln in ax.get_lines() if ln.get_label().startswith("HC, ours"))
    # per run max(amax_fwd, amax_bwd): depth 4 (300, 200); depth 8 (2,000, 4,000, 1,500: the older run has gains)
    assert list(hc.get_xdata()) == [4, 8] and list(hc.get_ydata()) == pytest.approx([250.0, 2500.0])
    assert hc.get_markevery() == 1 and hc.get_color() == "tab:red"
    assert {round(v) for v in band_heights(ax, "tab:red")} == {200, 300, 1500, 4000}
    published = {c.get_label(): c for c in ax.containers if c.get_label().startswith("published")}
    study_32 = published["published: public 1.7B study, 3 seeds: study's HC 10,924 ± 3,247"]
    assert list(study_32.lines[0].get_xydata()[0]) == [32, 10924]
    segment = study_32.lines[2][0].get_segments()[0]
    assert list(segment[:, 1]) == [10924 - 3247, 10924 + 3247]
    assert {"published: public 1.7B study: study's HC 3,721",
            "published: public 1.7B study, stress record: study's HC 3,814",
            "published: public 1.7B study, stress arm (3x lr): study's HC 14,765"} <= set(published)
    ours = {ln.get_marker() for ln in ax.get_lines() if ", ours" in ln.get_label()}
    assert not ours & {c.lines[0].get_marker() for c in published.values()}
    paper = next(t for t in ax.texts if "HC up to about 3000" in t.get_text())
    assert paper.xy[1] == 3000 and any(ln.get_linestyle() == ":" and list(ln.get_ydata()) == [3000, 3000]
                                       for ln in ax.get_lines())
    assert "the public study's own reading" in figures[0].get_suptitle()
    assert "not our per-token one" in figures[0].get_suptitle()


def test_a_list_of_lists_is_no_layer_list(tmp_path):
    lists = {key: [[1.0, 2.0], [3.0, 4.0]] for key in ("layer_gain_fwd", "layer_gain_bwd", "layer_stream_dominance")}
    write_run(tmp_path, "hc_d1_s1", [{**train(1, 1.0, 5.0, 0.5, 10), **probe(2.0, 2.0), **lists}])
    assert command.main([str(tmp_path)]) == 0
    assert not (tmp_path / "report" / "layer_gains.png").exists()
    assert not (tmp_path / "report" / "streams.png").exists()
