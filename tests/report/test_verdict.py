"""hcstudy/report/verdict.py: the verdict per depth states the numbers, the missing arms and mHC's truncation."""
from hcstudy.report import aggregate
from hcstudy.report import verdict

from hand_written_runs import hc_seed1, hc_seed2, mhc_probe, probe, train, write_run


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


def test_mhc_gain_beyond_the_truncation_bound_is_not_explained_away(tmp_path):
    write_run(tmp_path, "mhc_d4_s1", [{**train(1, 0.0, 4.0, 0.5, 10), **mhc_probe(1.5, 1.0, 0.01, 1.02)}])
    (line,) = verdict.verdict(aggregate.collect(tmp_path))
    assert "exceeds the truncation bound: more than Sinkhorn truncation explains" in line


def test_verdict_without_probe_lines(tmp_path):
    write_run(tmp_path, "hc_d4_s1", [train(1, 0.0, 4.0, 0.5, 10)], state="running")
    (line,) = verdict.verdict(aggregate.collect(tmp_path))
    assert "HC: 1 seed (1 running) but no probe lines yet." in line
