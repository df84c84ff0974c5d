"""Failures tried for real: bad shards, a disk that fills up, a checkpoint crafted to run code, and
random command lines. Each must end in a clear message and lose nothing already written."""
import collections
import contextlib
import dataclasses
import errno
import gzip
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from hcstudy import consolidate
from hcstudy import failures
from hcstudy import run_folder
import train_c4 as T
from hcstudy.config import parse_config
from hcstudy.contract import ConfigError, TrainerError
from hcstudy.data import ByteTokenizer, DataFiles, DocumentStream, RankBatches, fixed_sequences, resolve_data_files
from hcstudy.distributed import Dist
from hcstudy.model import GPT
from hcstudy.optim import decay_groups
from hcstudy.run_folder import rng_state
from helpers import Exploit

ROOT = Path(__file__).resolve().parents[2]


def run(out, *args, prelude=""):
    """The trainer in a fresh process; `prelude` runs first (to wrap a function, as a failing disk would)."""
    code = f"{prelude}\nimport sys, train_c4\nsys.exit(train_c4.main({['--preset', 'tiny', '--out', str(out), *args]!r}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    return result.returncode, result.stdout, result.stderr


def shard(path, lines, raw=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    if raw is not None:
        path.write_bytes(raw)
        return
    with gzip.open(path, "wb") as f:
        f.write(b"".join(line if isinstance(line, bytes) else (line + "\n").encode() for line in lines))


def doc(i, text=None):
    return json.dumps({"text": text or f"document number {i} " * 8, "timestamp": "2019-04-25T12:00:00Z",
                       "url": f"https://example.com/{i}"})


def loader(files, streams=1):
    cfg = parse_config(["--preset", "tiny", "--data-streams", str(streams), "--batch-size", "2",
                          "--micro-batch-size", "2"])
    return RankBatches([str(f) for f in files], ByteTokenizer(), cfg, rank=0, world=1, micro=2)


def test_bad_lines_are_skipped_and_counted_and_big_documents_pass(tmp_path):
    lines = [doc(i) for i in range(40)]
    lines[3] = "\x00\x01 garbage {"                                  # not JSON
    lines[4] = json.dumps({"url": "no text here"})
    lines[5] = doc(5, text="   ")                                   # an empty document
    lines[7] = doc(7, text="x" * 10_000_000)                        # a 10 MB single document
    shard(tmp_path / "c4-train.00000-of-00001.json.gz", lines)
    stream = DocumentStream([str(tmp_path / "c4-train.00000-of-00001.json.gz")], 0, 1, seed=None, buffer_size=0)
    documents = []
    for text in stream:
        if stream.epoch:
            break
        documents.append(text)
    assert len(documents) == 37 and stream.skipped == 3 and max(map(len, documents)) == 10_000_000
    batches = loader([tmp_path / "c4-train.00000-of-00001.json.gz"])
    assert all(batches.next_batch()[0].shape == (2, 32) for _ in range(20))


# mtime=0 and named ids: a gzip header holds the time it was made, and xdist's workers must collect the same names.
@pytest.mark.parametrize("content", [b"", b"this is not gzip at all", gzip.compress(b"", mtime=0),
                                     gzip.compress(b'{"text": "caf\xe9 is not UTF-8"}\n', mtime=0)],
                         ids=["empty file", "not gzip", "empty gzip", "gzip not UTF-8"])
def test_an_unusable_shard_is_a_clear_error_not_a_hang(tmp_path, content):
    path = tmp_path / "c4-train.00000-of-00001.json.gz"
    shard(path, [], raw=content)
    with pytest.raises(ConfigError, match="unreadable|no usable document"):
        loader([path]).next_batch()


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_keeps_the_previous_one_and_the_rerun_resumes(tmp_path):
    # the second checkpoint write fails as a full disk would: ENOSPC from inside torch.save
    prelude = """
import errno, torch
_real_save, _calls = torch.save, []
def _save(obj, path, *a, **k):
    if str(path).endswith("model.pt"):
        _calls.append(path)
        if len(_calls) == 2:
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
    return _real_save(obj, path, *a, **k)
torch.save = _save
"""
    code, stdout, stderr = run(tmp_path, "--residual", "hc", prelude=prelude)
    assert code == 1 and "No space left on device" in stderr and "previous checkpoint step-10 and metrics.jsonl are intact" in stderr
    assert len(stderr.strip().splitlines()) == 1
    run_dir = tmp_path / "hc_d2_s42"
    assert [d.name for d in (run_dir / "checkpoints").iterdir()] == ["step-10"]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 1 and "step-20" in status["reason"]
    code, stdout, stderr = run(tmp_path, "--residual", "hc")
    assert code == 0, stderr
    assert "resumed from" in stdout and "(step 10," in stdout


WRITE_ERRORS = {
    "full disk": OSError(errno.ENOSPC, "No space left on device"),
    "full disk inside torch.save": RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
    "quota": OSError(errno.EDQUOT, "Disk quota exceeded"),
    "permission": PermissionError(errno.EACCES, "Permission denied"),
    "read-only": OSError(errno.EROFS, "Read-only file system"),
}


@pytest.mark.parametrize("kind", sorted(WRITE_ERRORS))
def test_every_kind_of_write_failure_is_one_line_naming_what_is_intact(tmp_path, monkeypatch, kind):
    one = Dist(0, 1, torch.device("cpu"))
    run_folder.write_checkpoint(tmp_path, 10, {"model.pt": {"w": torch.ones(3)}}, one, keep=2)
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)                    # a partial file, then the error
        raise WRITE_ERRORS[kind]

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(TrainerError) as failure:
        run_folder.write_checkpoint(tmp_path, 20, {"model.pt": {"w": torch.zeros(3)}}, one, keep=2)
    message = str(failure.value)
    assert "\n" not in message and "could not write checkpoint step-20" in message
    assert "previous checkpoint step-10 and metrics.jsonl are intact" in message
    assert (str(WRITE_ERRORS[kind].strerror) if kind != "full disk inside torch.save" else "unexpected pos") in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-10"]     # no .tmp-step-20


def test_a_status_or_metrics_write_failure_is_one_line_and_leaves_no_temp_file(tmp_path, monkeypatch):
    log = run_folder.RunLog(tmp_path, enabled=True)
    log.status("running", 0)
    log.open_metrics(keep_through_step=-1)
    real_write_text = Path.write_text

    def full_disk(path, *args, **kwargs):
        real_write_text(path, "{", *args[1:], **kwargs)          # a partial temp file, then the error
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(run_folder.WriteFailed, match=r"could not record the state running in .*status.json \(No space"):
        log.status("running", 5)
    # a running state leaves the reserve to the final state
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", ".status-reserve", "metrics.jsonl", "status.json",
                                                          "train.log"]
    with pytest.raises(run_folder.WriteFailed, match=r"status.json .*; metrics.jsonl and the checkpoints are intact"):
        log.status("failed", 5, 1, "No space left on device")
    # the status-reserve file was spent on a second try, which failed too
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "metrics.jsonl", "status.json", "train.log"]
    assert json.loads((tmp_path / "status.json").read_text())["step"] == 0
    code, reason = failures.classify_failure(OSError(errno.ENOSPC, "No space left on device", "status.json"), None)
    assert (code, reason) == (1, "No space left on device: status.json")

    class OverQuota:
        def write(self, text):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

    log.metrics_file.close()
    log.metrics_file = OverQuota()
    with pytest.raises(TrainerError, match=r"could not append step 3 .*Disk quota exceeded.*intact"):
        log.metrics({"step": 3})


def test_a_full_disk_refusing_train_log_names_it_and_what_is_intact(tmp_path):
    log = run_folder.RunLog(tmp_path, enabled=True)

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")        # write() names no file

    log.log_file = FullDisk()
    with pytest.raises(run_folder.WriteFailed, match=r"could not append to .*train.log \(No space left on device\); "
                                                    r"metrics.jsonl and the checkpoints are intact"):
        log.info("step 12/20", terminal=False)


@pytest.mark.slow
def test_a_file_size_limit_ends_the_run_with_one_line_and_status_failed(tmp_path):
    """A real limit (ulimit -f, in KiB): the optimizer state, the largest file of a checkpoint (2.3 MB at width 96),
    cannot be written, torch.save fails with a RuntimeError; nothing else is that large (.status-reserve: 1 MiB)."""
    command = (f"ulimit -f 2000 && exec {sys.executable} train_c4.py --preset tiny --width 96 --steps 10 "
               f"--out {tmp_path}")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error: could not write checkpoint step-10") and "no earlier checkpoint" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    run_dir = tmp_path / "mhc_d2_s42"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 1 and "step-10" in status["reason"]
    assert list((run_dir / "checkpoints").iterdir()) == [] and not list(run_dir.glob(".*.tmp"))
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 11         # every step logged is kept


@pytest.mark.slow
def test_a_checkpoint_crafted_to_run_code_is_refused(tmp_path):
    assert run(tmp_path, "--residual", "mhc", "--steps", "10")[0] == 0
    folder = tmp_path / "mhc_d2_s42" / "checkpoints" / "step-10"
    witness = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {witness}",))

    torch.save({"model": Exploit()}, folder / "model.pt")
    marker = json.loads((folder / run_folder.MARKER).read_text())        # an attacker can fix the checksums too
    marker["files"]["model.pt"] = run_folder.sha256(folder / "model.pt")
    (folder / run_folder.MARKER).write_text(json.dumps(marker))
    code, stdout, stderr = run(tmp_path, "--residual", "mhc", "--steps", "20", "--allow-changed-settings")
    assert not witness.exists()
    assert "step-10 cannot be loaded safely" in stdout
    assert code == 2 and "no checkpoint" in stderr and "is usable" in stderr
    assert len((tmp_path / "mhc_d2_s42" / "metrics.jsonl").read_text().splitlines()) == 11   # history kept


NUMBERS = ["nan", "inf", "-inf", "-1", "0", "1e-300", "0.5", "1e6", "1e38", "1e300", "x"]
COUNTS = ["-1", "0", "1", "3", "1e11", "99999999999999999999999", "ten"]
FLAGS = {
    "--depth": st.integers(-2, 4), "--width": st.sampled_from([0, 8, 12, 16, 30]),
    "--heads": st.integers(-1, 4), "--batch-size": st.integers(-1, 8), "--micro-batch-size":
    st.sampled_from(["0", "1", "2", "3", "auto", "x"]), "--residual": st.sampled_from(["hc", "mhc", "baseline", "x"]),
    "--lr": st.sampled_from(["1e-3", "nan?", *NUMBERS]), "--data": st.sampled_from(["sample", "/no/such/*.gz"]),
    "--preset": st.sampled_from(["tiny", "demo", "nope"]), "--data-streams": st.integers(0, 3),
    "--run-name": st.sampled_from(["ok", "a/b", ".hidden"]), "--tokenizer": st.sampled_from(["byte", "gpt2", "bpe"]),
    "--steps": st.sampled_from(["1", "0", "ten", "1e23", "100000000000000000000000"]),
    **{flag: st.sampled_from(NUMBERS) for flag in (
        "--grad-clip", "--weight-decay", "--norm-eps", "--mhc-res-diag", "--hc-scale-init", "--mhc-gate-init",
        "--data-timeout", "--min-lr-ratio", "--gpu-memory-gb")},
    **{flag: st.sampled_from(COUNTS) for flag in (
        "--seed", "--data-seed", "--shuffle-buffer", "--eval-batches", "--warmup", "--seq-len", "--prefetch")},
    "--out": st.sampled_from(["/proc/nope", "A_FILE", "A_FILE/under"]),
}


def test_random_command_lines_give_a_run_or_one_line_error(tmp_path):
    """Everything the trainer checks before it allocates anything (main -> parse_config -> preflight: the batch
    plan, the memory floor, the data files, --out): any flag combination is accepted or refused in one line with
    exit 2, never a traceback. The accepted settings that could diverge are run for real below."""
    (tmp_path / "a-file").write_text("x")
    outcomes = collections.Counter()

    def preflight_only(cfg):
        T.preflight(cfg, Dist(0, 1, torch.device("cpu")))

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.dictionaries(st.sampled_from(sorted(FLAGS)), st.none(), max_size=6).flatmap(
        lambda chosen: st.fixed_dictionaries({flag: FLAGS[flag] for flag in chosen})))
    def one_command_line(flags):
        argv = ["--preset", "tiny", "--out", str(tmp_path / "out")] + [item for flag, value in flags.items() for item in (flag, str(value))]
        argv = [a.replace("A_FILE", str(tmp_path / "a-file")) for a in argv]
        stderr = io.StringIO()
        with mock.patch.object(T, "train", preflight_only), contextlib.redirect_stderr(stderr):
            code = T.main(argv)                                     # an unexpected exception fails the test here
        lines = stderr.getvalue().strip().splitlines()
        if code == 0:
            outcomes["accepted"] += 1
        else:
            assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) < 400, (argv, lines)
            outcomes["refused"] += 1

    one_command_line()
    print(f"trainer command lines: {sum(outcomes.values())}, {dict(outcomes)}")
    assert outcomes["accepted"] >= 10 and outcomes["refused"] >= 100


# finite but extreme: accepted, so step 1 must go through (a "diverged" there would be a setting to refuse)
EXTREME_BUT_VALID = [["--mhc-res-diag=-1e6", "--mhc-pre-bias", "1e6", "--mhc-gate-init=-1e6", "--norm-eps", "1e-45"],
                     ["--residual", "hc", "--hc-scale-init", "1e6", "--norm-eps", "1e300", "--grad-clip", "1e-300"],
                     ["--residual", "baseline", "--lr", "1e3", "--weight-decay", "1e3"]]


@pytest.mark.slow
def test_extreme_but_valid_settings_never_diverge_before_the_first_update(tmp_path):
    code = f"""
import json, sys, train_c4
codes = [train_c4.main(['--preset', 'tiny', '--steps', '1', '--eval-batches', '1', '--out', {str(tmp_path)!r},
                        '--run-name', f'r{{i}}', *args]) for i, args in enumerate({EXTREME_BUT_VALID!r})]
print(json.dumps(codes))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [0] * len(EXTREME_BUT_VALID), result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "emptied"])
def test_a_damaged_newest_checkpoint_is_detected_and_the_previous_one_used(tmp_path, damage):
    assert run(tmp_path, "--residual", "hc", "--steps", "20")[0] == 0
    newest = tmp_path / "hc_d2_s42" / "checkpoints" / "step-20"
    if damage == "truncated":
        data = (newest / "optimizer.pt").read_bytes()
        (newest / "optimizer.pt").write_bytes(data[: len(data) // 3])
    else:
        for file in newest.iterdir():
            file.unlink()
    code, stdout, stderr = run(tmp_path, "--residual", "hc", "--steps", "30", "--allow-changed-settings")
    assert code == 0, stderr
    assert "step-20" in stdout and "falling back to the previous one" in stdout and "(step 10," in stdout


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sigkill_at_five_points_including_a_checkpoint_write_loses_nothing(tmp_path):
    """Each attempt kills itself at its own point (two of them halfway through writing a checkpoint);
    the next attempt resumes, and the finished run equals one that was never interrupted."""
    args = ("--residual", "mhc", "--steps", "60", "--ckpt-every", "10", "--keep-checkpoints", "2")
    assert run(tmp_path / "reference", *args)[0] == 0
    save_kill = """
import os, signal, torch
_real, _n = torch.save, [0]
def _save(obj, path, *a, **k):
    _real(obj, path, *a, **k)
    if str(path).endswith({file!r}):
        _n[0] += 1
        if _n[0] == {count}:
            os.kill(os.getpid(), signal.SIGKILL)
torch.save = _save
"""
    step_kill = """
import os, signal, train_c4
_real = train_c4.Trainer.optimizer_step
def _step(self, *a, **k):
    if self.step == {step}:
        os.kill(os.getpid(), signal.SIGKILL)
    return _real(self, *a, **k)
train_c4.Trainer.optimizer_step = _step
"""
    # in order: before any checkpoint; inside step-20's write (model saved, optimizer not), so 10 is used;
    # mid-step; inside step-40's write after the optimizer file; mid-step again
    preludes = [step_kill.format(step=7), save_kill.format(file="model.pt", count=2), step_kill.format(step=27),
                save_kill.format(file="optimizer.pt", count=2), step_kill.format(step=45)]
    for prelude in preludes:
        assert run(tmp_path / "resumed", *args, prelude=prelude)[0] == -9
    code, stdout, stderr = run(tmp_path / "resumed", *args)
    assert code == 0, stderr
    resumed, reference = metrics_of(tmp_path / "resumed" / "mhc_d2_s42"), metrics_of(tmp_path / "reference" / "mhc_d2_s42")
    assert [r["step"] for r in resumed] == list(range(61))       # strictly increasing: nothing lost or repeated
    keys = ("loss", "grad_norm", "val_loss", "amax_fwd", "amax_bwd")
    assert [[r.get(k) for k in keys] for r in resumed] == [[r.get(k) for k in keys] for r in reference]
    leftovers = [p.name for p in (tmp_path / "resumed" / "mhc_d2_s42" / "checkpoints").iterdir()]
    assert sorted(leftovers) == ["step-50", "step-60"]            # no temp folder left behind


def sharded_checkpoint(out, step=10):
    """A tiny HC run folder with one FSDP-format checkpoint (DCP files), written in this process."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    cfg = parse_config(["--preset", "tiny", "--residual", "hc", "--out", str(out)])
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(decay_groups(model, cfg.weight_decay), lr=cfg.lr)
    idx = torch.zeros(2, cfg.seq_len, dtype=torch.long)
    model(idx, idx)[1].backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    run_dir = out / cfg.run_name
    files = {"train_state.pt": {"step": step, "tokens": step * cfg.tokens_per_step, "config": dataclasses.asdict(cfg),
                                "batch_sizes": [[0, cfg.batch_size]]}, "rank0.pt": {"rng": rng_state()}}
    run_folder.write_checkpoint(run_dir, step, files, Dist(0, 1, torch.device("cpu")), keep=2,
                       sharded={"model": model_state, "optimizer": optimizer_state})
    (run_dir / "config.json").write_text(json.dumps({"config": dataclasses.asdict(cfg)}))
    return run_dir / "checkpoints" / f"step-{step}", model_state, optimizer_state


def replace_and_reseal(folder, name, data):
    """An attacker can rewrite a file and the checksum the marker holds for it."""
    (folder / name).write_bytes(data)
    marker = json.loads((folder / run_folder.MARKER).read_text())
    marker["files"][name] = run_folder.sha256(folder / name)
    (folder / run_folder.MARKER).write_text(json.dumps(marker))


def test_crafted_dcp_metadata_never_runs_on_consolidate(tmp_path, capsys):
    folder, _, _ = sharded_checkpoint(tmp_path)
    witness = tmp_path / "pwned"
    replace_and_reseal(folder, f"{run_folder.SHARDED}/.metadata", pickle.dumps(Exploit(witness)))
    code = T.main(["--consolidate", str(folder.parent.parent), str(tmp_path / "out.pt")])
    err = capsys.readouterr().err
    assert not witness.exists()
    assert code == 2 and "cannot be loaded safely" in err and "posix.system" in err and "Traceback" not in err
    assert not (tmp_path / "out.pt").exists()


def test_crafted_dcp_metadata_is_refused_before_a_resume_loads_it(tmp_path):
    """What every rank of an FSDP resume runs first: the checkpoint is refused, DCP never reads it."""
    folder, model_state, optimizer_state = sharded_checkpoint(tmp_path)
    witness = tmp_path / "pwned"
    replace_and_reseal(folder, f"{run_folder.SHARDED}/.metadata", pickle.dumps(Exploit(witness)))
    said = []
    assert run_folder.read_checkpoint(folder.parent.parent, Dist(0, 1, torch.device("cpu")), said.append) is None
    assert "step-10 cannot be loaded safely" in said[0] and not witness.exists()
    with pytest.raises(ConfigError, match="cannot be loaded safely"):         # the load itself, had it got there
        run_folder.dcp_load({"model": model_state, "optimizer": optimizer_state}, folder, no_dist=True)
    assert not witness.exists()


def test_a_crafted_non_tensor_entry_in_dcp_shards_never_runs(tmp_path):
    """DCP's planner unpickles non-tensor entries (the optimizer's param_groups) with weights_only=False."""
    import torch.distributed.checkpoint as dcp
    folder, model_state, optimizer_state = sharded_checkpoint(tmp_path)
    witness = tmp_path / "pwned"
    optimizer_state["param_groups"][0]["lr"] = Exploit(witness)
    shutil.rmtree(folder / run_folder.SHARDED)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / run_folder.SHARDED, no_dist=True)
    optimizer_state["param_groups"][0]["lr"] = 0.0
    with pytest.raises(ConfigError, match="cannot be loaded safely"):
        run_folder.dcp_load({"model": model_state, "optimizer": optimizer_state}, folder, no_dist=True)
    assert not witness.exists()


def reshard(folder, model_state, optimizer_state):
    """DCP's files written again from these states, their checksums fixed up in the marker (a buggy writer)."""
    import torch.distributed.checkpoint as dcp
    shutil.rmtree(folder / run_folder.SHARDED)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / run_folder.SHARDED,
             no_dist=True)
    marker = json.loads((folder / run_folder.MARKER).read_text())
    marker["files"] = {name: run_folder.sha256(folder / name) for name in marker["files"]}
    (folder / run_folder.MARKER).write_text(json.dumps(marker))


def test_non_finite_dcp_shards_are_refused_by_the_load_and_never_exported(tmp_path, capsys):
    """An FSDP resume loads the shards in the trainer (dcp_load), after the checkpoint's files verified."""
    folder, model_state, optimizer_state = sharded_checkpoint(tmp_path)
    moments = [state["exp_avg_sq"] for state in optimizer_state["state"].values()]
    first = next(iter(optimizer_state["state"]))
    for moment in moments:
        moment.mul_(float("inf"))
    reshard(folder, model_state, optimizer_state)
    with pytest.raises(run_folder.NonFiniteState) as refused:
        run_folder.dcp_load({"model": model_state, "optimizer": optimizer_state}, folder, no_dist=True)
    assert str(refused.value) == (f"holds non-finite values (NaN or infinity) in sharded/optimizer ({len(moments)} "
                                  f"tensors, the first state.{first}.exp_avg_sq)")

    model_state["wte.weight"][0, 0] = float("nan")
    reshard(folder, model_state, {key: value for key, value in optimizer_state.items() if key != "state"})
    capsys.readouterr()
    assert T.main(["--consolidate", str(folder), str(tmp_path / "nan.pt")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    # the head is tied to the embedding: one tensor under two names
    assert "holds non-finite values (NaN or infinity) in sharded/model (2 tensors, the first wte.weight)" in err, err
    assert not (tmp_path / "nan.pt").exists()


NON_FINITE_RANK = """
import sys, torch, torch.distributed as dist
from hcstudy.finite_state import non_finite_problem
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=2)
shard = {"optimizer": {"state": {"w": {"exp_avg_sq": torch.tensor([1.0, float("nan") if rank == 1 else 2.0])}}}}
print(non_finite_problem(shard, across_ranks=True, where="sharded/"))
"""


@pytest.mark.slow
def test_every_rank_agrees_on_a_non_finite_shard_only_one_rank_holds(tmp_path):
    """Each rank checks its own shards; had rank 0 gone on into set_state_dict's collectives while rank 1 fell back,
    the job would hang."""
    ranks = [subprocess.Popen([sys.executable, "-c", NON_FINITE_RANK, str(rank), str(tmp_path / "store")], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    answers = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], answers
    assert [out.strip() for out, _ in answers] == [
        "holds non-finite values (NaN or infinity) in sharded/optimizer (state.w.exp_avg_sq)"] * 2


def test_a_sharded_checkpoint_still_consolidates_and_resumes(tmp_path):
    folder, model_state, optimizer_state = sharded_checkpoint(tmp_path)
    assert run_folder.read_checkpoint(folder.parent.parent, Dist(0, 1, torch.device("cpu")), print) is not None
    consolidate.consolidate(folder, tmp_path / "out.pt")
    state = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(state["wte.weight"], model_state["wte.weight"])


def bad_values(tmp_path):
    """The bad values an outside probe found (tracebacks, accepted values, fake divergences), and a model
    that cannot fit this machine: each must be refused in one line before anything is built."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    run = tmp_path / "run"
    return [
        ["--lr", "nan"], ["--lr", "inf"], ["--weight-decay", "nan"], ["--grad-clip", "nan"], ["--norm-eps", "-1"],
        ["--norm-eps", "nan"], ["--norm-eps", "0"], ["--mhc-res-diag", "inf"], ["--mhc-gate-init", "nan"],
        ["--hc-scale-init", "nan"], ["--data-timeout", "nan"], ["--data-timeout", "1e300"], ["--shuffle-buffer", "-1"],
        ["--seed", "-1"], ["--seed", "99999999999999999999999"], ["--gpu-memory-gb", "nan", "--estimate"],
        ["--depth", "100000000"], ["--depth", "100000000", "--estimate"], ["--seq-len", "100000000"],
        ["--batch-size", "1e11"], ["--batch-size", "100000000000"], ["--steps", "1e23"],
        ["--steps", "100000000000000000000000"], ["--heads", "100000", "--width", "100000", "--estimate"],
        ["--depth", "1024", "--width", "65536", "--heads", "512"],                    # the memory floor
        ["--out", "/proc/nope"], ["--out", str(afile)], ["--out", str(afile / "under")],
        ["--consolidate", str(run), "/proc/nope.pt"], ["--consolidate", str(run), str(afile / "under.pt")],
        ["--consolidate", str(run), str(tmp_path)],
    ]


def test_every_bad_value_of_the_probe_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    for args in bad_values(tmp_path):
        base = [] if "--consolidate" in args else ["--preset", "tiny", "--steps", "2", "--out", str(tmp_path / "out")]
        code = T.main(base + args)
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, (args, code, err)
    assert not (tmp_path / "out").exists()                           # nothing was started


def test_a_held_out_set_too_small_for_evaluation_is_a_warning_naming_it(tmp_path, capsys):
    shard(tmp_path / "c4-validation.00000-of-00001.json.gz", [doc(0, text="one tiny document")])
    tiny = DataFiles(train=[], val=[str(tmp_path / "c4-validation.00000-of-00001.json.gz")], held_out_slice=False)
    fixed_sequences(tiny, ByteTokenizer(), 32, 8)
    err = capsys.readouterr().err
    assert err.startswith("warning: the held-out set (c4-validation.00000-of-00001.json.gz) is smaller")
    fixed_sequences(resolve_data_files("sample"), ByteTokenizer(), 32, 8)   # the bundled one is large enough
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_train_c4_has_no_fault_hooks_and_the_test_entry_installs_them(tmp_path):
    """The fault variables do nothing to a real run (no call in its step, no day-long sleep); tests/support/fault_trainer.py
    patches the fault in from outside."""
    env = {**os.environ, "TRAIN_C4_INJECT_NAN": "loss:2", "TRAIN_C4_FAIL_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "0"}
    args = ["--preset", "tiny", "--steps", "3", "--eval-every", "3", "--ckpt-every", "3"]
    real, injected = (subprocess.run([sys.executable, str(ROOT / script), *args, "--out", str(tmp_path / out)], env=env,
                                     capture_output=True, text=True, cwd=tmp_path, timeout=300)
                      for script, out in (("train_c4.py", "real"), ("tests/support/fault_trainer.py", "injected")))
    assert real.returncode == 0, real.stderr
    assert injected.returncode == 5 and "injected by TRAIN_C4_FAIL_DEVICES" in injected.stderr, injected.stderr
