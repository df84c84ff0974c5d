"""hcstudy/wandb_log.py: which W&B mode a run takes, its id kept in the run folder, and the lines W&B plots. W&B
itself is never started here (conftest sets WANDB_MODE=disabled)."""
from types import SimpleNamespace

import pytest

from hcstudy import wandb_log


@pytest.mark.parametrize("flag, env, credentials, mode", [
    ("offline", "online", True, "offline"),          # --wandb beats $WANDB_MODE
    ("auto", "disabled", True, "disabled"),
    ("auto", "dryrun", True, "offline"),
    ("auto", "", True, "online"),
    ("auto", "", False, "offline"),                  # no key and no netrc: nothing could be uploaded
])
def test_the_mode_follows_the_flag_then_the_environment_then_the_credentials(monkeypatch, flag, env, credentials,
                                                                             mode):
    monkeypatch.setenv("WANDB_MODE", env)
    monkeypatch.setattr(wandb_log, "_wandb_credentials", lambda: credentials)
    assert wandb_log.wandb_mode(SimpleNamespace(wandb=flag)) == mode


def test_a_run_folder_keeps_one_id_and_another_folder_gets_its_own(tmp_path):
    (tmp_path / "a").mkdir()
    first = wandb_log.wandb_run_id(tmp_path / "a")
    assert wandb_log.wandb_run_id(tmp_path / "a") == first                 # every resume continues the W&B run
    (tmp_path / "b").mkdir()
    assert wandb_log.wandb_run_id(tmp_path / "b") != first
    assert (tmp_path / "a" / "wandb_id.txt").read_text() == first + "\n"


def test_a_disabled_run_starts_nothing():
    log = SimpleNamespace(enabled=True)
    assert wandb_log.start_wandb(SimpleNamespace(wandb="disabled"), None, {}, log) is None


def test_per_sublayer_lists_become_one_scalar_each_and_step_and_time_are_left_to_w_and_b():
    record = {"step": 3, "time": 1.5, "loss": 2.0, "layer_gain_fwd": [1.0, 1.5]}
    assert wandb_log.wandb_record(record) == {"loss": 2.0, "layer_gain_fwd/000": 1.0, "layer_gain_fwd/001": 1.5}
