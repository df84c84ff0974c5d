"""hcstudy/planner/estimate.py: train_c4.py --estimate's text: the plan, the levers, the time and its MFU."""
import pytest
import torch

from hcstudy.planner import estimate, gpus
from hcstudy.planner import run_time
import train_c4 as T
from hcstudy.config import parse_config
from hcstudy.kernels import choice
from hcstudy.model import GPT, count_parameters


@pytest.mark.slow
def test_estimate_prints_the_plan_without_building_the_model(capsys):
    assert T.main(["--estimate", "--depth", "48", "--micro-batch-size", "8", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    for words in ("2,540,313,120 parameters", "non-embedding", "in the residual connections", "FLOPs per token",
                  "tokens per step", "weights", "gradients", "optimizer", "autocast weight cache", "act: blocks",
                  "act: log-probabilities", "overhead: CUDA context", "does NOT fit", "--micro-batch-size auto: 2"):
        assert words in out
    assert T.main(["--estimate", "--depth", "48", "--parallel", "fsdp", "--estimate-world-size", "8",
                   "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "8 processes, FSDP" in out and "/ 8 ranks" in out and "fsdp all-gathered" in out


def test_the_levers_are_priced_and_named_the_fused_loss_with_its_recomputed_logits():
    """The fused loss adds its backward's second pass over the head (2 x vocabulary x width FLOPs a token); compiling
    the blocks or the whole model is priced as eager until --check times it, each under its own key."""
    flags = ["--depth", "32", "--residual", "baseline", "--micro-batch-size", "8", "--tokenizer", "byte"]
    plain, fused = (parse_config([*flags, "--cross-entropy", loss]) for loss in ("plain", "fused"))
    params, rates = count_parameters(plain), run_time.gpu_rates(gpus.ASSUMED_GPU)
    costs = [run_time.step_cost(GPT, cfg, params, "reference", 8, 1, rates) for cfg in (plain, fused)]
    assert costs[1].flops - costs[0].flops == 32 * 1024 * 2 * 256 * 2048 and costs[1].bytes == costs[0].bytes
    for scope, mode in (("blocks", "compile"), ("model", "compile-model")):
        cfg = parse_config([*flags, "--compile", "--compile-scope", scope])
        assert choice.timed_mode(cfg) == mode
        _, basis = run_time.step_seconds(GPT, cfg, params, 8, 1, gpus.ASSUMED_GPU, "reference")
        assert basis.endswith(f"as eager (compile of the {scope} not modelled)")
    assert choice.timed_mode(plain) == "eager"
    lever = parse_config([*flags, "--cross-entropy", "fused", "--compile", "--compile-scope", "model"])
    assert estimate.levers_line(lever) == ("planned for: the fused cross-entropy (--cross-entropy fused); torch.compile "
                                           "of the whole model (its step priced as eager until --check times it)")
    assert estimate.levers_line(plain).endswith("; no torch.compile (eager)")


def test_time_estimate_names_the_assumed_gpu_or_says_why_there_is_none(capsys, monkeypatch):
    T.main(["--estimate", "--depth", "32"])
    assert "on 1 x NVIDIA H100 80GB HBM3 (assumed: no CUDA device here)" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX A6000")
    T.main(["--estimate", "--depth", "32", "--gpu-memory-gb", "48"])
    assert "no estimate, its bf16 peak or bandwidth is not known" in capsys.readouterr().out


@pytest.mark.slow
def test_the_widest_model_in_bounds_is_planned(capsys):
    assert T.main(["--estimate", "--width", "65536", "--depth", "1", "--heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "the run on this CPU" in out and "h for 10,000 steps" in out


def test_the_estimate_prints_the_modelled_mfu_of_its_step_range():
    """MFU = tokens a step x FLOPs a token (the head's included) / (seconds x the card's bf16 peak x GPUs): the slow end
    of the step gives the low MFU; a card without a known peak (the CPU) prints none."""
    cfg = parse_config(["--residual", "baseline", "--depth", "32"])
    params = count_parameters(cfg)
    h100 = "NVIDIA H100 80GB HBM3"
    work = cfg.tokens_per_step * gpus.flops_per_token(cfg, params) / gpus.gpu_peak_flops(h100)
    assert estimate.mfu_text(cfg, params, (work / 0.5, work / 0.25), h100, 1) == ", MFU 25-50%"
    assert estimate.mfu_text(cfg, params, (work / 0.5, work / 0.5), h100, 2) == ", MFU 25%"
    assert estimate.mfu_text(cfg, params, (1.0, 2.0), "cpu", 1) == ""
    head = params["embedding"] - cfg.seq_len * cfg.width
    assert gpus.flops_per_token(cfg, params) - 6 * params["non_embedding"] == 6 * head + 12 * 32 * 2048 * 1024
