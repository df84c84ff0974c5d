"""hcstudy/run_record.py: config.json's record of what produced a run (settings, sizes, precision, versions, commit)."""
import dataclasses
import json
from types import SimpleNamespace

import torch

from hcstudy import run_record
from helpers import tiny_config


def test_the_precision_policy_names_what_runs_in_bf16_and_what_stays_fp32():
    bf16 = run_record.precision_policy(torch.bfloat16, "bf16")
    assert bf16["matmuls"] == "bf16" and bf16["residual_streams"] == "bf16" and bf16["mixing_parameters"] == "fp32"
    assert run_record.precision_policy(torch.float32)["matmuls"] == "fp32"
    assert run_record.precision_policy(torch.float32)["residual_streams"] == "fp32"      # the default streams


def test_the_record_holds_the_settings_the_micro_batch_taken_and_how_the_run_was_made():
    cfg = tiny_config("mhc")
    dist = SimpleNamespace(world=2, device=torch.device("cpu"))
    params = {"total": 1234, "embedding": 100, "non_embedding": 1134}
    record = run_record.run_record(cfg, 2, dist, torch.float32, False, ("reference", "asked"), params,
                                   ("plain", "small vocabulary"))
    assert record["config"] == {**dataclasses.asdict(cfg), "micro_batch_size": 2}
    assert (record["n_params"], record["world_size"], record["device"], record["device_name"]) == (1234, 2, "cpu", "cpu")
    assert (record["attention"], record["kernels"], record["kernels_reason"]) == ("sdpa", "reference", "asked")
    assert record["cross_entropy"] == "plain" and record["dtype"] == "float32"
    assert record["versions"]["torch"] == torch.__version__
    assert record["git_commit"] == "unknown" or len(record["git_commit"].removesuffix("-dirty")) == 40
    json.dumps(record)                                   # config.json: every value JSON can write


def test_a_folder_outside_git_has_an_unknown_commit(monkeypatch, tmp_path):
    monkeypatch.setattr(run_record, "ROOT", tmp_path)
    assert run_record.git_commit() == "unknown"
