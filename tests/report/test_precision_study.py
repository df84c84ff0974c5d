"""benchmarks/precision_study.py: the two dtypes paired by seed, each reading decided against its margin."""
import importlib.util
from pathlib import Path

import numpy as np

from hand_written_runs import PNG_SIGNATURE, probe, train, write_run

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("precision_study", ROOT / "benchmarks" / "precision_study.py")
precision_study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(precision_study)


def runs(root, peaks, losses):
    """HC at depth 4, one run per seed: its peak gain and final loss."""
    for seed, (peak, loss) in enumerate(zip(peaks, losses), start=1):
        write_run(root, f"hc_d4_s{seed}", [{**train(1, 0.0, 5.0, 1.0, 10), **probe(1.0, 1.0)},
                                             {**train(2, 1.0, loss, 1.0, 20), **probe(peak, peak)}], device="cpu")
    return root


def verdict_of(text, reading):
    return [line for line in text.splitlines() if f"| {reading} |" in line][0].rsplit("|", 2)[1].strip(" *")


def test_paired_seeds_decide_equivalent_different_and_undecided(tmp_path, capsys):
    # peaks 4x higher at bf16 for every seed: different; losses moved by 0.001 +- 0.0005: equivalent
    fp32 = runs(tmp_path / "fp32", peaks=(100, 120, 90, 110), losses=(3.000, 3.100, 2.900, 3.050))
    bf16 = runs(tmp_path / "bf16", peaks=(400, 470, 370, 430), losses=(3.001, 3.1015, 2.9005, 3.051))
    assert precision_study.main([str(fp32), str(bf16), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert verdict_of(out, "peak_fwd") == "different" and verdict_of(out, "final_loss") == "equivalent"
    assert "fp32 streams stay the default" in out
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_SIGNATURE)
    # paired shifts of +-0.05 around zero: the interval straddles the 0.01 margin, neither cleared nor convicted
    noisy = runs(tmp_path / "noisy", peaks=(100, 120, 90, 110), losses=(3.05, 3.05, 2.95, 3.0))
    assert precision_study.main([str(fp32), str(noisy)]) == 0
    assert verdict_of(capsys.readouterr().out, "final_loss") == "undecided"


def test_the_interval_is_students_and_a_relative_margin_reads_the_ratio():
    a, b = np.array([1.0, 1.0, 1.0]), np.array([1.01, 1.03, 1.02])
    mean, (low, high) = precision_study.interval(a, b, "abs")
    # mean 0.02, s = 0.01, t(0.95, 2) = 2.920: 0.02 +- 2.920 * 0.01 / sqrt(3)
    assert np.isclose(mean, 0.02) and np.isclose(high - mean, 2.920 * 0.01 / np.sqrt(3))
    assert precision_study.verdict(a, b, (0.10, "rel"))[0] == "equivalent"      # within 10 % of the value
    assert precision_study.verdict(a, b, (0.001, "abs"))[0] == "different"


def test_one_seed_is_undecided_and_no_match_is_an_error(tmp_path, capsys):
    one = runs(tmp_path / "one", peaks=(100.0,), losses=(3.0,))
    assert precision_study.main([str(one), str(runs(tmp_path / "other", (900.0,), (3.0,)))]) == 0
    assert verdict_of(capsys.readouterr().out, "peak_fwd") == "undecided"
    (tmp_path / "empty").mkdir()
    assert precision_study.main([str(one), str(tmp_path / "empty")]) == 1


def test_a_run_still_training_is_left_out_of_the_pairs(tmp_path, capsys):
    fp32 = runs(tmp_path / "fp32", peaks=(100, 120, 90), losses=(3.00, 3.10, 2.90))
    bf16 = runs(tmp_path / "bf16", peaks=(100, 120, 90), losses=(3.00, 3.10, 2.90))
    write_run(tmp_path / "bf16", "hc_d4_s4", [{**train(1, 0.0, 9.0, 1.0, 10), **probe(1.0, 1.0)}], state="running",
              device="cpu")
    write_run(tmp_path / "fp32", "hc_d4_s4", [{**train(1, 0.0, 3.0, 1.0, 10), **probe(1.0, 1.0)}], device="cpu")
    assert precision_study.main([str(fp32), str(bf16)]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if "| final_loss |" in line][0]
    assert row.split("|")[4].strip() == "3"          # three pairs: seed 4's bf16 run has no final value yet
