"""hcstudy/launcher/main.py: python -m hcstudy.launcher, the entry run_experiments.sh starts."""
import pytest

from hcstudy.launcher import main
from hcstudy.report import live

from launcher_harness import events, launch, launcher_env, needs_bash


pytestmark = needs_bash


def test_the_first_line_comes_before_the_trainers_check_and_a_resume_is_said_at_launch(tmp_path):
    """The check imports torch (seconds of silence before); a job with a complete checkpoint is launched saying
    which one it resumes from, on the console and in matrix.log, which report.py still reads."""
    out = tmp_path / "runs"
    checkpoints = out / "hc_d2_s1" / "checkpoints"
    for folder, marker in (("step-3", True), ("step-5", False), ("rejected-step-7", True)):   # 5: not sealed
        (checkpoints / folder).mkdir(parents=True)
        if marker:
            (checkpoints / folder / "COMPLETE.json").write_text("{}")
    r = launch(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert first.startswith("run_experiments.sh: planning 2 job(s): train_c4.py checks") and " START " in second
    said = {run: text for _, _, text in events(out, "LAUNCH") for run in [text.split()[0]]}
    assert " attempt=1 resume=step-3 micro_batch=" in said["hc_d2_s1"] and "resume=" not in said["mhc_d2_s1"]
    assert "LAUNCH hc_d2_s1 gpus=cpu attempt=1 resume=step-3 " in r.stdout
    assert live.read_matrix(out).runs == {"hc_d2_s1": ["done", "cpu"], "mhc_d2_s1": ["done", "cpu"]}


def test_the_gpu_probe_without_cuda_says_why_in_its_last_line(capsys):
    pytest.importorskip("torch")
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU answers here")
    assert main.main(["--probe-gpu"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "CUDA is not available"


def test_a_usage_error_is_one_error_line_the_usage_and_exit_2(capsys):
    assert main.main(["--no-such-flag"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("run_experiments.sh: error: ") and err[1].startswith("Usage: ")
    assert err[-1] == "Try 'bash run_experiments.sh --help' for more."


def test_a_matrix_is_run_only_through_run_experiments_sh(tmp_path, monkeypatch, capsys):
    """Without bash's request and reply pipes this process only decides: a run is refused before anything is made."""
    for key, value in launcher_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "runs"
    assert main.main(["--out", str(out), "--methods", "hc", "--depths", "2", "--seeds", "1"]) == 1
    assert "the matrix runs through run_experiments.sh (this process only decides)" in capsys.readouterr().err
    assert not out.exists()


def test_fsdp_on_one_gpu_per_run_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    for key, value in launcher_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    assert main.main(["--out", str(tmp_path / "runs"), "--dry-run", "--methods", "hc", "--depths", "2", "--seeds",
                      "1", "--gpus", "0", "--", "--parallel", "fsdp"]) == 2
    assert "give --gpus-per-run 2 or more" in capsys.readouterr().err
