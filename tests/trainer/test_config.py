"""The command line as a user meets it: each flag's facts in one place, bad input refused in one line (exit 2)
before anything is created, odd but runnable settings named in the log, a stop while starting up."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

import train_c4 as T
from hcstudy.config import Config, build_parser, odd_settings, parse_config
from hcstudy.contract import ConfigError
from hcstudy.distributed import Dist

ROOT = Path(__file__).resolve().parents[2]


def test_every_flag_states_its_facts_once_in_its_config_field():
    parser = build_parser()
    for field in dataclasses.fields(Config):
        facts = field.metadata
        assert facts["group"] and facts["help"], field.name
        action = next(a for a in parser._actions if a.dest == field.name)
        assert facts["help"] in action.help
        if field.type in ("int", "float"):
            low, high = facts["allowed"]
            assert low <= field.default <= high, field.name
        elif field.type == "str" and facts["allowed"]:
            assert action.choices == facts["allowed"] and field.default in facts["allowed"], field.name


@pytest.mark.parametrize("flag, low, high", [("--depth", 1, 512), ("--seq-len", 1, 65536),
                                             ("--batch-size", 1, 65536), ("--data-timeout", 10, 1e6)])
def test_bounds_are_inclusive(flag, low, high):
    for value in (low, high):
        parse_config(["--preset", "tiny", flag, str(value), "--heads", "1"])
    for value in (low - 1, high + 1):
        with pytest.raises(ConfigError, match=f"{flag} must be from"):
            parse_config(["--preset", "tiny", flag, str(value)])


BAD_INPUT = [
    (["--depth", "1024"], "--depth must be from 1 to 512, got 1024"),
    (["--batch-size", "1048576"], "--batch-size must be from 1 to 65,536"),
    (["--seq-len", "100000"], "--seq-len must be from 1 to 65,536"),
    (["--depth", "1_0"], "invalid int value: '1_0'"),
    (["--depth", "\uff11\uff10"], "invalid int value"),                     # full-width digits
    (["--depth", " 3"], "invalid int value"),
    (["--lr", "1_0.5"], "invalid float value"),
    (["--micro-batch-size", "\uff12"], "--micro-batch-size must be a positive integer"),
    (["--out", ""], "--out must name a folder"),
    (["--out", "  "], "--out must name a folder"),
    (["--run-name", "a\nb"], "--run-name 'a\\nb' must be"),
    (["--run-name", "   "], "--run-name '   ' must be"),
    (["--run-name", "x" * 300], "must be 1 to 100 letters"),
    (["--probe-sequences", "100"], "--probe-sequences 100 exceeds the 8 held-out sequences"),
    (["--data-timeout", "0.0001"], "--data-timeout must be from 10"),
    (["--parallel", "fsdp"], "--parallel fsdp shards over torchrun's processes"),
    # a flag the chosen arm does not have would change nothing
    (["--residual", "baseline", "--coefficients", "sequence"], "--coefficients has no effect on --residual baseline"),
    (["--residual", "baseline", "--sinkhorn-iters", "5"], "it applies to mhc"),
    (["--residual", "baseline", "--expansion", "2"], "--expansion has no effect on --residual baseline"),
    (["--residual", "baseline", "--collapse", "first"], "it applies to hc, mhc, mhc-lite, identity-hc"),
    (["--residual", "baseline", "--read-stream", "first"], "--read-stream has no effect"),
    (["--residual", "baseline", "--kernels", "fused"], "--kernels has no effect on --residual baseline"),
    (["--compile-scope", "model"], "--compile-scope model says what --compile compiles: add --compile"),
    (["--cross-entropy", "liger"], "--cross-entropy"),
    (["--residual", "baseline", "--no-mixing-decay"], "--no-mixing-decay has no effect"),
    (["--residual", "hc", "--mhc-pre-bias", "1"], "--mhc-pre-bias has no effect on --residual hc; it applies to mhc, mhc-lite"),
    (["--residual", "hc", "--mhc-res-diag", "2"], "--mhc-res-diag has no effect on --residual hc"),
    (["--residual", "mhc-lite", "--sinkhorn-iters", "5"], "--sinkhorn-iters has no effect on --residual mhc-lite"),
    (["--residual", "identity-hc", "--sinkhorn-iters", "5"], "no effect on --residual identity-hc"),
    (["--residual", "identity-hc", "--mhc-res-diag", "2"], "no effect on --residual identity-hc"),
    (["--residual", "mhc", "--hc-scale-init", "0.1"], "--hc-scale-init has no effect on --residual mhc"),
]


def test_a_presets_own_fields_stay_silent_and_negative_numbers_are_values():
    assert parse_config(["--preset", "seed-study", "--residual", "hc"]).coefficients == "sequence"
    assert parse_config(["--preset", "tiny", "--residual", "baseline"]).expansion == 4
    assert parse_config(["--mhc-gate-init", "-1e6", "--mhc-pre-bias", "-.5", "--mhc-res-diag", "-2"]).mhc_gate_init \
        == -1e6
    assert parse_config(["--mhc-pre-bias", "-.5"]).mhc_pre_bias == -0.5
    with pytest.raises(ConfigError, match="--seed must be from 0"):
        parse_config(["--seed", "-1"])


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2_before_anything_is_created(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    preflight_only = lambda cfg: T.preflight(cfg, Dist(0, 1, torch.device("cpu")))    # noqa: E731
    with mock.patch.object(T, "train", preflight_only):
        code = T.main(["--preset", "tiny", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, (args, code, err)
    assert message in err
    assert list(tmp_path.iterdir()) == []


def test_an_empty_out_writes_nothing_into_the_current_folder(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "train_c4.py"), "--preset", "tiny", "--out", ""],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: --out"), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_odd_but_runnable_settings_are_named():
    assert odd_settings(parse_config(["--preset", "tiny"])) == []
    odd = odd_settings(parse_config(["--preset", "tiny", "--steps", "3", "--warmup", "1000",
                                         "--data-streams", "1000"]))
    assert odd == ["--warmup 1000 exceeds --steps 3: the lr never reaches --lr",
                   "--data-streams 1000 exceeds --batch-size 4: streams 4 to 999 are never read"]


def test_fewer_steps_than_the_run_has_done_are_refused(tmp_path, capsys):
    base = ["--preset", "tiny", "--out", str(tmp_path), "--eval-batches", "1", "--ckpt-every", "4"]
    assert T.main([*base, "--steps", "4"]) == 0
    status = (tmp_path / "mhc_d2_s42" / "status.json").read_text()
    capsys.readouterr()
    assert T.main([*base, "--steps", "2", "--allow-changed-settings"]) == 2
    err = capsys.readouterr().err
    assert "has done 4 steps, more than --steps 2" in err and len(err.strip().splitlines()) == 1, err
    assert json.loads((tmp_path / "mhc_d2_s42" / "status.json").read_text()) == json.loads(status)


def catches_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def test_sigterm_while_the_trainer_starts_exits_75(tmp_path):
    """Before the trainer's own handler exists (torch still loading), a stop still means "interrupted"."""
    process = subprocess.Popen([sys.executable, str(ROOT / "train_c4.py"), "--preset", "tiny", "--out", str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 1.0   # torch alone takes a second or more to import
    while not catches_sigterm(process.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 75, stderr
    assert not (tmp_path / "mhc_d2_s42").exists()


def test_names_a_flag_allows_are_taken_in_any_case_and_free_text_is_kept():
    cfg = parse_config(["--residual", "HC", "--dtype", "FP32", "--preset", "Tiny", "--run-name", "MyRun",
                          "--out", "Runs/X"])
    assert (cfg.residual, cfg.dtype, cfg.preset, cfg.run_name, cfg.out) == ("hc", "fp32", "tiny", "MyRun", "Runs/X")
