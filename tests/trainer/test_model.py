"""The residual variants and the instability metrics of docs/model.md, on tiny CPU models."""

import pytest
import torch

from hcstudy.arms import hc
from hcstudy.arms.mhc import sinkhorn
from hcstudy.config import parse_config
from hcstudy.metrics import gain_metrics, instability_probe
from hcstudy.model import GPT, count_parameters
from hcstudy.optim import decay_groups


from helpers import randomize_mixing, tiny_config  # noqa: E402


@pytest.mark.parametrize("residual", ["hc", "mhc"])
def test_streams_persist_and_mixing_composes_across_depth(residual):
    torch.manual_seed(0)
    cfg = tiny_config(residual, depth=3, width=16, heads=2)
    model = GPT(cfg)
    randomize_mixing(model)
    x = torch.randn(2, 5, cfg.expansion, cfg.width)
    for block in model.blocks:
        assert block(x).shape == x.shape                  # every block maps (B, T, n, C) to (B, T, n, C)

    def run_from_block(state):
        for block in model.blocks:
            state = block(state)
        return state

    perturbed = x.clone()
    perturbed[..., 1, :] += 1.0                           # stream j = 1 entering sublayer k = 0
    with torch.no_grad():
        changed = (run_from_block(perturbed) - run_from_block(x)).abs().amax(dim=(0, 1, 3))
    assert (changed > 1e-4).sum() > 1, f"only stream(s) {changed.nonzero().flatten().tolist()} changed"


def test_forward_expands_once_and_collapses_once():
    cfg = tiny_config("hc", depth=2)
    model = GPT(cfg)
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: seen.append((args[0].shape, out.shape)))
    model(torch.randint(0, 256, (2, 8)))
    assert all(inp[-2] == cfg.expansion and out[-2] == cfg.expansion for inp, out in seen)


@pytest.mark.parametrize("residual", ["hc", "mhc"])
def test_the_state_stays_stream_major_through_every_block(residual):
    """(B, T, n, C) stored as (n, B, T, C): each stream one contiguous slab, which hcstudy/kernels/fused.py's speed relies on."""
    model = GPT(tiny_config(residual, depth=2), kernels="fused")
    layouts = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: layouts.extend(
            t.movedim(-2, 0).is_contiguous() for t in (args[0], out)))
    model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))[1].backward()
    assert layouts == [True] * 4


def test_hc_at_init_equals_the_pre_norm_baseline():
    torch.manual_seed(0)
    base = GPT(tiny_config("baseline", depth=3))
    torch.manual_seed(0)
    hc = GPT(tiny_config("hc", depth=3))
    body = {k: v for k, v in base.state_dict().items()}
    missing, unexpected = hc.load_state_dict(body, strict=False)
    assert not unexpected and all("_conn." in k for k in missing)
    # HC's collapsed state is n x the baseline's; LayerNorm(n h, eps) == LayerNorm(h, eps / n^2)
    base.ln_f.eps = hc.ln_f.eps / hc.streams ** 2
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(hc(idx), base(idx), rtol=0, atol=1e-5)


@pytest.mark.parametrize("scale", [0.5, 1.0, 2.0, 4.0, 8.0])
def test_sinkhorn_rows_are_exact_and_columns_converge(scale):
    generator = torch.Generator().manual_seed(0)
    logits = scale * torch.randn(500, 4, 4, generator=generator, dtype=torch.float64)
    P = sinkhorn(logits, iters=20)
    assert (P >= 0).all()
    assert (P.sum(-1) - 1).abs().max() < 1e-6                 # rows are normalised last: the forward gain is exact
    column_error = (P.sum(-2) - 1).abs().max().item()
    if scale <= 1:
        assert column_error < 1e-3
    else:
        # 20 iterations leave a truncation error on nearly-permutation matrices (measured max at scale 8:
        # 0.25 over these 500 draws); it must keep shrinking with more iterations
        assert column_error < 0.3
        assert (sinkhorn(logits, iters=500).sum(-2) - 1).abs().max() < column_error / 10


EXTREME_LOGITS = {
    "+-1e4": 1e4 * torch.randn(64, 4, 4, generator=torch.Generator().manual_seed(1)).sign(),
    "one huge entry": torch.full((4, 4), -1e4).index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(1e4)),
    "a column that underflows": torch.tensor([[0.0, -300.0], [0.0, -300.0]]),
    "a row that underflows": torch.tensor([[0.0, 0.0], [-300.0, -300.0]]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", EXTREME_LOGITS)
def test_sinkhorn_stays_finite_on_extreme_logits(case, dtype):
    logits = EXTREME_LOGITS[case].detach().to(dtype).clone().requires_grad_()
    P = sinkhorn(logits, iters=20)
    assert P.dtype == torch.float32                       # bf16 logits are projected in fp32
    assert torch.isfinite(P).all() and (P >= 0).all()
    assert (P.sum(-1) - 1).abs().max() < 1e-5             # every row still sums to 1: no row lost to underflow
    P.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_sinkhorn_balances_a_column_the_plain_exponential_loses():
    """exp(-300) underflows in fp32: dividing the plain exponential by its column sums gives 0/0. The
    projection of [[0, -300], [0, -300]] is exactly 1/2 everywhere (the two rows are equal)."""
    P = sinkhorn(EXTREME_LOGITS["a column that underflows"], iters=1)
    torch.testing.assert_close(P, torch.full((2, 2), 0.5))


def test_sinkhorn_gradients_flow_through_every_iteration():
    small = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda m: sinkhorn(m, iters=20), (small,))


def test_mhc_gains_stay_at_one_after_training_a_few_steps():
    torch.manual_seed(0)
    cfg = tiny_config("mhc", depth=3)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    idx = torch.randint(0, 256, (4, 16))
    for _ in range(5):
        _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert model.blocks[0].attn_conn.phi.weight.abs().max() > 0       # the mixing did train
    metrics = instability_probe(model, idx, lambda: torch.autocast("cpu", enabled=False), with_layers=True)
    for key in ("amax_fwd", "amax_l0_fwd", "min_row_sum"):
        assert abs(metrics[key] - 1) < 1e-5, key
    assert max(abs(g - 1) for g in metrics["layer_gain_fwd"]) < 1e-5
    assert abs(metrics["amax_bwd"] - 1) < 1e-2


def test_baseline_gains_are_exactly_one():
    model = GPT(tiny_config("baseline", depth=2))
    metrics = instability_probe(model, torch.randint(0, 256, (2, 8)), lambda: torch.autocast("cpu", enabled=False),
                                  with_layers=True)
    assert metrics["layer_gain_fwd"] == [1.0] * 4 and metrics["layer_gain_bwd"] == [1.0] * 4
    assert all(metrics[k] == 1.0 for k in ("amax_fwd", "amax_bwd", "amax_fwd_abs", "amax_bwd_abs", "amax_l0_fwd"))


def test_hc_reports_the_transpose_of_A_r():
    """A hand-built A_r: rows (where source stream i goes) sum to 3 and 1, columns to 2 and 2."""
    cfg = tiny_config("hc", expansion=2, width=4, heads=1)
    conn = hc.Connection(cfg, sublayer_index=0)
    A_r = torch.tensor([[2.0, 1.0], [0.0, 1.0]])
    with torch.no_grad():
        conn.A_r_static.copy_(A_r)
    _, _, H_res, _ = conn.coefficients(torch.randn(1, 1, 2, 4))
    torch.testing.assert_close(H_res[0, 0], A_r.T)
    metrics = gain_metrics(H_res.reshape(1, 1, 2, 2))
    assert metrics["amax_l0_fwd"] == pytest.approx(2.0)   # row sums of A_r^T = column sums of A_r
    assert metrics["amax_l0_bwd"] == pytest.approx(3.0)


def test_composites_match_hand_computed_products():
    H1 = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    H2 = torch.tensor([[2.0, 0.0], [0.0, 0.5]])
    H3 = torch.tensor([[1.0, 0.0], [-1.0, 1.0]])
    H = torch.stack([H1, H2, H3]).unsqueeze(1)             # (L=3, tokens=1, 2, 2)
    metrics = gain_metrics(H)
    P = [H1, H2 @ H1, H3 @ H2 @ H1]                          # [[1,1],[0,1]], [[2,2],[0,.5]], [[2,2],[-2,-1.5]]
    S = [H3 @ H2 @ H1, H3 @ H2, H3]                          # column sums: (0, .5), (0, .5), (0, 1)
    assert metrics["amax_fwd"] == pytest.approx(4.0)       # max |row sum| of P_2 = 4, of P_3 = 4 and 3.5
    assert metrics["amax_bwd"] == pytest.approx(1.0)       # max |column sum| over suffixes: H3's (0, 1)
    assert metrics["amax_fwd_abs"] == pytest.approx(max(p.abs().sum(-1).max().item() for p in P))
    assert metrics["amax_bwd_abs"] == pytest.approx(max(s.abs().sum(-2).max().item() for s in S))
    assert metrics["min_row_sum"] == pytest.approx(-3.5)
    assert metrics["layer_gain_fwd"] == pytest.approx([2.0, 2.0, 1.0])


def test_study_recipe_averages_over_tokens_and_multiplies_in_increasing_layer_order():
    H1 = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    H2 = torch.tensor([[2.0, 0.0], [0.0, 0.5]])
    H3 = torch.tensor([[1.0, 0.0], [-1.0, 1.0]])
    # two tokens per sublayer whose mean is H_k
    H = torch.stack([torch.stack([H - 0.5, H + 0.5]) for H in (H1, H2, H3)])
    Q = [H1, H1 @ H2, H1 @ H2 @ H3]                        # not H3 @ H2 @ H1: the study's order
    expected = max(max(q.abs().sum(-1).max().item(), q.abs().sum(-2).max().item()) for q in Q)
    assert gain_metrics(H)["amax_study"] == pytest.approx(expected)
    assert expected != pytest.approx(gain_metrics(torch.stack([H1, H2, H3]).unsqueeze(1))["amax_fwd_abs"])


def test_mhc_probe_separates_sinkhorn_truncation_from_amplification():
    """Near-permutation logits: 3 Sinkhorn iterations leave column sums visibly off, so the as-used backward
    gain exceeds 1; the same logits projected to convergence give 1, and the as-used gain stays under the
    bound the per-layer column errors allow."""
    torch.manual_seed(0)
    model = GPT(tiny_config("mhc", depth=3, sinkhorn_iters=3))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("b_res"):
                p.copy_(4 * torch.randn(p.shape, generator=generator))
    metrics = instability_probe(model, torch.randint(0, 256, (2, 16)), lambda: torch.autocast("cpu", enabled=False),
                                  with_layers=True)
    assert metrics["sinkhorn_col_err"] > 1e-2 and metrics["sinkhorn_row_err"] < 1e-5
    assert metrics["amax_bwd"] > 1.01
    assert metrics["amax_bwd"] <= metrics["sinkhorn_bwd_bound"] + 1e-9
    assert metrics["sinkhorn_converged_err"] < 1e-6
    for key in ("amax_fwd_converged", "amax_bwd_converged", "amax_study_converged"):
        assert abs(metrics[key] - 1) < 1e-5, key
    assert len(metrics["layer_sinkhorn_col_err"]) == 6
    assert max(metrics["layer_sinkhorn_col_err"]) == pytest.approx(metrics["sinkhorn_col_err"])


def test_probe_does_not_perturb_training_state():
    model = GPT(tiny_config("mhc", depth=2))
    model.train()
    idx = torch.randint(0, 256, (2, 8))
    rng = torch.get_rng_state()
    instability_probe(model, idx, lambda: torch.autocast("cpu", enabled=False), True)
    assert model.training and torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
@pytest.mark.parametrize("depth, expected", [(32, 1.73e9), (48, 2.54e9)])
def test_parameter_counts_of_the_c4_models(residual, depth, expected):
    cfg = parse_config(["--residual", residual, "--depth", str(depth)])
    assert (cfg.width, cfg.heads, cfg.seq_len) == (2048, 32, 1024)
    total = count_parameters(cfg)["total"]
    assert abs(total - expected) / expected < 0.02, f"{total:,}"


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
def test_meta_count_equals_the_real_model(residual):
    cfg = tiny_config(residual, depth=3, width=32, heads=4)
    assert count_parameters(cfg)["total"] == sum(p.numel() for p in GPT(cfg).parameters())


def test_weight_decay_only_on_weight_matrices():
    model = GPT(tiny_config("hc", depth=1))
    decay, rest = decay_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert "blocks.0.attn_conn.dynamic.weight" in decayed and "wte.weight" in decayed
    assert not any(k in n for n in decayed for k in ("static", "s_a", "s_b", "norm", "ln_f"))
    mhc = GPT(tiny_config("mhc", depth=1))
    names = {id(p): n for n, p in mhc.named_parameters()}
    decayed = {names[id(p)] for p in decay_groups(mhc, 0.1)[0]["params"]}
    assert "blocks.0.mlp_conn.phi.weight" in decayed
    assert not any(k in n for n in decayed for k in ("a_pre", "b_pre", "b_res", "b_post", "a_res"))
    for residual, dynamic in (("hc", "dynamic.weight"), ("mhc", "phi.weight")):       # --no-mixing-decay
        model = GPT(tiny_config(residual, depth=1))
        names = {id(p): n for n, p in model.named_parameters()}
        decay, rest = decay_groups(model, 0.1, decay_mixing=False)
        decayed, kept = {names[id(p)] for p in decay["params"]}, {names[id(p)] for p in rest["params"]}
        assert "wte.weight" in decayed and not any("_conn." in n for n in decayed)
        assert f"blocks.0.attn_conn.{dynamic}" in kept and len(decayed) + len(kept) == len(names)


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
def test_activation_checkpointing_gives_identical_gradients(residual):
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = GPT(tiny_config(residual, activation_checkpointing=checkpointing))
        randomize_mixing(model)
        model(idx, idx)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
def test_bf16_autocast_agrees_with_fp32(residual):
    torch.manual_seed(0)
    model = GPT(tiny_config(residual))
    idx = torch.randint(0, 256, (2, 16))
    full = model(idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = model(idx)
        _, _, H_res, _ = model.blocks[0].attn_conn.coefficients(torch.randn(1, 1, 4, 16)) if residual != "baseline" \
            else (None, None, torch.zeros(1, dtype=torch.float32), None)
    assert H_res.dtype == torch.float32                    # mixing coefficients stay fp32 under autocast
    torch.testing.assert_close(half.float(), full, rtol=0.05, atol=0.05)
