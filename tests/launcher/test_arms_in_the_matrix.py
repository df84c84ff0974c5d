"""The residual arms on the launcher and report side: run names (hcstudy/contract.py), the lists of run_experiments.sh
(hcstudy/launcher) that multiply a method only by the settings it has, report.py's rows, lines and colours per arm, and
the published figures beside ours. The launcher runs tests/support/fake_trainer.py: no torch, no GPU."""
import csv
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from hcstudy import contract  # noqa: E402
from hcstudy.launcher import jobs as jobs_module, options  # noqa: E402
from hcstudy.report import aggregate  # noqa: E402
from hcstudy.report import command  # noqa: E402
from hcstudy.report import plots  # noqa: E402
from hcstudy.report import published  # noqa: E402
from hcstudy.report import runs as report_runs  # noqa: E402
from hcstudy.config import parse_config
from launcher_harness import launch, launcher_env, needs_bash  # noqa: E402

ALL_LISTS = ["--residual", "baseline,hc,mhc,mhc-lite,identity-hc", "--sinkhorn-iters", "5,20,100",
             "--coefficients", "token,sequence", "--depth", "32", "--seed", "42"]


# --- run names ------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, name", [
    (("mhc", 32, 42, None, 20, "token"), "mhc_d32_s42"),             # the defaults: old folders keep their names
    (("mhc", 32, 42, None, 100), "mhc_d32_s42_it100"),
    (("hc", 32, 42, None, None, "sequence"), "hc_d32_s42_seq"),
    (("hc", 32, 42, None, 100, "sequence"), "hc_d32_s42_seq"),      # HC has no Sinkhorn iterations
    (("baseline", 32, 42, None, 5, "sequence"), "baseline_d32_s42"),  # nor coefficients: one baseline
    (("mhc-lite", 32, 42, None, 100), "mhc-lite_d32_s42"),
    (("identity-hc", 32, 42), "identity-hc_d32_s42"),
    (("hc", 32, 42, "seed-study"), "hc_d32_s42_seed-study"),
    (("hc", 32, 42, "seed-study", None, "sequence"), "hc_d32_s42_seed-study"),   # the preset's own coefficients
    (("hc", 32, 42, "seed-study", None, "token"), "hc_d32_s42_tok_seed-study"),
    (("mhc", 48, 123, "stress", 5, "sequence"), "mhc_d48_s123_it5_seq_stress"),
])
def test_run_names_carry_only_what_differs_from_the_defaults(args, name):
    assert contract.run_name(*args) == name
    parsed = contract.RUN_NAME.match(name)
    assert parsed and (parsed["method"], int(parsed["depth"]), int(parsed["seed"])) == args[:3]


# --- the launcher's lists -------------------------------------------------------------------------

def jobs_of(tmp_path, *argv):
    opt = options.parse_options(["--out", str(tmp_path / "runs"), *argv])
    return opt, jobs_module.matrix_jobs(opt)


def flag(flags, name):
    return flags[flags.index(name) + 1] if name in flags else None


def test_lists_multiply_only_the_methods_they_apply_to(tmp_path):
    opt, jobs = jobs_of(tmp_path, *ALL_LISTS)
    names = [j.name for j in jobs]
    assert names == ["baseline_d32_s42", "hc_d32_s42", "hc_d32_s42_seq",
                     "mhc_d32_s42_it5", "mhc_d32_s42_it5_seq", "mhc_d32_s42", "mhc_d32_s42_seq",
                     "mhc_d32_s42_it100", "mhc_d32_s42_it100_seq",
                     "mhc-lite_d32_s42", "mhc-lite_d32_s42_seq", "identity-hc_d32_s42", "identity-hc_d32_s42_seq"]
    for job in jobs:
        flags = jobs_module.trainer_flags(opt, job)
        assert flag(flags, "--run-name") == job.name and flag(flags, "--residual") == job.method
        assert flag(flags, "--sinkhorn-iters") == (str(job.sinkhorn_iters) if job.method == "mhc" else None)
        assert flag(flags, "--coefficients") == (None if job.method == "baseline" else
                                                 "sequence" if job.name.endswith("_seq") else "token")
        # the name the trainer would give the run alone is the one the launcher gives it
        assert contract.run_name(job.method, job.depth, job.seed, opt.preset, job.sinkhorn_iters,
                                 job.coefficients) == job.name
    # without the new lists the matrix and its commands are what they were
    opt, jobs = jobs_of(tmp_path, "--depth", "32", "--seed", "42")
    assert [j.name for j in jobs] == ["baseline_d32_s42", "hc_d32_s42", "mhc_d32_s42"]
    assert not {"--sinkhorn-iters", "--coefficients"} & set(sum((jobs_module.trainer_flags(opt, j) for j in jobs), []))


def test_a_preset_after_the_separator_names_the_runs(tmp_path):
    opt, jobs = jobs_of(tmp_path, "--residual", "hc,mhc", "--depth", "32", "--", "--preset", "seed-study")
    assert {j.name for j in jobs} == {f"{m}_d32_s{s}_seed-study" for m in ("hc", "mhc") for s in (42, 123, 456)}
    flags = jobs_module.trainer_flags(opt, jobs[0])
    assert flags.count("--preset") == 1 and flag(flags, "--preset") == "seed-study"
    # repeated presets reach the trainer together, in order, and name the runs as the trainer would
    opt, jobs = jobs_of(tmp_path, "--residual", "hc", "--depth", "4", "--seed", "1", "--", "--preset", "demo",
                        "--preset=seed-study")
    assert [j.name for j in jobs] == ["hc_d4_s1_seed-study"]
    flags = jobs_module.trainer_flags(opt, jobs[0])
    assert flags.count("--preset") == 1 and flag(flags, "--preset") == "demo,seed-study"


@pytest.mark.parametrize("method, extra", [
    ("mhc", ["--mhc-post-bias=0"]), ("mhc", ["--mhc-post-bias", "2"]), ("hc", ["--read-stream", "ROTATE"]),
    ("hc", ["--proj-init", "flat"]), ("hc", []), ("hc", ["--warmup-from", "one-step"]),
    ("mhc", ["--doc-separator=eot"]), ("study-hc", []), ("study-mhc", ["--mhc-res-diag", "4"]),
    ("study-hc", ["--collapse", "sum"]),
])
def test_a_study_setting_turned_back_after_the_separator_names_the_run_as_the_trainer_does(tmp_path, method, extra):
    opt, jobs = jobs_of(tmp_path, "--residual", method, "--depth", "4", "--seed", "1", "--", "--preset",
                        "demo,seed-study", *extra)
    alone = parse_config(["--residual", method, "--depth", "4", "--seed", "1", "--preset", "demo,seed-study",
                            *extra])
    assert [j.name for j in jobs] == [alone.run_name]


def test_the_study_arms_bring_their_preset_in_the_matrix_as_alone(tmp_path):
    opt, jobs = jobs_of(tmp_path, "--residual", "study-hc,study-mhc", "--depth", "4", "--seed", "1", "--",
                        "--preset", "demo")
    alone = [parse_config(["--residual", method, "--depth", "4", "--seed", "1", "--preset", "demo"])
             for method in ("study-hc", "study-mhc")]
    assert [j.name for j in jobs] == [cfg.run_name for cfg in alone] == ["study-hc_d4_s1", "study-mhc_d4_s1"]
    assert [cfg.preset for cfg in alone] == ["seed-study,demo"] * 2


def test_demo_all_runs_every_arm_and_demo_stays(tmp_path):
    _, demo = jobs_of(tmp_path, "--demo")
    _, every = jobs_of(tmp_path, "--demo-all")
    assert [j.name for j in demo] == ["baseline_d4_s42", "hc_d4_s42", "mhc_d4_s42"]
    assert [j.name for j in every] == ["baseline_d4_s42", "hc_d4_s42", "mhc_d4_s42", "mhc-lite_d4_s42",
                                       "identity-hc_d4_s42", "kromhc_d4_s42", "study-hc_d4_s42", "study-mhc_d4_s42"]


def test_the_pilot_is_the_documented_cpu_matrix(tmp_path):
    opt, jobs = jobs_of(tmp_path, "--pilot")
    assert opt.preset == "demo" and len(jobs) == 30
    assert {j.name for j in jobs} == {f"{m}_d{d}_s{s}" for m in ("baseline", "hc", "mhc", "identity-hc", "kromhc")
                                      for d in (2, 4, 8) for s in (42, 123)}


@needs_bash
@pytest.mark.parametrize("argv, message", [
    (["--sinkhorn-iters", "0"], "'0' is not a valid entry of --sinkhorn-iters"),
    (["--coefficients", "pooled"], "'pooled' is not a valid entry of --coefficients"),
    (["--", "--sinkhorn-iters", "50"], "--sinkhorn-iters is set by the launcher for each run: give it before --"),
    (["--", "--coefficients=sequence"], "--coefficients is set by the launcher for each run"),
    (["--", "--resume", "never"], "--resume is the launcher's: every job resumes"),
])
def test_bad_arm_lists_are_one_line_and_exit_2(tmp_path, argv, message):
    result = launch(tmp_path, *argv)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@needs_bash
def test_the_launcher_runs_the_arms_with_their_flags(tmp_path):
    out = tmp_path / "runs"
    result = launch(tmp_path, "--residual", "hc,mhc", "--sinkhorn-iters", "5,20", "--coefficients",
                    "token,sequence", "--depth", "2", "--seed", "1", "--", "--preset", "seed-study",
                    env=launcher_env(tmp_path, FAKE_STEPS=2))
    assert result.returncode == 0, result.stderr
    expected = {"hc_d2_s1_tok_seed-study": ("hc", None, "token"), "hc_d2_s1_seed-study": ("hc", None, "sequence"),
                "mhc_d2_s1_it5_tok_seed-study": ("mhc", "5", "token"),
                "mhc_d2_s1_it5_seed-study": ("mhc", "5", "sequence"),
                "mhc_d2_s1_tok_seed-study": ("mhc", "20", "token"), "mhc_d2_s1_seed-study": ("mhc", "20", "sequence")}
    assert sorted(d.name for d in out.iterdir() if d.is_dir()) == sorted(expected)
    for name, (method, iters, coefficients) in expected.items():
        argv = json.loads((out / name / "invocations.jsonl").read_text().splitlines()[0])["argv"]
        assert (flag(argv, "--residual"), flag(argv, "--sinkhorn-iters"), flag(argv, "--coefficients")) == \
            (method, iters, coefficients)
        assert argv.count("--preset") == 1 and flag(argv, "--preset") == "seed-study"
    # the report reads the launched runs as six arms, one row each
    rows = aggregate.collect(out)
    assert sorted(r.label for r in rows) == ["HC", "HC (per-sequence)", "mHC", "mHC (5 it)",
                                             "mHC (5 it, per-sequence)", "mHC (per-sequence)"]


# --- the report keeps the arms apart -----------------------------------------------------------------

def write_run(root, name, peak, config=None, study=None, seed=1, study_train=None):
    """A finished run folder: three probe lines rising to `peak` (amax_study: `study`; the training batch's
    amax_study_train: `study_train`)."""
    method = name.split("_d")[0]
    depth = int(name.split("_d")[1].split("_")[0])
    folder = root / name
    folder.mkdir(parents=True)
    cfg = {"residual": method, "depth": depth, "seed": seed, "preset": "c4", **(config or {})}
    (folder / "config.json").write_text(json.dumps({"config": cfg, "device": "cpu"}))
    lines = [{"step": s, "time": float(s), "loss": 4.0 - s / 10, "val_loss": 4.1 - s / 10, "grad_norm": 0.5,
              "amax_fwd": 1 + (peak - 1) * s / 3, "amax_bwd": 1 + (peak - 1) * s / 3,
              **({"amax_study": study * s / 3} if study else {}),
              **({contract.STUDY_TRAIN_KEY: study_train * (4 - s) / 3} if study_train else {})} for s in (1, 2, 3)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "status.json").write_text(json.dumps({"state": "completed", "step": 3, "exit_code": 0}))


ARMS = {  # run name -> (peak, settings the trainer writes to config.json)
    "baseline_d4_s1": (1.0, {}),
    "hc_d4_s1": (40.0, {"coefficients": "token"}),
    "hc_d4_s1_seq": (400.0, {"coefficients": "sequence"}),
    "mhc_d4_s1": (1.2, {"sinkhorn_iters": 20, "coefficients": "token"}),
    "mhc_d4_s1_it100": (1.01, {"sinkhorn_iters": 100, "coefficients": "token"}),
    "mhc-lite_d4_s1": (1.0, {"coefficients": "token"}),
    "identity-hc_d4_s1": (1.0, {"coefficients": "token"}),
}


def test_report_keeps_every_arm_apart(tmp_path):
    for name, (peak, config) in ARMS.items():
        write_run(tmp_path, name, peak, config)
    # an older run folder (no coefficients, no iterations in config.json) is the default arm, its seed averaged in
    write_run(tmp_path, "hc_d4_s2", 60.0, seed=2)
    rows = aggregate.collect(tmp_path)
    assert [(r.label, [s.name for s in r.runs], r.stats["peak_fwd"].mean) for r in rows] == [
        ("baseline", ["baseline_d4_s1"], 1.0),
        ("HC", ["hc_d4_s1", "hc_d4_s2"], 50.0),
        ("HC (per-sequence)", ["hc_d4_s1_seq"], 400.0),
        ("mHC", ["mhc_d4_s1"], 1.2),
        ("mHC (100 it)", ["mhc_d4_s1_it100"], 1.01),
        ("mHC-lite", ["mhc-lite_d4_s1"], 1.0),
        ("identity-HC", ["identity-hc_d4_s1"], 1.0)]
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    with open(tmp_path / "report" / "results.csv") as f:
        table = [(r["method"], r["coefficients"], r["sinkhorn_iters"]) for r in csv.DictReader(f)]
    assert table == [("baseline", "", ""), ("hc", "token", ""), ("hc", "sequence", ""), ("mhc", "token", "20"),
                     ("mhc", "token", "100"), ("mhc-lite", "token", ""), ("identity-hc", "token", "")]


def test_arms_are_told_from_the_run_name_without_config(tmp_path):
    for name in ("hc_d4_s1", "hc_d4_s1_seq", "mhc_d4_s1_it5", "hc_d4_s1_seed-study"):
        write_run(tmp_path, name, 10.0)
        (tmp_path / name / "config.json").unlink()
    assert [r.label for r in aggregate.collect(tmp_path)] == [
        "HC", "HC (per-sequence)", "mHC (5 it)", "HC (per-sequence) [seed-study]"]


def test_plots_give_each_arm_its_own_line_and_colour(tmp_path):
    for name, (peak, config) in ARMS.items():
        write_run(tmp_path, name, peak, config)
    write_run(tmp_path, "hc_d4_s1_stress", 900.0, {"preset": "stress"})
    groups = plots.group_runs(report_runs.load_runs(tmp_path))
    looks = list(groups[4])
    assert [look.label for look in looks] == [
        "baseline [c4]", "HC [c4]", "HC (per-sequence) [c4]", "mHC [c4]", "mHC (100 it) [c4]", "mHC-lite [c4]",
        "identity-HC [c4]", "HC [stress]"]
    assert len({look.color for look in looks}) == len(looks)
    assert [runs[0].name for runs in groups[4].values()] == [
        "baseline_d4_s1", "hc_d4_s1", "hc_d4_s1_seq", "mhc_d4_s1", "mhc_d4_s1_it100", "mhc-lite_d4_s1",
        "identity-hc_d4_s1", "hc_d4_s1_stress"]
    assert command.main([str(tmp_path)]) == 0
    assert (tmp_path / "report" / "amax.png").stat().st_size > 5_000


# --- the published figures ----------------------------------------------------------------------------

def test_results_carry_the_published_figures_and_say_which_arm_compares(tmp_path):
    write_run(tmp_path, "hc_d32_s1", 300.0, {"coefficients": "token"}, study=200.0)
    # the study's figures: the peak over steps of its reading on the training batch (falling here from 9,000 at
    # the first step), not the probe's amax_study, and of the study's own arm only, not of our per-sequence HC
    write_run(tmp_path, "study-hc_d32_s1", 50.0, {"preset": "seed-study", "coefficients": "sequence"},
              study=8000.0, study_train=9000.0)
    write_run(tmp_path, "hc_d48_s1_seq", 50.0, {"coefficients": "sequence"}, study=7000.0, study_train=7000.0)
    assert command.main([str(tmp_path), "--no-plots"]) == 0
    text = (tmp_path / "report" / "results.md").read_text()
    block = text[text.index("## Published figures"):text.index("## Verdict")]
    for figure in ("up to about 3000", "at most about 1.6", "10,924 ± 3,247", "14,765", "| 1.00 |"):
        assert figure in block
    # per token: our HC at token coefficients; the study: its own reading of its own arm
    assert "| mHC paper (arXiv 2512.24880), 27B | HC | – | up to about 3000 | amax_fwd / amax_bwd | " \
           "token coefficients (default) | amax_fwd 300 / amax_bwd 300 (HC [c4], depth 32) |" in block
    study_arm = "the study's own (--residual study-hc, study-mhc)"
    assert f"| public 1.7B study, 3 seeds | study's HC | 32 | 10,924 ± 3,247 | amax_study_train | {study_arm} " \
           "| amax_study_train 9,000 (study's HC [seed-study], depth 32) |" in block
    assert f"| public 1.7B study | study's HC | 48 | 3,721 | amax_study_train | {study_arm} | no such run |" in block
    assert f"stress arm (3x lr) | study's HC | 64 | 14,765 | amax_study_train | {study_arm} | no such run |" in block
    verdict = text[text.index("## Verdict"):text.index("## Runs")]
    assert ("**published figures**: HC amax_fwd 300 / amax_bwd 300 (HC [c4], depth 32) against up to about 3000 "
            "(mHC paper (arXiv 2512.24880), 27B); study's HC amax_study_train 9,000 (study's HC [seed-study], depth 32) "
            "against 10,924 ± 3,247 (public 1.7B study, 3 seeds, depth 32).") in verdict


def test_without_a_matching_arm_the_verdict_says_so(tmp_path):
    write_run(tmp_path, "baseline_d4_s1", 1.0)
    rows, text = command.report([tmp_path], with_plots=False)
    assert "**published figures**: no arm here compares directly" in text


def test_a_study_run_from_before_its_arms_is_read_as_its_arm(tmp_path, capsys):
    """A run recorded as hc with the retired settings at the study's values is the study's HC and compares with the
    study's figures; the paper's HC in the study's body and recipe is named after the preset and does not; a run
    that mixed the two is a model this version cannot build: left out of the table with a warning."""
    body = {**contract.SEED_STUDY_MODEL, "coefficients": "sequence", "preset": "seed-study"}
    retired = {key: study for key, (_, study) in contract.RETIRED_STUDY_SETTINGS["hc"].items()}
    write_run(tmp_path, "hc_d32_s1_seed-study", 50.0, {**body, **retired}, study_train=9000.0)
    write_run(tmp_path, "hc_d32_s2_seed-study", 50.0, body, seed=2, study_train=5000.0)
    write_run(tmp_path, "hc_d32_s3_seed-study", 50.0, {**body, **retired, "hc_write_init": "all"}, seed=3,
              study_train=7000.0)
    rows = aggregate.collect(tmp_path)
    assert sorted(r.label for r in rows) == ["HC (per-sequence)", "study's HC"]
    assert published.published_matches(rows, "study-hc", 32, ("peak_study_train",), "sequence") == [
        "amax_study_train 9,000 (study's HC, depth 32)"]
    assert {p.method for p in published.PUBLISHED if p.coefficients == "sequence"} == {"study-hc", "study-mhc"}
    assert "--coefficient-norm flat, a setting this version no longer has" in capsys.readouterr().err
