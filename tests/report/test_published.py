"""hcstudy/report/published.py: the published figures beside ours."""
from hcstudy.report import aggregate
from hcstudy.report import published
from hcstudy.report import runs as report_runs

from hand_written_runs import probe, train, write_run


def test_published_figures_name_the_forward_and_the_backward_reading_apart(tmp_path):
    write_run(tmp_path, "mhc_d4_s1", [{**train(1, 1.0, 5.0, 1.0, 10), **probe(1.0, 1.15)}])
    rows = aggregate.aggregate([aggregate.summarize(r) for r in report_runs.load_runs(tmp_path)])
    assert published.published_matches(rows, "mhc", None, ("peak_fwd", "peak_bwd"), "token") == [
        "amax_fwd 1.000 / amax_bwd 1.150 (mHC, depth 4)"]
    assert "mHC amax_fwd 1.000 / amax_bwd 1.150 (mHC, depth 4) against at most about 1.6" in \
        published.reference_verdict(rows)
