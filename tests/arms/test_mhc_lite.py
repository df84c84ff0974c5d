"""hcstudy/arms/mhc_lite.py: H_res a convex combination of the n! permutation matrices, exactly doubly stochastic
for any logits and any precision, starting from mHC's diagonal."""
import json
import math

import pytest
import torch

from hcstudy.arms import mhc, mhc_lite
from hcstudy.arms.mhc import sinkhorn
from hcstudy.config import Config, PRESETS, parse_config
from hcstudy.contract import ConfigError
from hcstudy.metrics import instability_probe
from helpers import NO_AUTOCAST, tiny_config, train_steps
from trainer_runs import deterministic, metrics, trainer


def lite_connection(**overrides):
    cfg = tiny_config("mhc-lite", **overrides)
    conn = mhc_lite.Connection(cfg, 0)
    with torch.no_grad():
        conn.a_res.fill_(1.0)
    return conn


@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_mhc_lite_is_doubly_stochastic_for_any_logits(scale):
    conn = lite_connection()
    z_res = scale * torch.randn(256, math.factorial(conn.n), generator=torch.Generator().manual_seed(0))
    H, logits = conn.mixing(z_res)
    assert logits is None and torch.isfinite(H).all() and (H >= 0).all()
    assert (H.sum(-1) - 1).abs().max() < 1e-6 and (H.sum(-2) - 1).abs().max() < 1e-6


def test_mhc_lite_stays_doubly_stochastic_under_bf16_autocast():
    conn = lite_connection()
    with torch.no_grad():
        conn.phi.weight.normal_(0, 1e3)                           # logits of order 1e4 after the RMS scaling
    x = torch.randn(2, 8, conn.n, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        H_pre, H_post, H, _ = conn.coefficients(x)
    assert H.dtype == torch.float32 and torch.isfinite(H).all()
    assert (H.sum(-1) - 1).abs().max() < 1e-6 and (H.sum(-2) - 1).abs().max() < 1e-6


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_mhc_lite_starts_with_the_diagonal_of_mhc(n):
    """docs/model.md: the identity permutation's logit is chosen so that H_res at init has mHC's diagonal."""
    cfg = tiny_config("mhc-lite", expansion=n, width=16)
    lite = mhc_lite.Connection(cfg, 0).mixing(torch.zeros(1, math.factorial(n)))[0][0]
    paper = sinkhorn(mhc.Connection(cfg, 0).b_res.detach(), cfg.sinkhorn_iters)
    torch.testing.assert_close(lite.diagonal(), paper.diagonal(), rtol=0, atol=1e-6)
    assert lite.diagonal()[0] > 0.9


def test_mhc_lite_gains_stay_at_one_after_thirty_demo_lr_steps():
    lr = PRESETS["demo"]["lr"]
    model, idx = train_steps(tiny_config("mhc-lite", depth=3), steps=30, lr=lr)
    conn = model.blocks[0].attn_conn
    assert conn.phi.weight.abs().max() > 10 * lr and conn.a_res.item() != Config.mhc_gate_init   # it trained
    metrics_ = instability_probe(model, idx, NO_AUTOCAST, with_layers=True)
    assert abs(metrics_["amax_fwd"] - 1) < 1e-4 and abs(metrics_["amax_bwd"] - 1) < 1e-4, metrics_
    assert "sinkhorn_col_err" not in metrics_                                           # exact: nothing truncated


def test_mhc_lite_refuses_an_expansion_with_too_many_permutations():
    with pytest.raises(ConfigError, match="5,040 logits"):
        parse_config(["--preset", "tiny", "--residual", "mhc-lite", "--expansion", "7"])
    parse_config(["--preset", "tiny", "--residual", "mhc", "--expansion", "7"])       # mHC's n x n is fine


@pytest.mark.slow
def test_mhc_lite_resumes_to_the_same_losses(tmp_path):
    """A tiny mHC-lite run stopped (an injected OOM) after its step-10 checkpoint continues to the losses of an
    uninterrupted one; config.json says the formulas ran, not hcstudy/kernels/fused.py."""
    args = ["--residual", "mhc-lite", "--steps", "20", "--ckpt-every", "10", "--kernels", "fused"]
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    assert trainer(first, *args)[0] == 0
    assert trainer(second, *args, env={"TRAIN_C4_INJECT_NAN": "oom:15"})[0] == 4
    code, stdout, stderr = trainer(second, *args)
    assert code == 0 and "resumed from" in stdout, stderr
    reference, resumed = (metrics(folder / "mhc-lite_d2_s42") for folder in (first, second))
    assert deterministic(resumed) == deterministic(reference)
    assert json.loads((second / "mhc-lite_d2_s42" / "config.json").read_text())["kernels"] == "reference"
