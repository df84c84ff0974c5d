"""hcstudy/arms/mhc.py: the paper's mHC, its Sinkhorn projection (exact rows, converging columns, finite on any
logits) and its gains, which stay at 1 as it trains."""
import pytest
import torch

from hcstudy.arms.mhc import sinkhorn
from hcstudy.metrics import instability_probe
from hcstudy.model import GPT
from helpers import tiny_config


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
