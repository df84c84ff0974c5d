"""hcstudy/report/aggregate.py on hand-written run folders: one summary per run, one row per arm and depth; every
number checked against a value computed by hand here (not by report.py's own helpers)."""
import json
import math
import statistics

import pytest
from hypothesis import given, settings, strategies as st

from hcstudy.report import aggregate
from hcstudy.report import command
from hcstudy.report import runs as report_runs

from hand_written_runs import hc_seed1, hc_seed2, probe, sample_std, table_cells, train, write_run


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
