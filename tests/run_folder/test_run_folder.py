"""hcstudy/run_folder.py and the trainer's checkpointing: nothing lost under any fault: the run folder's lock,
damaged checkpoints replaced, every state recorded, every file the trainer and the report read checked
(docs/reliability.md)."""
import errno
import fcntl
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from hcstudy import consolidate
from hcstudy import contract
from hcstudy import run_folder
from hcstudy.config import parse_config
from hcstudy.contract import ConfigError, TrainerError
from hcstudy.distributed import Dist
from hcstudy.model import GPT
from hcstudy.optim import make_optimizer
from hcstudy.run_folder import check_resumable
import train_c4 as T
from helpers import Exploit, tiny_config

from finished_runs import RUN, copy_of, finished, one_line, run  # noqa: F401 (finished: a fixture)


ROOT = Path(__file__).resolve().parents[2]
ONE = Dist(0, 1, torch.device("cpu"))


def reseal(folder, name, obj):
    """Rewrite a checkpoint file and fix its checksum in the marker, as a crafted or buggy writer could."""
    if obj is None:
        (folder / name).unlink()
    else:
        torch.save(obj, folder / name)
    marker = json.loads((folder / run_folder.MARKER).read_text())
    if obj is None:
        del marker["files"][name]
    else:
        marker["files"][name] = run_folder.sha256(folder / name)
    (folder / run_folder.MARKER).write_text(json.dumps(marker))


def status_of(run_dir):
    return json.loads((run_dir / "status.json").read_text())


@pytest.mark.slow
def test_a_second_trainer_on_a_folder_in_use_exits_2_naming_the_holder(finished, tmp_path):
    out, run_dir = copy_of(finished, tmp_path)
    before = (run_dir / "metrics.jsonl").read_bytes()
    holder = run_folder.lock_run_folder(run_dir)                 # this test process holds the folder, as a trainer would
    code, _, stderr = run(out, "--steps", "30", "--allow-changed-settings")
    assert code == 2 and one_line(stderr) and f"is in use by process {os.getpid()}" in stderr, stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before and status_of(run_dir)["state"] == "completed"
    holder.close()


@pytest.mark.slow
def test_a_lock_left_by_a_dead_process_does_not_block(finished, tmp_path):
    out, run_dir = copy_of(finished, tmp_path)
    dead = subprocess.run([sys.executable, "-c", "from hcstudy import run_folder; import pathlib, sys; "
                           f"run_folder.lock_run_folder(pathlib.Path({str(run_dir)!r})); sys.exit(0)"], cwd=ROOT)
    assert dead.returncode == 0 and (run_dir / ".lock").exists()
    code, stdout, stderr = run(out)
    assert code == 0 and "completed 20 steps" in stdout, stderr


def test_the_lock_names_its_live_holder_never_a_pid_written_in_the_file(tmp_path):
    """A trainer killed leaves its PID in an old lock file, and the PID may since be another process's: the holder
    named is the one the kernel's lock table gives."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = dead.stdout.strip()
    (tmp_path / ".lock").write_text(f"process {stale} on {os.uname().nodename}\n")
    hold = ("import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); "
            "sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / ".lock")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError) as refused:
            run_folder.lock_run_folder(tmp_path)
    finally:
        holder.communicate("")
    assert f"in use by process {holder.pid};" in str(refused.value) and f"process {stale} " not in str(refused.value)


def test_a_lock_whose_holder_the_kernel_does_not_name_says_how_to_find_it(tmp_path, monkeypatch):
    holder = run_folder.lock_run_folder(tmp_path)
    monkeypatch.setattr(run_folder, "lock_holder", lambda lock: None)     # a holder on another node
    with pytest.raises(ConfigError, match=r"in use by another process \(`fuser .*/\.lock` names it\)"):
        run_folder.lock_run_folder(tmp_path)
    holder.close()


def test_a_look_at_the_lock_never_turns_a_trainer_away_and_the_host_is_recorded(finished, tmp_path):
    """report.py tells a killed run from a live one by trying the lock (contract.run_lock_free): a trainer starting
    at that instant waits for it instead of refusing the folder; status.json says which host's lock to try."""
    looking = open(tmp_path / ".lock", "a")
    fcntl.flock(looking, fcntl.LOCK_SH)
    threading.Timer(0.2, looking.close).start()
    trainer = run_folder.lock_run_folder(tmp_path)
    assert contract.run_lock_free(tmp_path) is False
    trainer.close()
    assert contract.run_lock_free(tmp_path) is True
    assert status_of(finished / RUN)["host"] == socket.gethostname()


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_replaced_after_the_fallback(finished, tmp_path):
    out, run_dir = copy_of(finished, tmp_path)
    newest = run_dir / "checkpoints" / "step-20"
    (newest / "optimizer.pt").write_bytes(b"damaged")
    code, stdout, stderr = run(out)
    assert code == 0, stderr
    assert "step-20 has a corrupted optimizer.pt" in stdout and "(step 10," in stdout
    folder, files, marker = run_folder.read_checkpoint(run_dir, ONE, print)
    assert folder.name == "step-20" and files["train_state.pt"]["step"] == marker["step"] == 20
    assert (run_dir / "checkpoints" / "rejected-step-20").is_dir()      # kept aside, never loaded
    exported = consolidate.consolidate(run_dir, tmp_path / "w.pt")
    assert "checkpoints/step-20" in exported


@pytest.mark.slow
def test_a_symlinked_or_misnamed_checkpoint_is_not_trusted(finished, tmp_path):
    out, run_dir = copy_of(finished, tmp_path)
    root = run_dir / "checkpoints"
    (root / "step-30").symlink_to(root / "step-10")                      # holds step 10 under a newer name
    shutil.copytree(root / "step-10", root / "step-25")
    code, stdout, stderr = run(out, "--steps", "30", "--allow-changed-settings")
    assert code == 0, stderr
    assert "step-30 is a symbolic link" in stdout and "step-25 holds step 10 under the name step-25" in stdout
    assert "resumed from" in stdout and "(step 20," in stdout
    assert not (root / "step-30").is_symlink()
    folder, files, _ = run_folder.read_checkpoint(run_dir, ONE, print)
    assert folder.name == "step-30" and files["train_state.pt"]["step"] == 30
    assert [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())] == \
        list(range(31))


DAMAGE_NEWEST = {          # the newest checkpoint only: the run falls back to step-10 and completes
    "marker without model.pt": ("model.pt", None),
    "train_state step 'abc'": ("train_state.pt", {"step": "abc", "tokens": 0}),
    "train_state {}": ("train_state.pt", {}),
    "model.pt {}": ("model.pt", {}),
    "no rank0.pt": ("rank0.pt", None),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(DAMAGE_NEWEST))
def test_a_newest_checkpoint_whose_content_is_wrong_falls_back(finished, tmp_path, damage):
    out, run_dir = copy_of(finished, tmp_path)
    name, obj = DAMAGE_NEWEST[damage]
    reseal(run_dir / "checkpoints" / "step-20", name, obj)
    code, stdout, stderr = run(out)
    assert code == 0 and stderr == "", stderr
    assert "checkpoint step-20" in stdout and "(step 10," in stdout and "data-streams" not in stdout
    assert status_of(run_dir)["state"] == "completed" and status_of(run_dir)["step"] == 20


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["train_state.pt", "config [] ", "config null", "optimizer groups"])
def test_a_run_that_cannot_resume_refuses_in_one_line_and_records_it(finished, tmp_path, damage):
    out, run_dir = copy_of(finished, tmp_path)
    extra = []
    if damage == "train_state.pt":
        for folder in (run_dir / "checkpoints").iterdir():
            reseal(folder, "train_state.pt", {"step": "abc"})
    elif damage.startswith("config"):
        (run_dir / "config.json").write_text("[]" if damage == "config [] " else '{"config": null}')
    else:
        extra = ["--no-mixing-decay", "--allow-changed-settings"]        # the optimizer's groups differ
    code, stdout, stderr = run(out, *extra)
    assert code == 2 and one_line(stderr), stderr
    status = status_of(run_dir)
    assert status["state"] == "failed" and status["exit_code"] == 2 and status["step"] == 20


@pytest.mark.slow
@pytest.mark.parametrize("line", ["[]", "[" * 100_000 + "]" * 100_000, '{"step": "abc"}'])
def test_a_metrics_line_that_is_no_record_is_dropped_with_a_warning(finished, tmp_path, line):
    out, run_dir = copy_of(finished, tmp_path)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(line + "\n")
    code, stdout, stderr = run(out, "--steps", "25", "--allow-changed-settings")
    assert code == 0, stderr
    assert "1 line(s) that are not metrics records" in stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(26))


def test_a_full_disk_still_records_the_final_state(tmp_path, monkeypatch):
    """A disk that fills up while the run is going: from then on a write finds room only where a file was deleted."""
    log = run_folder.RunLog(tmp_path, enabled=True)
    log.status("running", 7)
    real_write = run_folder.write_json_atomic

    def used():
        return sum(f.stat().st_size for f in tmp_path.iterdir() if f.is_file())

    full_at = used()

    def full_until_freed(path, obj):
        if used() >= full_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, obj)

    monkeypatch.setattr(run_folder, "write_json_atomic", full_until_freed)
    log.status("failed", 7, 1, "could not write checkpoint step-8 (No space left on device)")
    assert status_of(tmp_path)["state"] == "failed" and not (tmp_path / ".status-reserve").exists()


def test_the_checkpoint_write_failure_line_reads_as_one_sentence(tmp_path, monkeypatch):
    def full(obj, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(TrainerError) as failure:
        run_folder.write_checkpoint(tmp_path, 10, {"model.pt": {}}, ONE, keep=2)
    assert "metrics.jsonl is intact (no earlier checkpoint exists)" in str(failure.value)
    assert "and so is" not in str(failure.value)


def test_report_survives_a_huge_step_and_a_deeply_nested_line(finished, tmp_path):
    out, run_dir = copy_of(finished, tmp_path)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 1e400, "loss": 1.0}\n' + "[" * 50_000 + "]" * 50_000 + "\n" + '{"step": 21}\n')
    (run_dir / "status.json").write_text('{"state": "running", "step": 1e400}')
    result = subprocess.run([sys.executable, "report.py", str(out), "--no-plots"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "metrics.jsonl:22: skipped 2 unreadable metrics line(s)" in result.stderr
    assert (out / "report" / "results.md").exists()


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rank_pids(run_dir):
    return [int((run_dir / f"rank{r}.pid").read_text()) for r in (0, 1)]


@pytest.fixture
def gloo_job(tmp_path):
    """The launcher on one pretend GPU, running a 2-process gloo job under torchrun whose ranks ignore SIGTERM
    (as ranks stuck in a collective would); every rank still alive is killed when the test ends."""
    from launcher_harness import launcher_env, start
    env = launcher_env(tmp_path, RUN_EXPERIMENTS_TRAINER=f"{sys.executable} {ROOT}/tests/support/gloo_rank.py",
                       RUN_EXPERIMENTS_STOP_TIMEOUT=1)
    proc = start(tmp_path, "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0", env=env)
    run_dir, seen = tmp_path / "runs" / "hc_d2_s1", set()
    yield proc, run_dir, seen
    if proc.poll() is None:
        proc.kill()
    for pid in seen:
        if alive(pid):
            os.kill(pid, 9)


def test_the_launchers_stop_ends_every_rank_of_a_torchrun_job(gloo_job):
    from launcher_harness import wait_for
    proc, run_dir, seen = gloo_job
    wait_for(lambda: len(rank_pids(run_dir)) == 2, timeout=120, what="both ranks to join")
    seen.update(rank_pids(run_dir))
    proc.send_signal(15)              # SIGTERM, which the ranks ignore; RUN_EXPERIMENTS_STOP_TIMEOUT=1 then kills
    output = proc.communicate(timeout=120)[0]
    assert "killing them" in output, output
    wait_for(lambda: not any(map(alive, seen)), timeout=10, what="the ranks to be gone")


@pytest.mark.slow
def test_the_ranks_of_a_torchrun_that_died_are_ended_before_the_job_is_requeued(gloo_job):
    from launcher_harness import wait_for
    proc, run_dir, seen = gloo_job
    wait_for(lambda: len(rank_pids(run_dir)) == 2, timeout=120, what="both ranks to join")
    first = rank_pids(run_dir)
    seen.update(first)
    torchrun = int(subprocess.run(["ps", "-o", "ppid=", "-p", str(first[0])], capture_output=True,
                                  text=True).stdout)
    os.kill(torchrun, 9)              # torchrun dies; its ranks, in sessions of their own, would live on
    wait_for(lambda: rank_pids(run_dir) != first, timeout=120, what="the job to be requeued")
    seen.update(rank_pids(run_dir))
    assert not any(map(alive, first))
    proc.send_signal(15)
    proc.communicate(timeout=120)
    wait_for(lambda: not any(map(alive, seen)), timeout=10, what="the ranks to be gone")


def torchrun_fsdp(out, *args):
    """A tiny mHC run under FSDP on two gloo processes (one process is not sharded)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_c4.py",
               "--preset", "tiny", "--parallel", "fsdp", "--out", str(out), *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    return result.returncode, result.stdout, result.stderr


@pytest.mark.slow
def test_a_dcp_checkpoint_with_a_refused_payload_falls_back_to_the_previous_one(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    code, _, stderr = torchrun_fsdp(tmp_path, "--steps", "20")
    assert code == 0, stderr
    folder, witness = tmp_path / RUN / "checkpoints" / "step-20", tmp_path / "pwned"
    cfg = parse_config(["--preset", "tiny"])
    model = GPT(cfg)
    for module in model.modules():                     # as FSDP holds them: scalars as 1-element vectors
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                setattr(module, name, torch.nn.Parameter(param.detach().reshape(1)))
    optimizer = make_optimizer(model, cfg)
    model(*[torch.zeros(2, cfg.seq_len, dtype=torch.long)] * 2)[1].backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    optimizer_state["param_groups"][0]["lr"] = Exploit(witness)      # a non-tensor entry DCP would unpickle
    shutil.rmtree(folder / run_folder.SHARDED)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / run_folder.SHARDED, no_dist=True)
    marker = json.loads((folder / run_folder.MARKER).read_text())
    marker["files"] = {name: digest for name, digest in marker["files"].items() if not name.startswith(run_folder.SHARDED)}
    marker["files"] |= {f"{run_folder.SHARDED}/{p.name}": run_folder.sha256(p) for p in (folder / run_folder.SHARDED).iterdir()}
    (folder / run_folder.MARKER).write_text(json.dumps(marker))
    code, stdout, stderr = torchrun_fsdp(tmp_path, "--steps", "20")
    assert code == 0, stderr
    assert not witness.exists()
    assert "step-20 does not fit this run" in stdout and "cannot be loaded safely" in stdout and "(step 10," in stdout
    assert (tmp_path / RUN / "checkpoints" / "rejected-step-20").is_dir()
    assert json.loads((folder / run_folder.MARKER).read_text())["step"] == 20


def test_report_reads_a_crafted_matrix_log_with_a_warning(tmp_path, capsys):
    from hcstudy.report import live
    (tmp_path / "matrix.log").write_text("2026-01-01T00:00:00.000+0000 QUEUE slots=x runs=hc_d2_s1\n")
    assert live.read_matrix(tmp_path) is None
    assert "its last QUEUE line is unreadable" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name", [".status-reserve", ".lock", "train.log", "metrics.jsonl", "checkpoints"])
def test_a_link_in_a_run_folder_is_refused_and_its_target_untouched(tmp_path, name):
    victim = tmp_path / "victim"
    victim.write_text("data\n")
    (tmp_path / "out" / "r").mkdir(parents=True)
    (tmp_path / "out" / "r" / name).symlink_to(victim)
    code, _, stderr = run(tmp_path / "out", "--steps", "2", "--run-name", "r")
    assert code == 2 and one_line(stderr) and f"r/{name} is a symbolic link" in stderr, stderr
    assert victim.read_text() == "data\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out", "victim"]


def test_the_run_folders_files_are_never_opened_through_a_link(tmp_path):
    """What refuse_links checks at the start also holds for a link made later: O_NOFOLLOW."""
    victim = tmp_path / "victim"
    victim.write_text("data\n")
    (tmp_path / "train.log").symlink_to(victim)
    with pytest.raises(ConfigError, match="train.log is a symbolic link"):
        run_folder.open_own(tmp_path / "train.log", "a")
    assert victim.read_text() == "data\n"


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoints_link_swapped_in_during_the_run_is_never_written_through(tmp_path, sharded):
    """The trainer paused, checkpoints/ moved out of the run folder and a link put in its place, the trainer going on:
    the next checkpoint is refused (exit 2), nothing written through the link."""
    run_dir, outside = tmp_path / "out" / RUN, tmp_path / "moved"
    held = run_folder.held_run_folder(run_dir)
    shards = {"model": {"w": torch.ones(3)}} if sharded else None
    run_folder.write_checkpoint(run_dir, 4, {"train_state.pt": {"step": 4}}, ONE, keep=5, sharded=shards, held=held)
    os.replace(run_dir / "checkpoints", outside)
    (run_dir / "checkpoints").symlink_to(outside)
    with pytest.raises(ConfigError, match=r"checkpoints was replaced during the run by a symbolic link"):
        run_folder.write_checkpoint(run_dir, 8, {"train_state.pt": {"step": 8}}, ONE, keep=5, sharded=shards, held=held)
    assert [p.name for p in outside.iterdir()] == ["step-4"]


def test_a_run_folder_moved_during_the_run_keeps_its_checkpoints_off_what_is_put_in_its_place(tmp_path, monkeypatch):
    """Every write of a checkpoint goes through the folders opened at the start, also DCP's (it takes a path): a
    link swapped in while DCP writes does not take its files."""
    import torch.distributed.checkpoint as dcp
    run_dir, outside = tmp_path / "out" / RUN, tmp_path / "moved"
    held = run_folder.held_run_folder(run_dir)
    real_save = dcp.save

    def swap_then_save(*args, **kwargs):
        os.replace(run_dir, outside)
        run_dir.mkdir()
        (run_dir / "checkpoints").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
        (tmp_path / "elsewhere").mkdir()
        return real_save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", swap_then_save)
    run_folder.write_checkpoint(run_dir, 4, {"train_state.pt": {"step": 4}}, ONE, keep=5,
                                sharded={"model": {"w": torch.ones(3)}}, held=held)
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert run_folder.read_marker(outside / "checkpoints" / "step-4")["format"] == "sharded"


@pytest.mark.slow
@pytest.mark.parametrize("emptied", [True, False])
def test_a_run_with_history_but_no_checkpoint_is_refused_and_resume_never_moves_it_aside(finished, tmp_path,
                                                                                         emptied):
    out, run_dir = copy_of(finished, tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    if emptied:
        (run_dir / "checkpoints").mkdir()
    else:       # a kill before the next log step: status.json does not name the checkpoint yet
        status = status_of(run_dir)
        del status["last_checkpoint_step"]
        (run_dir / "status.json").write_text(json.dumps(status))
    history = (run_dir / "metrics.jsonl").read_bytes()
    code, _, stderr = run(out)
    assert code == 2 and one_line(stderr), stderr
    assert "metrics to step 20" in stderr and "--run-name" in stderr and "--resume never" in stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == history
    assert status_of(run_dir)["state"] == "failed" and status_of(run_dir)["exit_code"] == 2
    code, stdout, stderr = run(out, "--resume", "never")
    assert code == 0 and "moved to" in stdout, stderr
    assert (run_dir / "previous-1" / "metrics.jsonl").read_bytes() == history
    assert (run_dir / "previous-1" / "config.json").exists() and status_of(run_dir)["state"] == "completed"
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == \
        list(range(21))


KILL_ONCE_STEP_8_IS_SAVED = """
import os, signal, sys, train_c4
_step = train_c4.Trainer.optimizer_step
def optimizer_step(self, *args):
    if self.step == 8:              # checkpoints/step-8 sealed and metrics written to step 8: kill -9 there
        os.kill(os.getpid(), signal.SIGKILL)
    return _step(self, *args)
train_c4.Trainer.optimizer_step = optimizer_step
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A --steps 20 --ckpt-every 4 run killed once checkpoints/step-8 exists, copied afresh by each test."""
    out = tmp_path_factory.mktemp("killed")
    argv = ["--preset", "tiny", "--steps", "20", "--ckpt-every", "4", "--out", str(out)]
    code = f"{KILL_ONCE_STEP_8_IS_SAVED}\nsys.exit(train_c4.main({argv!r}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == -9 and (out / RUN / "checkpoints" / "step-8" / run_folder.MARKER).exists()
    return out


def steps_of(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_changed_settings_are_refused_by_the_checkpoint_itself_when_config_json_is_gone(killed, tmp_path):
    out, run_dir = copy_of(killed, tmp_path)
    (run_dir / "config.json").unlink()
    code, _, stderr = run(out, "--ckpt-every", "4", "--lr", "0.0005")
    assert code == 2 and one_line(stderr), stderr
    assert "checkpoint" in stderr and "step-8 was trained with other settings (lr 0.003 -> 0.0005)" in stderr
    assert not (run_dir / "config.json").exists() and steps_of(run_dir) == list(range(9))
    code, stdout, stderr = run(out, "--ckpt-every", "4", "--lr", "0.0005", "--allow-changed-settings")
    assert code == 0, stderr
    changes = [json.loads(line) for line in (run_dir / "settings_changes.jsonl").read_text().splitlines()]
    assert [(c["step"], c["changes"]) for c in changes] == [(8, {"lr": [0.003, 0.0005]})]


@pytest.mark.parametrize("flags", [["--ckpt-every", "10"],
                                   ["--ckpt-every", "10", "--lr", "0.001", "--allow-changed-settings"]])
@pytest.mark.slow
def test_no_checkpoint_and_no_status_refuses_by_the_recorded_checkpoint_interval(killed, tmp_path, flags):
    out, run_dir = copy_of(killed, tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "status.json").unlink()
    history = (run_dir / "metrics.jsonl").read_bytes()
    code, _, stderr = run(out, *flags)
    assert code == 2 and one_line(stderr) and "metrics to step 8" in stderr and "--resume never" in stderr, stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == history and not list(run_dir.glob("previous-*"))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["same settings", "changed settings", "no config.json"])
def test_a_run_killed_before_its_first_checkpoint_restarts_only_where_it_recomputes_the_same_lines(killed, tmp_path,
                                                                                                  case):
    out, run_dir = copy_of(killed, tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "status.json").unlink()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(lines[:4]))          # killed at step 3, before step-4's checkpoint
    if case == "no config.json":        # when its first checkpoint was due is unknown
        (run_dir / "config.json").unlink()
    flags = ["--lr", "0.001", "--allow-changed-settings"] if case == "changed settings" else []
    code, _, stderr = run(out, "--ckpt-every", "4", *flags)
    if case == "same settings":
        assert code == 0 and steps_of(run_dir) == list(range(21)), stderr
    else:
        assert code == 2 and one_line(stderr) and "metrics to step 3" in stderr, stderr


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["step-8 line cut in half", "deleted", "emptied"])
def test_metrics_lines_lost_up_to_the_checkpoint_are_said_marked_and_the_file_kept(killed, tmp_path, damage):
    out, run_dir = copy_of(killed, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    text = metrics.read_text()
    if damage == "deleted":
        metrics.unlink()
    else:
        metrics.write_text(text[:len(text) - len(text.splitlines()[-1]) // 2 - 1] if damage != "emptied" else "")
    found = metrics.read_bytes() if metrics.exists() else None
    code, stdout, stderr = run(out, "--ckpt-every", "4")
    assert code == 0, stderr
    lost = "8" if damage.startswith("step-8") else "0-8"
    said = f"warning: {metrics} lacks the lines of step(s) {lost} (cut or deleted)"
    assert said in stdout and said in (run_dir / "train.log").read_text()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(21))
    assert [r["step"] for r in records if r.get("lost")] == ([8] if lost == "8" else list(range(9)))
    aside = run_dir / "metrics.damaged-1.jsonl"
    assert (aside.read_bytes() if aside.exists() else None) == found
    code, stdout, stderr = run(out, "--ckpt-every", "4", "--steps", "24", "--allow-changed-settings")
    assert code == 0 and "lacks the lines" not in stdout and steps_of(run_dir) == list(range(25)), stderr


@pytest.mark.slow
def test_a_checkpoint_whose_token_count_is_forged_falls_back(finished, tmp_path):
    out, run_dir = copy_of(finished, tmp_path)
    newest = run_dir / "checkpoints" / "step-20"
    state = torch.load(newest / "train_state.pt", weights_only=True)
    assert state["tokens"] == 20 * 4 * 32                                   # batch size x seq_len per step
    reseal(newest, "train_state.pt", state | {"tokens": state["tokens"] * 2})
    code, stdout, stderr = run(out)
    assert code == 0 and stderr == "", stderr
    assert "step-20 holds 5,120 tokens in train_state.pt, not the 2,560 of its 20 steps" in stdout
    assert "(step 10, 1,280 tokens)" in stdout
    assert torch.load(newest / "train_state.pt", weights_only=True)["tokens"] == 2560     # written again


@pytest.mark.parametrize("history", [[[0, 8]], [[0, 4], [0, 8], [5, 4]], [[1, 4]], [[0, 4], [30, 4]], "4", [[0, "4"]]])
def test_a_batch_size_history_that_does_not_fit_the_checkpoint_is_damaged(finished, history):
    folder = finished / RUN / "checkpoints" / "step-20"
    marker = run_folder.read_marker(folder)
    files = run_folder.load_verified(folder, marker)
    assert run_folder.contents_problem(files, marker) is None
    files["train_state.pt"]["batch_sizes"] = history
    assert "the batch sizes of its steps" in run_folder.contents_problem(files, marker)


def poisoned(folder, damage):
    """Non-finite values put into a checkpoint, checksums fixed up: NaN weights, or Adam's second moments times
    infinity (its zeros become NaN, the rest infinite). Returns where the fallback line must say they are."""
    if damage == "NaN weights":
        model = torch.load(folder / "model.pt", weights_only=True)
        reseal(folder, "model.pt", model | {"wte.weight": torch.full_like(model["wte.weight"], float("nan"))})
        return "in model.pt (wte.weight)"
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    for state in optimizer["state"].values():
        state["exp_avg_sq"] *= float("inf")
    reseal(folder, "optimizer.pt", optimizer)
    return f"in optimizer.pt ({len(optimizer['state'])} tensors, the first state.0.exp_avg_sq)"


NON_FINITE = ["NaN weights", "Adam moments x inf"]


@pytest.mark.parametrize("damage", NON_FINITE)
def test_a_checkpoint_holding_non_finite_values_is_damage_and_the_previous_one_is_read(finished, tmp_path, damage):
    _, run_dir = copy_of(finished, tmp_path)
    where = poisoned(run_dir / "checkpoints" / "step-20", damage)
    said = []
    folder, files, _ = run_folder.read_checkpoint(run_dir, ONE, said.append)
    assert folder.name == "step-10" and files["train_state.pt"]["step"] == 10
    assert said == [f"checkpoint step-20 holds non-finite values (NaN or infinity) {where}; falling "
                    "back to the previous one"]


@pytest.mark.slow
@pytest.mark.parametrize("damage", NON_FINITE)
def test_a_resume_never_trains_from_non_finite_values_nor_reads_them_as_a_divergence(finished, tmp_path, damage):
    """Resumed from them, NaN weights stopped the run at step 21 as diverged (exit 3), a false finding; Adam's
    moments times infinity trained on without a word."""
    out, run_dir = copy_of(finished, tmp_path)
    where = poisoned(run_dir / "checkpoints" / "step-20", damage)
    code, stdout, stderr = run(out, "--steps", "30", "--allow-changed-settings")
    assert code == 0 and stderr == "", stderr
    assert f"checkpoint step-20 holds non-finite values (NaN or infinity) {where}" in stdout
    assert "(step 10," in stdout and "set aside as rejected-step-20" in stdout
    assert status_of(run_dir)["state"] == "completed" and status_of(run_dir)["step"] == 30
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(31)) and all(math.isfinite(r.get("loss", 0)) for r in records)


@pytest.mark.parametrize("where", ["model.pt", "sharded"])
def test_a_state_holding_non_finite_values_is_never_sealed(tmp_path, where):
    """A NaN in what a checkpoint would hold (a file, or under FSDP a shard) stops the write before anything is
    written: the previous checkpoint stays the newest."""
    run_folder.write_checkpoint(tmp_path, 10, {"model.pt": {"w": torch.ones(3)}}, ONE, keep=2)
    bad = {"w": torch.tensor([1.0, float("nan")])}
    files, sharded = ({"model.pt": bad}, None) if where == "model.pt" else ({}, {"model": bad})
    with pytest.raises(run_folder.NonFiniteState) as refused:
        run_folder.write_checkpoint(tmp_path, 20, files, ONE, keep=2, sharded=sharded)
    named = "model.pt (w)" if where == "model.pt" else "sharded/model (w)"
    assert str(refused.value).startswith(f"checkpoint step-20 not written: the run's state holds non-finite values "
                                         f"(NaN or infinity) in {named}, though the loss and gradient were finite")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-10"]


@pytest.mark.slow
def test_the_token_count_adds_up_across_a_change_of_batch_size(finished, tmp_path):
    out, run_dir = copy_of(finished, tmp_path)
    code, _, stderr = run(out, "--steps", "30", "--batch-size", "8", "--allow-changed-settings")
    assert code == 0, stderr
    state = torch.load(run_dir / "checkpoints" / "step-30" / "train_state.pt", weights_only=True)
    assert state["batch_sizes"] == [[0, 4], [20, 8]] and state["tokens"] == 20 * 4 * 32 + 10 * 8 * 32
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["tokens"] == state["tokens"]
    code, stdout, stderr = run(out, "--steps", "30", "--batch-size", "8")
    assert code == 0 and "resumed from" in stdout and "(step 30," in stdout, stderr


PENDING_TOKENS_DATA_STATE = """
def pending_tokens(self):       # a data stream's state as checkpoints held it before they held positions
    return {"documents": self.documents.state_dict(), "tokens": self.tokens[self.offset:].clone(), "offset": 0}
import hcstudy.data
hcstudy.data.TokenWindows.state_dict = pending_tokens
"""


# what an interrupted run and the same run uninterrupted must both have logged (the CPU's resumes are bit-exact)
EXACT_KEYS = ("step", "loss", "grad_norm", "lr", "tokens", "val_loss", "amax_fwd", "amax_bwd")


def exact_metrics(run_dir):
    return [[record.get(key) for key in EXACT_KEYS] for record in
            map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """A --steps 12 --ckpt-every 4 run killed once checkpoints/step-8 exists, whose step-8 is as the earlier code
    wrote it: train_state.pt without "config" and "batch_sizes", data states holding the pending tokens; and the
    run folder of the same run uninterrupted. Copied afresh by each test."""
    out, reference = tmp_path_factory.mktemp("earlier"), tmp_path_factory.mktemp("uninterrupted")
    argv = ["--preset", "tiny", "--steps", "12", "--ckpt-every", "4", "--out", str(out)]
    code = f"{KILL_ONCE_STEP_8_IS_SAVED}{PENDING_TOKENS_DATA_STATE}\nsys.exit(train_c4.main({argv!r}))"
    one_thread = {"OMP_NUM_THREADS": "1"}       # as the tests' resumes run (conftest): the probe's sums are exact
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, **one_thread})
    assert result.returncode == -9, result.stderr
    step_8 = out / RUN / "checkpoints" / "step-8"
    state = torch.load(step_8 / "train_state.pt", weights_only=True)
    reseal(step_8, "train_state.pt", {"step": state["step"], "tokens": state["tokens"]})
    assert "tokens" in torch.load(step_8 / "rank0.pt", weights_only=True)["data"]["streams"]["0"]
    assert run(reference, "--steps", "12", "--ckpt-every", "4", env=one_thread)[0] == 0
    return out, reference / RUN


@pytest.mark.parametrize("case", ["as written", "config.json gone"])
def test_a_checkpoint_of_the_earlier_format_resumes_exactly_and_consolidates(earlier, tmp_path, case):
    """Its settings are compared with config.json's, as then; its token count is checked against config.json's
    batch size and seq_len, or, where that cannot be done, taken with a warning; the next checkpoint records its
    settings and the batch sizes from the step resumed."""
    out, run_dir = copy_of(earlier[0], tmp_path)
    step_8 = run_dir / "checkpoints" / "step-8"
    assert str(step_8) in consolidate.consolidate(step_8, tmp_path / "w.pt")
    if case == "config.json gone":
        (run_dir / "config.json").unlink()
    code, stdout, stderr = run(out, "--steps", "12", "--ckpt-every", "4")
    assert code == 0 and "(step 8, 1,024 tokens)" in stdout, stderr
    said = "warning: the token count of checkpoint step-8 (1,024) cannot be verified: it was written before " \
           "checkpoints recorded their batch sizes, and config.json is gone; it is taken as it is"
    assert (run_dir / "train.log").read_text().count(said) == (case == "config.json gone")
    assert exact_metrics(run_dir) == exact_metrics(earlier[1])
    folder, files, _ = run_folder.read_checkpoint(run_dir, ONE, print)
    state = files["train_state.pt"]
    assert folder.name == "step-12" and state["config"]["batch_size"] == 4 and state["tokens"] == 12 * 4 * 32
    assert {key: state.get(key) for key in ["batch_sizes", "unverified_tokens"]} == (
        {"batch_sizes": [[0, 4]], "unverified_tokens": None} if case == "as written" else
        {"batch_sizes": [[8, 4]], "unverified_tokens": 1024})


def test_the_token_count_of_an_earlier_checkpoint_is_checked_where_its_run_folder_can_check_it(earlier, tmp_path):
    _, run_dir = copy_of(earlier[0], tmp_path)
    step_8 = run_dir / "checkpoints" / "step-8"
    reseal(step_8, "train_state.pt", {"step": 8, "tokens": 2048})
    marker = run_folder.read_marker(step_8)
    assert "holds 2,048 tokens in train_state.pt, not the 1,024 of its 8 steps" in \
        run_folder.load_checked(step_8, marker)[1]
    # a batch size changed since: the count cannot be checked without the history, and is taken as it is
    (run_dir / "settings_changes.jsonl").write_text(json.dumps({"step": 8, "changes": {"batch_size": [4, 8]}}) + "\n")
    files, problem = run_folder.load_checked(step_8, marker)
    assert problem is None and files["train_state.pt"]["batch_sizes"] == []


def test_a_running_state_on_a_full_disk_leaves_the_reserve_for_the_final_state(tmp_path, monkeypatch):
    log = run_folder.RunLog(tmp_path, enabled=True)
    real_write = run_folder.write_json_atomic

    def full_while_reserved(path, obj):
        if (tmp_path / ".status-reserve").exists():
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, obj)

    monkeypatch.setattr(run_folder, "write_json_atomic", full_while_reserved)
    with pytest.raises(run_folder.WriteFailed):
        log.status("running", 12)
    assert (tmp_path / ".status-reserve").exists()
    log.status("failed", 12, 1, "could not append step 13 (No space left on device)")
    assert status_of(tmp_path)["state"] == "failed"


def run_with_status_writes_failing_after_step_10(tmp_path, when: str, error: str):
    """The tiny trainer in a fresh process whose status.json writes raise `error` once step-10 is sealed, while `when`
    holds (both Python source)."""
    prelude = f"""
import errno
from hcstudy import run_folder
_seal, _write, _sealed = run_folder.seal, run_folder.write_json_atomic, []
def seal(*args):
    _seal(*args)
    _sealed.append(True)
def write(path, obj):
    if _sealed and {when}:
        raise {error}
    _write(path, obj)
run_folder.seal, run_folder.write_json_atomic = seal, write
"""
    code = f"{prelude}\nimport sys, train_c4\nsys.exit(train_c4.main({['--preset', 'tiny', '--out', str(tmp_path)]!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_a_full_disk_after_a_checkpoint_still_records_the_failure(tmp_path):
    """The disk fills right after step-10 is sealed: the next `running` state fails the run, which is recorded."""
    reserved = 'run_folder.Path(path.parent / ".status-reserve").exists()'
    result = run_with_status_writes_failing_after_step_10(tmp_path, reserved, 'OSError(errno.ENOSPC, "No space left '
                                                          'on device")')
    assert result.returncode == 1 and one_line(result.stderr), result.stderr
    assert f"could not record the state running in {tmp_path / RUN / 'status.json'} (No space left on device); " \
           "metrics.jsonl and the checkpoints are intact" in result.stderr
    status = status_of(tmp_path / RUN)
    assert status["state"] == "failed" and "No space left on device" in status["reason"]


def test_a_run_folder_made_immutable_mid_run_names_the_file_and_that_status_json_is_stale(tmp_path):
    """chattr +i on the run folder after step-10 is sealed: no file can be created in it (status.json's temp file);
    the line names status.json, what is intact, and that status.json could not record the failure."""
    result = run_with_status_writes_failing_after_step_10(tmp_path, "True", 'PermissionError(errno.EPERM, "Operation '
                                                          'not permitted", str(path.with_name(f".{path.name}.tmp")))')
    assert result.returncode == 1 and one_line(result.stderr), result.stderr
    assert "could not record the state running in" in result.stderr and "status.json (Operation not permitted)" in \
        result.stderr and "checkpoints are intact" in result.stderr, result.stderr
    assert result.stderr.rstrip().endswith("status.json could not record the failure either (Operation not permitted)")
    assert (tmp_path / RUN / "checkpoints" / "step-10").is_dir()


def test_a_lock_that_is_a_folder_is_refused_and_recorded(tmp_path):
    (tmp_path / "out" / RUN / ".lock").mkdir(parents=True)
    code, _, stderr = run(tmp_path / "out")
    assert code == 2 and one_line(stderr) and ".lock is a folder" in stderr, stderr
    status = status_of(tmp_path / "out" / RUN)
    assert status["state"] == "failed" and status["exit_code"] == 2


def test_a_run_that_fails_while_it_is_built_records_why_and_keeps_an_earlier_record(finished, tmp_path):
    """--attn flash is refused only once the folder is locked (it asks the device): a new folder records `failed`
    with the printed reason; a finished run's folder keeps its `completed`."""
    code, _, stderr = run(tmp_path / "new", "--attn", "flash")
    assert code == 2 and one_line(stderr) and "--attn flash" in stderr, stderr
    status = status_of(tmp_path / "new" / RUN)
    assert (status["state"], status["exit_code"], status["step"]) == ("failed", 2, 0)
    assert status["reason"] in stderr
    out, run_dir = copy_of(finished, tmp_path)
    code, _, stderr = run(out, "--attn", "flash")
    assert code == 2 and one_line(stderr), stderr
    assert status_of(run_dir)["state"] == "completed"


@pytest.mark.slow
def test_a_resume_keeps_only_keep_checkpoints(tmp_path):
    """A kill between a seal and its prune leaves one checkpoint too many; the rerun prunes it."""
    assert run(tmp_path, "--ckpt-every", "5", "--keep-checkpoints", "3")[0] == 0
    code, stdout, stderr = run(tmp_path, "--ckpt-every", "5", "--keep-checkpoints", "2")
    assert code == 0, stderr
    assert sorted(d.name for d in (tmp_path / RUN / "checkpoints").iterdir()) == ["step-15", "step-20"]


def test_the_refusal_of_a_crafted_pickle_never_advises_weights_only_false(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.getcwd, ())

    torch.save({"x": Payload()}, tmp_path / "model.pt")
    with pytest.raises(Exception) as refused:
        torch.load(tmp_path / "model.pt", weights_only=True)
    line = run_folder.first_cause(refused.value)
    assert "weights_only" not in line and "getcwd" in line and "refused" in line


def test_a_run_from_before_these_flags_resumes_and_a_changed_arm_does_not(tmp_path):
    run = tmp_path / "hc_d2_s42"
    run.mkdir()
    cfg = tiny_config("hc")
    old = {k: v for k, v in json.loads(json.dumps({"config": T.dataclasses.asdict(cfg)}))["config"].items()
           if k not in ("coefficients", "collapse", "read_stream", "dynamic_init_std", "mixing_norm")}
    (run / "config.json").write_text(json.dumps({"config": old}))
    log = run_folder.RunLog(run, enabled=False)
    assert check_resumable(run, cfg, log) == {}
    with pytest.raises(ConfigError, match="coefficients='token'.*coefficients='sequence'"):
        check_resumable(run, T.dataclasses.replace(cfg, coefficients="sequence"), log)


def test_a_study_run_from_before_its_arms_resumes_as_its_arm_and_a_mix_is_refused(tmp_path):
    """Recorded as hc with the retired settings at the study's values, a run folder resumes as study-hc; with one
    of them at the paper's value it was a model this version cannot build."""
    run = tmp_path / "hc_d2_s42_seed-study"
    run.mkdir()
    cfg = tiny_config("study-hc")
    retired = {key: study for key, (_, study) in contract.RETIRED_STUDY_SETTINGS["hc"].items()}
    old = {**json.loads(json.dumps(T.dataclasses.asdict(cfg))), "residual": "hc", **retired}
    log = run_folder.RunLog(run, enabled=False)
    (run / "config.json").write_text(json.dumps({"config": old}))
    assert check_resumable(run, cfg, log) == {}
    (run / "config.json").write_text(json.dumps({"config": {**old, "hc_write_init": "all"}}))
    with pytest.raises(ConfigError, match="--coefficient-norm flat, a setting this version no longer has"):
        check_resumable(run, cfg, log)
