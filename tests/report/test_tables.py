"""hcstudy/report/tables.py: results.md's tables and the CSV files, cell by cell; every number checked against a
value computed by hand here (not by report.py's own helpers)."""
import csv
import json
import math

import pytest

from hcstudy.report import aggregate
from hcstudy.report import command
from hcstudy.report import verdict

from hand_written_runs import (hc_seed1, hc_seed2, mhc_probe, probe, sample_std, stream_matrix, stream_run, table_cells,
                               train, write_run)


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


def test_mhc_over_two_seeds_gives_its_sinkhorn_errors_with_their_spread(tmp_path):
    """Every table's cells over seeds, the truncation columns too (a std was passed to a one-argument format)."""
    for seed, col_err in ((1, 0.031), (2, 0.045)):
        write_run(tmp_path, f"mhc_d4_s{seed}", [{**train(1, 0.0, 4.0, 0.5, 10), **mhc_probe(1.1, 1.0, col_err, 1.2)}])
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    cells = table_cells(tmp_path / "report", "mHC", 4, "## Amplification: three readings")
    assert cells["mHC Sinkhorn column error"] == "0.038 ± 0.0099"


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
