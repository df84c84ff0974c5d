"""The arms beyond the papers' HC and mHC (docs/model.md, "Further arms"): identity-HC, mHC-lite, per-sequence
coefficients and the public study's model choices (--preset seed-study), on tiny CPU models."""
import json
import math

import pytest
import torch

from hcstudy import contract
from hcstudy.kernels import choice
from hcstudy import run_folder
import train_c4 as T
from hcstudy.arms import hc, mhc, mhc_lite
from hcstudy.arms import study_hc as study_hc_arm, study_mhc as study_mhc_arm
from hcstudy.arms.mhc import sinkhorn
from hcstudy.config import Config, PRESETS, parse_config
from hcstudy.contract import ConfigError
from hcstudy.metrics import instability_probe
from hcstudy.model import GPT
from hcstudy.run_folder import check_resumable
from helpers import randomize_mixing, tiny_config
from test_train import deterministic, metrics, trainer

NO_AUTOCAST = lambda: torch.autocast("cpu", enabled=False)     # noqa: E731
COEFFICIENT_ARMS = ("hc", "mhc", "mhc-lite", "identity-hc")


def train_steps(cfg, steps, lr, seed=0):
    """`steps` AdamW steps of a tiny model on one fixed batch; the model and that batch."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    idx = torch.randint(0, 256, (4, 16))
    for _ in range(steps):
        model(idx, idx)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, idx


def test_identity_hc_logs_gain_one_and_mixes_nothing():
    model, idx = train_steps(tiny_config("identity-hc", depth=3), steps=10, lr=0.05)
    conn = model.blocks[0].attn_conn
    assert conn.phi.weight.abs().max() > 0 and conn.phi.out_features == 2 * conn.n       # read and write only
    assert not hasattr(conn, "a_res") and not hasattr(conn, "b_res")
    metrics_ = instability_probe(model, idx, NO_AUTOCAST, with_layers=True)
    for key in ("amax_fwd", "amax_bwd", "amax_fwd_abs", "amax_bwd_abs", "min_row_sum", "min_col_sum",
                "amax_l0_fwd", "amax_l0_bwd"):
        assert abs(metrics_[key] - 1) < 1e-6, key
    assert max(abs(g - 1) for g in metrics_["layer_gain_fwd"] + metrics_["layer_gain_bwd"]) < 1e-6
    assert "sinkhorn_col_err" not in metrics_                                           # no Sinkhorn to measure


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


def outputs_with_a_changed_future_token(residual, coefficients):
    """The logits of one sequence and of the same sequence with its last token changed."""
    torch.manual_seed(0)
    model = GPT(tiny_config(residual, depth=2, coefficients=coefficients))
    randomize_mixing(model)
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 256
    with torch.no_grad():
        return model(idx), model(changed)


@pytest.mark.parametrize("residual", COEFFICIENT_ARMS)
def test_sequence_coefficients_let_a_future_token_change_earlier_positions(residual):
    before, after = outputs_with_a_changed_future_token(residual, "sequence")
    assert (after[0, :-1] - before[0, :-1]).abs().max() > 1e-6                          # not causal
    before, after = outputs_with_a_changed_future_token(residual, "token")
    torch.testing.assert_close(after[0, :-1], before[0, :-1], rtol=0, atol=0)           # causal


@pytest.mark.parametrize("residual", COEFFICIENT_ARMS)
def test_sequence_coefficients_are_one_set_per_sequence(residual):
    model = GPT(tiny_config(residual, depth=2, coefficients="sequence"))
    randomize_mixing(model)
    mixing = []
    model(torch.randint(0, 256, (3, 16)), mixing_out=mixing)
    assert all(H.shape == (3, 1, model.streams, model.streams) for H, _ in mixing)


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


def test_the_study_arms_bring_the_study_preset_and_name_their_runs_as_the_launcher_does():
    cfg = parse_config(["--residual", "study-hc", "--depth", "32"])
    assert (cfg.preset, cfg.coefficients, cfg.dynamic_init_std, cfg.read_stream, cfg.collapse) == (
        "seed-study", "sequence", 0.02, "first", "first")
    assert cfg.run_name == contract.run_name("study-hc", 32, 42) == "study-hc_d32_s42"
    token = parse_config(["--residual", "study-mhc", "--coefficients", "token"])
    assert token.run_name == contract.run_name("study-mhc", 32, 42, None, 20, "token") == "study-mhc_d32_s42_tok"
    small = parse_config(["--residual", "study-mhc", "--preset", "demo"])      # a preset given wins over the arm's
    assert (small.preset, small.depth, small.mhc_res_diag) == ("seed-study,demo", 4, 2.0)
    # the paper's HC in the study's body and recipe is named after them
    paper = parse_config(["--preset", "seed-study", "--residual", "hc", "--depth", "32"])
    assert paper.run_name == contract.run_name("hc", 32, 42, "seed-study") == "hc_d32_s42_seed-study"
    default = parse_config([])                      # the papers' model stays the default
    assert (default.preset, default.coefficients, default.dynamic_init_std, default.read_stream,
            default.collapse) == ("c4", "token", 0.0, "rotate", "sum")
    assert parse_config(["--residual", "mhc", "--sinkhorn-iters", "100"]).run_name == "mhc_d32_s42_it100"


def test_each_seed_study_choice_shapes_the_model():
    study = dict(read_stream="first", dynamic_init_std=0.01)
    torch.manual_seed(0)
    study_hc = GPT(tiny_config("hc", depth=2, **study))
    assert all(conn.A_m_static.argmax() == 0 for block in study_hc.blocks for conn in (block.attn_conn, block.mlp_conn))
    assert 0.005 < study_hc.blocks[0].attn_conn.dynamic.weight.std() < 0.02
    study_mhc = mhc.Connection(tiny_config("mhc", **study), 3)
    assert study_mhc.b_pre.argmax() == 0
    # the study's HC: one RMS for the whole state, so scaling one stream changes the coefficients of the others
    x = torch.randn(2, 4, 4, 16)
    louder = x.clone()
    louder[..., 1, :] *= 10
    flat = study_hc_arm.Connection(tiny_config("study-hc"), 0)
    per_stream = hc.Connection(tiny_config("hc"), 0)
    for conn in (flat, per_stream):
        torch.nn.init.normal_(conn.dynamic.weight)
    moved = [(conn.coefficients(louder)[0] - conn.coefficients(x)[0])[..., 0].abs().max()     # stream 0's read
             for conn in (flat, per_stream)]
    assert moved[0] > 1e-4 and moved[1] == 0
    # the study's mHC's tanh: the read weights stay within sigmoid(+-a_pre + b_pre) however large the projection
    tanh = study_mhc_arm.Connection(tiny_config("study-mhc", mhc_gate_init=1.0, mhc_pre_bias=-4.0), 0)
    torch.nn.init.normal_(tanh.phi.weight, std=1e3)
    H_pre = tanh.coefficients(x)[0]
    assert H_pre[..., 0].max() <= torch.sigmoid(torch.tensor(1.0 - 4.0)) + 1e-6


def test_collapse_first_reads_stream_zero_only():
    torch.manual_seed(0)
    model = GPT(tiny_config("hc", depth=1, collapse="first"))
    randomize_mixing(model)
    last = []
    model.blocks[-1].register_forward_hook(lambda module, args, out: last.append(out) or out.retain_grad())
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    assert last[0].grad[..., 1:, :].abs().max() == 0 and last[0].grad[..., 0, :].abs().max() > 0


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
