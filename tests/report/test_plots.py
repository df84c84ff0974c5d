"""hcstudy/report/plots.py: the figures drawn (lines, bands, titles, axes read back from matplotlib) and the notes of
figures not written."""
import numpy as np
import pytest

from hcstudy.report import aggregate
from hcstudy.report import command
from hcstudy.report import plots
from hcstudy.report import runs as report_runs

from hand_written_runs import PNG_SIGNATURE, hc_seed1, matrix_lines, probe, stream_matrix, stream_run, train, write_run


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
