"""hcstudy/kernels/choice.py: which path runs a run's streams and why: what --kernels asks, which paths an arm
registers, what --check timed fastest on this card, and the self-check the triton path must pass first."""
import json

import pytest
import torch

import train_c4 as T
from hcstudy import arms
from hcstudy.kernels import choice
from hcstudy.config import parse_config
from hcstudy.contract import ConfigError
from hcstudy.model import GPT, kernel_path
from helpers import tiny_config
from study_layer import study_config


def test_the_new_arms_and_variants_run_the_formulas_whatever_kernels_says():
    for residual in ("mhc-lite", "identity-hc", "study-hc", "study-mhc"):
        cfg = tiny_config(residual, kernels="fused")
        assert not choice.supports(cfg) and GPT(cfg, kernels="fused").kernels == "reference"
    for residual in ("study-hc", "study-mhc"):
        assert not choice.supports(tiny_config(residual, coefficients="token", collapse="sum", mixing_norm="plain",
                                                  mixing_precision="fp32"), "triton")
    for variant in (dict(coefficients="sequence"), dict(mixing_norm="scaled"), dict(mixing_precision="autocast"),
                    dict(collapse="first")):
        assert not choice.supports(tiny_config("mhc", **variant), "fused"), variant
        assert not choice.supports(tiny_config("mhc", **variant), "triton"), variant
    assert choice.supports(tiny_config("mhc", read_stream="first", dynamic_init_std=0.01))


def test_the_kernels_refuse_the_studys_variants_and_auto_takes_the_formulas():
    for path in ("fused", "triton"):
        with pytest.raises(ConfigError, match=f"--kernels {path} has the papers' streams only"):
            study_config("study-mhc", "--kernels", path)
        with pytest.raises(ConfigError, match=f"--kernels {path} has .* not the study's --mixing-norm"):
            parse_config(["--residual", "mhc", "--kernels", path, "--mixing-norm", "scaled"])
        assert not choice.supports(study_config("mhc"), path)           # the paper's mHC in the study's body
    for residual in ("study-hc", "study-mhc"):
        assert kernel_path(study_config(residual), torch.device("cpu"))[0] == "reference"


def test_the_path_a_run_takes_and_why(monkeypatch, tmp_path):
    cfg = tiny_config("mhc", width=24, expansion=3, out=str(tmp_path))
    make = lambda path: arms.connection("mhc")(cfg, 1, path)          # noqa: E731
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    path, why = choice.kernel_path(T.dataclasses.replace(cfg, kernels="triton"), cpu, make)
    assert path == "triton" and "interpreter" in why
    # auto on CUDA without a --check result: triton once it passes its self-check (run here on the CPU)
    monkeypatch.setattr(choice, "triton_problem", lambda device, make: None)
    assert choice.kernel_path(cfg, cuda, make)[0] == "triton"
    # --check's result for this GPU: its fastest path for the arm and mode
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    timings = {"mhc": {"reference/eager": {"step_s": 0.9}, "fused/eager": {"step_s": 0.5},
                       "triton/eager": {"step_s": 0.6}, "triton/compile": {"step_s": 0.1}}}
    (tmp_path / "gpu_check").mkdir()
    (tmp_path / "gpu_check" / "result.json").write_text(json.dumps({"gpu": "NVIDIA H200", "timings": timings}))
    path, why = choice.kernel_path(cfg, cuda, make)
    assert path == "fused" and "--check timed it fastest" in why and "0.500 s/step" in why
    path, why = choice.kernel_path(T.dataclasses.replace(cfg, compile=True), cuda, make)
    assert path == "triton" and "--check timed it fastest" in why and why.endswith("self-check passed")
    # the path --check timed fastest is self-checked too: a triton that disagrees on this node runs the formulas
    monkeypatch.setattr(choice, "triton_problem", lambda device, make: "disagree with the formulas")
    path, why = choice.kernel_path(T.dataclasses.replace(cfg, compile=True), cuda, make)
    assert path == "reference" and why.startswith("warning:") and "disagree" in why
    monkeypatch.setattr(choice, "triton_problem", lambda device, make: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert choice.kernel_path(cfg, cuda, make)[0] == "triton"           # timed on another card: not this node's
    # a triton that cannot be imported, or that disagrees: the formulas, with the reason as a warning
    monkeypatch.undo()

    def missing():
        raise ImportError("No module named 'triton'")
    monkeypatch.setattr(choice, "triton_kernels", missing)
    path, why = choice.kernel_path(T.dataclasses.replace(cfg, kernels="triton"), cpu, make)
    assert path == "reference" and why.startswith("warning:") and "No module named 'triton'" in why
    assert choice.kernel_path(T.dataclasses.replace(cfg, residual="baseline"), cuda, make)[0] == "reference"


def test_auto_takes_the_fused_path_on_the_cpu_and_never_on_cuda(tmp_path):
    def never_checked(kernels):
        raise AssertionError("only the triton path is self-checked")
    pick = {kernels: {device: choice.kernel_path(tiny_config("hc", kernels=kernels, out=str(tmp_path)),
                                                torch.device(device), never_checked)[0]
                      for device in ("cpu", "cuda")} for kernels in ("reference", "fused")}
    pick["auto"] = {"cpu": choice.kernel_path(tiny_config("hc", out=str(tmp_path)), torch.device("cpu"),
                                             never_checked)[0]}
    assert pick == {"auto": {"cpu": "fused"}, "reference": {"cpu": "reference", "cuda": "reference"},
                    "fused": {"cpu": "fused", "cuda": "fused"}}
    assert parse_config([]).kernels == "auto"
