"""End-to-end runs of the trainer on the CPU with the `tiny` preset, as a user would run them."""
import dataclasses
import gzip
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hcstudy import config_flags as flags
from hcstudy import wandb_log
import train_c4 as T
from hcstudy.config import Config, PRESETS, build_parser, parse_config
from hcstudy.contract import ConfigError, STREAM_KEYS, STREAM_LAYER_KEYS
from hcstudy.data import ByteTokenizer, GPT2Tokenizer, RankBatches, make_loader, resolve_data_files
from trainer_runs import deterministic, metrics, trainer

ROOT = Path(__file__).resolve().parents[2]
TRAINING_KEYS = {"step", "time", "loss", "lr", "grad_norm", "clipped", "tokens", "tokens_per_s", "mfu", "mem_peak_gb"}
PROBE_KEYS = {"amax_fwd", "amax_bwd", "amax_fwd_abs", "amax_bwd_abs", "amax_l0_fwd", "amax_l0_bwd",
              "min_row_sum", "min_col_sum"}


def test_a_run_writes_every_documented_file_and_key(tmp_path):
    code, stdout, stderr = trainer(tmp_path, "--residual", "hc")
    assert code == 0, stderr
    run = tmp_path / "hc_d2_s42"
    config = json.loads((run / "config.json").read_text())
    assert config["config"]["residual"] == "hc" and config["n_params"] > 0 and config["versions"]["torch"]
    assert config["git_commit"]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and status["step"] == 20 and status["exit_code"] == 0
    records = metrics(run)
    assert [r["step"] for r in records] == list(range(21))
    assert all(TRAINING_KEYS <= r.keys() for r in records[1:])
    assert PROBE_KEYS | {"layer_gain_fwd", "layer_gain_bwd"} <= records[-1].keys()
    assert len(records[-1]["layer_gain_fwd"]) == 4 and "val_loss" in records[10]
    assert {*STREAM_KEYS, *STREAM_LAYER_KEYS} <= records[-1].keys() and set(STREAM_KEYS) <= records[5].keys()
    assert len(records[-1]["layer_effective_rank"]) == 4 and "layer_effective_rank" not in records[5]
    assert records[-1]["loss"] < records[1]["loss"]
    assert "tokens per step: 128" in (run / "train.log").read_text()
    assert sorted(d.name for d in (run / "checkpoints").iterdir()) == ["step-10", "step-20"]


@pytest.mark.slow
def test_sigkill_then_rerun_continues_exactly(tmp_path):
    """The reference reads its data in a thread, the killed and resumed run in two loader processes."""
    args = ["--residual", "mhc", "--steps", "60", "--ckpt-every", "10", "--keep-checkpoints", "3"]
    reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
    reference_dir.mkdir(), resumed_dir.mkdir()
    assert trainer(reference_dir, *args)[0] == 0
    args += ["--data-workers", "2"]
    process = trainer(resumed_dir, *args, wait=False)
    checkpoints = resumed_dir / "mhc_d2_s42" / "checkpoints"
    while not (checkpoints / "step-30").exists() and process.poll() is None:
        time.sleep(0.01)
    process.kill()
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    deadline = time.time() + 3     # its loader processes end with it (PR_SET_PDEATHSIG), not 5 s later (torch)
    while subprocess.run(["pgrep", "-f", str(resumed_dir)], capture_output=True).returncode == 0:
        assert time.time() < deadline, "loader processes outlived the killed trainer"
        time.sleep(0.1)
    code, stdout, stderr = trainer(resumed_dir, *args)
    assert code == 0, stderr
    assert "resumed from" in stdout
    resumed = metrics(resumed_dir / "mhc_d2_s42")
    assert [r["step"] for r in resumed] == list(range(61))       # no line lost or duplicated
    assert deterministic(resumed) == deterministic(metrics(reference_dir / "mhc_d2_s42"))


def test_sigterm_saves_a_loadable_checkpoint_and_exits_75(tmp_path):
    process = trainer(tmp_path, "--residual", "hc", "--steps", "100000", "--ckpt-every", "100000", wait=False)
    run = tmp_path / "hc_d2_s42"
    while not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 5:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 75
    assert stderr.splitlines()[-1].startswith("stopped by a signal at step") and "error:" not in stderr
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "interrupted"
    folder = run / "checkpoints" / f"step-{status['step']}"
    state = torch.load(folder / "model.pt", weights_only=True)
    assert "blocks.0.attn_conn.A_r_static" in state


@pytest.mark.slow
@pytest.mark.parametrize("where", ["loss", "grad", "data"])
def test_injected_non_finite_value_stops_the_run_as_diverged_and_the_report_says_so(tmp_path, where):
    code, _, stderr = trainer(tmp_path, "--residual", "hc", env={"TRAIN_C4_INJECT_NAN": f"{where}:7"})
    assert code == 3
    assert "non-finite" in stderr and len(stderr.strip().splitlines()) == 1
    run = tmp_path / "hc_d2_s42"
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "diverged" and status["step"] == 6 and status["exit_code"] == 3
    last = metrics(run)[-1]
    assert last["step"] == 7 and not all(map(lambda v: v == v and abs(v) < float("inf"),
                                             (last["loss"], last["grad_norm"])))
    report = subprocess.run([sys.executable, str(ROOT / "report.py"), str(tmp_path), "--no-plots"],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    hc_row = next(line for line in (tmp_path / "report" / "results.md").read_text().splitlines()
                  if line.startswith("| HC "))
    assert "| 1: s42@7 |" in hc_row                    # the diverged column: seed 42 at step 7


BAD_INPUTS = [
    (["--preset", "huge"], "invalid choice"),
    (["--residual", "dense"], "invalid choice"),
    (["--depth", "0"], "--depth must be from 1 to 512, got 0"),
    (["--width", "-4"], "--width must be from 1 to 65,536, got -4"),
    (["--width", "30", "--heads", "4"], "not divisible by --heads"),
    (["--batch-size", "6", "--micro-batch-size", "4"], "not divisible by --micro-batch-size"),
    (["--data", "/nonexistent/*.json.gz"], "matches no file"),
    (["--val-data", "/nonexistent/*.json.gz"], "--val-data '/nonexistent/*.json.gz' matches no file"),
    (["--steps", "ten"], "invalid int value"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args, message", BAD_INPUTS)
def test_bad_input_gives_one_line_and_exit_2_and_writes_nothing(tmp_path, args, message):
    code, stdout, stderr = trainer(tmp_path, *args)
    assert code == 2
    assert message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert list(tmp_path.iterdir()) == []


def test_resume_over_a_different_model_is_refused(tmp_path):
    assert trainer(tmp_path, "--residual", "hc", "--steps", "10")[0] == 0
    code, _, stderr = trainer(tmp_path, "--residual", "hc", "--steps", "10", "--width", "32", "--run-name",
                              "hc_d2_s42")
    assert code == 2 and "width=16" in stderr and "width=32" in stderr


def test_a_bf16_stream_run_records_its_precision_and_refuses_a_resume_in_fp32(tmp_path):
    """--stream-dtype is a model setting: config.json records it, and a resume under the other dtype is refused as
    a different model, whatever --allow-changed-settings says."""
    code, _, stderr = trainer(tmp_path, "--residual", "mhc", "--stream-dtype", "bf16", "--steps", "4")
    assert code == 0, stderr
    config = json.loads((tmp_path / "mhc_d2_s42" / "config.json").read_text())
    assert config["precision"]["residual_streams"] == "bf16" and config["config"]["stream_dtype"] == "bf16"
    code, _, stderr = trainer(tmp_path, "--residual", "mhc", "--stream-dtype", "fp32", "--steps", "4",
                              "--allow-changed-settings")
    assert code == 2 and "stream_dtype='bf16'" in stderr and "stream_dtype='fp32'" in stderr, stderr


def test_help_groups_every_flag_and_lists_the_presets():
    text = build_parser().format_help()
    sections = {block.split(":\n", 1)[0]: block for block in text.split("\n\n")}
    for field in dataclasses.fields(Config):                   # each flag in its own group's section, only there
        holding = [title for title, block in sections.items()
                   if re.search(rf"^  {flags.flag(field.name)}( |,|$)", block, re.MULTILINE)]
        assert holding == [field.metadata["group"]], (field.name, holding)
    for name in PRESETS:
        assert f"\n  {name}: " in text
    assert "stress: --lr 0.0003, --steps 3000" in text


LIVE_KEYS = {"state", "step", "steps", "tokens", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu",
             "mem_peak_gb", "eta_s", "amax_fwd", "amax_bwd", "val_loss", "last_checkpoint_step", "restarts", "updated"}


@pytest.mark.slow
def test_status_json_advances_while_the_run_goes_and_the_log_line_carries_the_pace(tmp_path):
    process = trainer(tmp_path, "--residual", "mhc", "--steps", "60", "--log-every", "5", wait=False)
    status_path, seen = tmp_path / "mhc_d2_s42" / "status.json", []
    while process.poll() is None:
        try:
            status = json.loads(status_path.read_text())        # atomic rewrites: never a half-written file
        except FileNotFoundError:
            continue
        if status["state"] == "running" and status["step"] and status["step"] not in [s["step"] for s in seen]:
            seen.append(status)
    stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr
    assert len(seen) >= 2 and all(0 < s["step"] <= 60 for s in seen), [s["step"] for s in seen]
    assert LIVE_KEYS <= seen[-1].keys() and seen[-1]["steps"] == 60 and seen[-1]["restarts"] == 0
    assert seen[0]["tokens"] == seen[0]["step"] * 128 and seen[0]["eta_s"] > 0 and seen[-1]["eta_s"] == 0
    line = next(ln for ln in stdout.splitlines() if "step 25/60" in ln)
    for part in ("loss ", " lr ", " grad_norm ", " amax_fwd ", " tok/s ", " eta 0:00:"):
        assert part in line, line
    code, _, stderr = trainer(tmp_path, "--residual", "mhc", "--steps", "70", "--allow-changed-settings")
    final = json.loads(status_path.read_text())
    assert code == 0 and final["state"] == "completed" and final["restarts"] == 1
    assert final["last_checkpoint_step"] == 70


def test_mhc_run_writes_the_truncation_and_converged_keys(tmp_path):
    code, _, stderr = trainer(tmp_path, "--residual", "mhc", "--steps", "10")
    assert code == 0, stderr
    records = metrics(tmp_path / "mhc_d2_s42")
    last = records[-1]
    for key in ("sinkhorn_row_err", "sinkhorn_col_err", "sinkhorn_bwd_bound", "amax_fwd_converged",
                "amax_bwd_converged", "amax_study", "amax_study_converged", "sinkhorn_converged_iters"):
        assert key in last, key
    assert len(last["layer_sinkhorn_col_err"]) == 4 and {*STREAM_KEYS, *STREAM_LAYER_KEYS} <= last.keys()
    assert abs(last["amax_bwd_converged"] - 1) < 1e-3 and last["amax_bwd"] <= last["sinkhorn_bwd_bound"] + 1e-9
    config = json.loads((tmp_path / "mhc_d2_s42" / "config.json").read_text())
    assert config["precision"]["residual_streams"] == "fp32"


@pytest.mark.slow
def test_wandb_honours_the_environment_and_keeps_one_run_id_per_folder(tmp_path):
    disabled = tmp_path / "disabled"
    disabled.mkdir()
    assert trainer(disabled, "--steps", "2", "--wandb", "auto", env={"WANDB_MODE": "disabled"})[0] == 0
    assert not any("wandb" in p.name for p in (disabled / "mhc_d2_s42").iterdir())
    ids = []
    for folder, steps in (("a", "4"), ("a", "6"), ("b", "4")):
        (tmp_path / folder).mkdir(exist_ok=True)
        code, stdout, stderr = trainer(tmp_path / folder, "--steps", steps, "--wandb", "auto", "--log-every", "1",
                                       "--allow-changed-settings", env={"WANDB_MODE": "offline"})
        assert code == 0, stderr
        run = tmp_path / folder / "mhc_d2_s42"
        ids.append((run / "wandb_id.txt").read_text().strip())
        sync = (run / "wandb_sync.txt").read_text().strip()
        assert sync.startswith("wandb sync /") and f"W&B is offline; upload this run later with: {sync}" in stdout
        assert sync.endswith(ids[-1])                         # the offline run folder is named after the id
    assert ids[0] == ids[1] != ids[2]                       # a resume continues the run; a new folder is new
    flat = wandb_log.wandb_record({"step": 3, "time": 1.0, "loss": 2.0, "layer_gain_fwd": [1.0, 1.5]})
    assert flat == {"loss": 2.0, "layer_gain_fwd/000": 1.0, "layer_gain_fwd/001": 1.5}


@pytest.mark.slow
def test_resume_with_changed_training_settings_is_refused_unless_allowed(tmp_path):
    assert trainer(tmp_path, "--residual", "hc", "--steps", "10")[0] == 0
    code, _, stderr = trainer(tmp_path, "--residual", "hc", "--steps", "15", "--lr", "0.001", "--micro-batch-size", "1")
    assert code == 2 and len(stderr.strip().splitlines()) == 1
    assert "other settings (lr 0.003 -> 0.001, steps 10 -> 15)" in stderr and "--allow-changed-settings" in stderr
    assert not (tmp_path / "hc_d2_s42" / "settings_changes.jsonl").exists()
    code, stdout, stderr = trainer(tmp_path, "--residual", "hc", "--steps", "15", "--lr", "0.001",
                                   "--allow-changed-settings")
    assert code == 0, stderr
    assert "continuing at step 10 under changed settings" in stdout
    (record,) = [json.loads(line) for line in (tmp_path / "hc_d2_s42" / "settings_changes.jsonl").open()]
    assert record["step"] == 10 and record["changes"] == {"lr": [0.003, 0.001], "steps": [10, 15]}
    assert [r["step"] for r in metrics(tmp_path / "hc_d2_s42")] == list(range(16))


@pytest.mark.slow
def test_corrupted_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    assert trainer(tmp_path, "--residual", "mhc", "--steps", "20", "--ckpt-every", "10")[0] == 0
    run = tmp_path / "mhc_d2_s42"
    model_file = run / "checkpoints" / "step-20" / "model.pt"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    code, stdout, stderr = trainer(tmp_path, "--residual", "mhc", "--steps", "30", "--ckpt-every", "10",
                                   "--allow-changed-settings")
    assert code == 0, stderr
    assert "step-20 has a corrupted model.pt" in stdout and "resumed from" in stdout and "step 10" in stdout


def test_malformed_lines_are_skipped_and_counted(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    lines = [json.dumps({"text": f"document {i} " * 20, "timestamp": "2019-04-25T12:00:00Z", "url": f"u{i}"})
             for i in range(200)]
    lines[5], lines[9], lines[11] = "{not json", json.dumps({"url": "no text"}), json.dumps({"text": "  "})
    for name in ("c4-train.00000-of-00001.json.gz", "c4-validation.00000-of-00001.json.gz"):
        with gzip.open(data / name, "wt") as f:
            f.write("\n".join(lines) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, stderr = trainer(out, "--data", str(data / "*.json.gz"), "--shuffle-buffer", "4")
    assert code == 0, stderr
    assert "3 malformed or empty lines skipped" in stdout


@pytest.mark.slow
def test_training_files_alone_hold_out_the_same_slice_in_every_run_and_after_a_resume(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    with gzip.open(data / "c4-train.00000-of-00001.json.gz", "wt") as f:
        f.writelines(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(400))
    args = ["--residual", "hc", "--data", str(data / "c4-train.*.json.gz"), "--steps", "8", "--ckpt-every", "4",
            "--eval-every", "4"]
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    code, stdout, stderr = trainer(first, *args)
    assert code == 0, stderr
    assert "held out for validation and the probe: 1 document in 100 of the training files" in stdout
    # the second run fails at step 6, after its checkpoint at 4, and resumes in two loader processes
    assert trainer(second, *args, env={"TRAIN_C4_INJECT_NAN": "oom:6"})[0] == 4
    code, stdout, stderr = trainer(second, *args, "--data-workers", "2")
    assert code == 0 and "resumed from" in stdout, stderr
    reference, resumed = (metrics(folder / "hc_d2_s42") for folder in (first, second))
    assert [r["val_loss"] for r in resumed if "val_loss" in r] and deterministic(resumed) == deterministic(reference)


def test_gpt2_tokenizer_is_the_real_one_offline():
    tokenizer = GPT2Tokenizer()
    assert tokenizer.encode_batch(["hello world"]) == [[31373, 995]]
    assert tokenizer.eot == 50256


def sample_batches(rank=0, world=1, data_seed=7, batch=8, micro=4, streams=4, separator="eot"):
    train_files = resolve_data_files("sample").train
    cfg = parse_config(["--preset", "tiny", "--seq-len", "64", "--data-seed", str(data_seed), "--batch-size",
                          str(batch), "--data-streams", str(streams), "--shuffle-buffer", "16", "--doc-separator",
                          separator])
    return RankBatches(train_files, ByteTokenizer(), cfg, rank, world, micro)


@pytest.mark.parametrize("separator", ["eot", "none"])
def test_sample_corpus_streams_and_resumes_exactly(separator):
    reference = sample_batches(separator=separator)
    expected = [reference.next_batch()[0] for _ in range(30)]
    loader = sample_batches(separator=separator)
    seen = [loader.next_batch()[0] for _ in range(10)]
    for _ in range(2):                                       # a second and third resume must be exact too
        state = loader.state_dict()
        loader = sample_batches(separator=separator)
        loader.load_state_dict([state])
        seen += [loader.next_batch()[0] for _ in range(10)]
    assert all(torch.equal(a, b) for a, b in zip(seen, expected))
    assert bool((torch.cat(seen) == 0).any()) == (separator == "eot")     # a document ended in these 30 batches


def saved_size(state) -> int:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def test_a_checkpoints_data_state_holds_positions_not_the_pending_tokens():
    """The sample's documents are long: their pending tokens were megabytes per stream (29 MB a demo checkpoint)."""
    loader = sample_batches()
    for _ in range(10):
        loader.next_batch()
    assert saved_size(loader.state_dict()) < 100_000


def test_a_data_position_past_its_documents_or_not_a_count_is_refused():
    """A checkpoint's count of tokens taken is re-read from its documents: beyond them (or not a count) it is one
    line, never an endless read of the stream."""
    state = sample_batches().state_dict()
    for stream in state["streams"].values():
        stream["taken"] = 10 ** 12
    loader = sample_batches()
    loader.load_state_dict([state])
    with pytest.raises(ConfigError, match="lies past the"):
        loader.next_batch()
    state["streams"]["0"]["taken"] = -1
    with pytest.raises(ValueError, match="a data position of -1"):
        sample_batches().load_state_dict([state])


def test_a_data_state_that_holds_pending_tokens_resumes_exactly_and_saves_them_again():
    """A checkpoint written when states held the pending tokens resumes, and a checkpoint after it resumes too."""
    reference = sample_batches()
    expected = [reference.next_batch()[0] for _ in range(30)]
    loader = sample_batches()
    seen = [loader.next_batch()[0] for _ in range(10)]
    current = loader.state_dict()
    older = {"cursor": current["cursor"], "streams": {
        v: {"documents": stream.documents.state_dict(), "tokens": stream.tokens, "offset": stream.offset}
        for v, stream in ((str(v), s) for v, s in loader.streams.items())}}
    for _ in range(2):
        loader, state = sample_batches(), older if len(seen) == 10 else loader.state_dict()
        loader.load_state_dict([state])
        seen += [loader.next_batch()[0] for _ in range(10)]
    assert all(torch.equal(a, b) for a, b in zip(seen, expected))


def test_two_ranks_see_the_single_process_batches_and_resume_across_world_sizes():
    single = sample_batches(micro=8)
    ranks = [sample_batches(rank=r, world=2, micro=4) for r in range(2)]
    for step in range(6):
        whole = single.next_batch()[0]
        parts = [rank.next_batch()[0] for rank in ranks]
        assert torch.equal(whole[0::2], parts[0]) and torch.equal(whole[1::2], parts[1])
        if step == 2:                                        # save with 2 ranks, resume with 1
            single = sample_batches(micro=8)
            single.load_state_dict([rank.state_dict() for rank in ranks])
    documents = [set(map(bytes, rank.next_batch()[0].tolist())) for rank in ranks]
    assert not documents[0] & documents[1]


@pytest.mark.parametrize("world", [3, 4, 6])
def test_any_world_size_that_divides_the_batch_reads_the_single_process_batches(world):
    """4 streams, a global batch of 12: 3 and 6 processes share streams (each reads a shared stream's windows of a
    step and keeps its own), 4 do not. Saved at step 2 by one layout and resumed by another (1 process, then
    `world`), the batches stay those of one process throughout; one rank reads through a loader process."""
    single = sample_batches(batch=12, micro=12)
    ranks = [sample_batches(rank=r, world=world, batch=12, micro=12 // world) for r in range(world)]
    for step in range(5):
        whole = single.next_batch()[0]
        for r, rank in enumerate(ranks):
            assert torch.equal(rank.next_batch()[0], whole[r::world]), (step, r)
        if step == 1:                                      # save from `world` ranks, resume with one
            single = sample_batches(batch=12, micro=12)
            single.load_state_dict([rank.state_dict() for rank in ranks])
        if step == 3:                                      # save from one, resume with `world` ranks
            ranks = [sample_batches(rank=r, world=world, batch=12, micro=12 // world) for r in range(world)]
            for rank in ranks:
                rank.load_state_dict([single.state_dict()])
    cfg = parse_config(["--preset", "tiny", "--batch-size", "12", "--data-streams", "4", "--data-workers", "1"])
    loader = make_loader(ranks[-1], cfg, pin_memory=False)
    try:
        assert torch.equal(loader.next_batch()[0], single.next_batch()[0][world - 1::world])
    finally:
        loader.close()


def test_data_seed_changes_the_order_and_model_seed_does_not():
    assert torch.equal(sample_batches(data_seed=1).next_batch()[0], sample_batches(data_seed=1).next_batch()[0])
    assert not torch.equal(sample_batches(data_seed=1).next_batch()[0], sample_batches(data_seed=2).next_batch()[0])


def test_a_run_started_by_hand_logs_its_steps_and_its_stop_in_train_log(tmp_path, monkeypatch, capsys):
    """On a terminal the progress bar shows the pace, but train.log still gets every log step and the stop."""
    metrics = tmp_path / "t" / "metrics.jsonl"

    def sigterm_after_three_steps():
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 4:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    threading.Thread(target=sigterm_after_three_steps, daemon=True).start()
    try:
        code = T.main(["--preset", "tiny", "--steps", "500", "--log-every", "1", "--out", str(tmp_path),
                       "--run-name", "t"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert code == 75, capsys.readouterr().err
    log = (tmp_path / "t" / "train.log").read_text()
    assert re.search(r"\] step 1/500 loss \d", log), log
    assert re.search(r"\] stopped by a signal at step \d+; checkpoint saved", log), log
    assert log.count("stopped by a signal") == 1
