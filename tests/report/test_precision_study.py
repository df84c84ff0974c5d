"""benchmarks/precision_study.py: each dtype's seeds, their difference set against the seeds' spread."""
import importlib.util
import sys
from pathlib import Path

from test_report import PNG_SIGNATURE, probe, train, write_run

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


def rows_of(text, reading):
    return [line for line in text.splitlines() if f"| {reading} |" in line]


def test_a_shift_beyond_the_seeds_is_named_and_one_within_is_not(tmp_path, capsys):
    fp32 = runs(tmp_path / "fp32", peaks=(100.0, 120.0), losses=(3.00, 3.10))
    bf16 = runs(tmp_path / "bf16", peaks=(400.0, 410.0), losses=(3.02, 3.12))
    assert precision_study.main([str(fp32), str(bf16), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert rows_of(out, "peak_fwd")[0].endswith("| 110 (20) | 405 (10) | +295 | **yes** |")
    assert rows_of(out, "final_loss")[0].endswith("| +0.02 | no |")
    assert "2 of" in out and "HC peak_fwd, HC peak_bwd" in out
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_SIGNATURE)


def test_one_seed_has_no_spread_to_judge_by_and_no_match_is_an_error(tmp_path, capsys):
    one = runs(tmp_path / "one", peaks=(100.0,), losses=(3.0,))
    assert precision_study.main([str(one), str(runs(tmp_path / "other", (900.0,), (3.0,)))]) == 0
    assert rows_of(capsys.readouterr().out, "peak_fwd")[0].endswith("| n/a (1 seed) |")
    (tmp_path / "empty").mkdir()
    assert precision_study.main([str(one), str(tmp_path / "empty")]) == 1
