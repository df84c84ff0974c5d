"""hcstudy/launcher/options.py: the launcher's command line: --help, usage errors, refusals before anything runs."""
import pytest

from launcher_harness import launch, needs_bash


pytestmark = needs_bash


def test_help(tmp_path):
    r = launch(tmp_path, "--help")
    assert r.returncode == 0 and "Usage:" in r.stdout and "--gpus-per-run" in r.stdout


@pytest.mark.parametrize("args", [
    ["--bogus"], ["--methods", "hc,foo"], ["--depths", "0"], ["--seeds", "x"], ["--steps", "ten"],
    ["--gpus", "a"], ["--gpus-per-run", "0"], ["--stagger", "-1"], ["--max-retries", "two"],
    ["--quick", "--demo"], ["--depths"], ["--", "--run-name", "x"], ["--nodes", "0"],
    ["--nodes", "2", "--node-rank", "2"],
])
def test_bad_flags_give_usage_and_exit_2(tmp_path, args):
    r = launch(tmp_path, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Usage:" in r.stderr and "error:" in r.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args", [
    ["--methods", ""], ["--seeds", ""], ["--depths", ""], ["--dry-run", "--out", "/proc/nope"],
    ["--dry-run", "--out", "A_FILE"], ["--dry-run", "--out", "A_FILE/under"], ["--out", "A_FILE/under"],
    ["--dry-run", "--out", ""],
])
def test_empty_lists_and_an_unusable_out_are_refused_before_anything_runs(tmp_path, args):
    (tmp_path / "a-file").write_text("x")
    r = launch(tmp_path, *[str(tmp_path / "a-file") + a[6:] if a.startswith("A_FILE") else a for a in args])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error:" in r.stderr and ("must not be empty" in r.stderr or "--out" in r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]     # no run folder, no probe left behind
