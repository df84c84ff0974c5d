"""hcstudy/arms/kromhc.py: H_res = U_1 (x) ... (x) U_K, each factor a softmax mixture of its permutations."""
import math

import pytest
import torch

from hcstudy.arms import kromhc, mhc
from hcstudy.contract import ConfigError
from hcstudy.config import parse_config
from hcstudy.metrics import gain_metrics, instability_probe
from hcstudy.model import GPT
from helpers import randomize_mixing, tiny_config


def test_the_factors_are_the_prime_factors_and_the_logits_their_permutations():
    assert [kromhc.factors(n) for n in (1, 2, 4, 6, 8, 12)] == [[], [2], [2, 2], [2, 3], [2, 2, 2], [2, 2, 3]]
    assert [kromhc.res_logit_count(n) for n in (4, 8, 6)] == [4, 6, 8]       # against mHC-lite's 24, 40,320, 720


def test_the_kronecker_product_is_the_textbook_one():
    A, B = torch.randn(3, 2, 2, dtype=torch.float64), torch.randn(3, 3, 3, dtype=torch.float64)
    for t in range(3):
        torch.testing.assert_close(kromhc.kronecker(A, B)[t], torch.kron(A[t], B[t]))


@pytest.mark.parametrize("n", [2, 4, 6, 8])
@pytest.mark.parametrize("scale", [0.0, 1.0, 30.0])
def test_h_res_is_exactly_doubly_stochastic_for_any_logits(n, scale):
    conn = kromhc.Connection(tiny_config("kromhc", expansion=n), 0)
    z = scale * torch.randn(64, kromhc.res_logit_count(n), dtype=torch.float64)
    H = conn.double().mixing(z)[0]
    assert H.shape == (64, n, n) and H.min() >= 0
    for axis in (-1, -2):
        torch.testing.assert_close(H.sum(axis), torch.ones(64, n, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_it_starts_with_the_diagonal_of_mhc(n):
    cfg = tiny_config("kromhc", expansion=n)
    krom = kromhc.Connection(cfg, 0).mixing(torch.zeros(1, kromhc.res_logit_count(n)))[0][0]
    paper = mhc.sinkhorn(mhc.Connection(tiny_config("mhc", expansion=n), 0).b_res.detach(), cfg.sinkhorn_iters)
    torch.testing.assert_close(krom.diagonal(), paper.diagonal(), rtol=0, atol=1e-6)


def test_its_composite_gains_read_one_within_rounding_after_training_far_from_init():
    torch.manual_seed(0)
    model = GPT(tiny_config("kromhc", depth=4))
    randomize_mixing(model)
    idx = torch.randint(0, 256, (2, 32))
    metrics = instability_probe(model, idx, lambda: torch.autocast("cpu", enabled=False), with_layers=True)
    for key in ("amax_fwd", "amax_bwd", "min_row_sum", "min_col_sum"):
        assert abs(metrics[key] - 1) < 1e-6, (key, metrics[key])
    assert 0 < metrics["res_to_identity"] and "sinkhorn_row_err" not in metrics      # it mixes, with no Sinkhorn
    assert gain_metrics(torch.eye(4).expand(8, 3, 4, 4))["amax_fwd"] == 1


def test_an_expansion_with_a_large_prime_factor_or_a_negative_diagonal_is_refused():
    with pytest.raises(ConfigError, match="has the factor 7"):
        parse_config(["--preset", "tiny", "--residual", "kromhc", "--expansion", "7"])
    with pytest.raises(ConfigError, match="--mhc-res-diag >= 0"):
        parse_config(["--preset", "tiny", "--residual", "kromhc", "--mhc-res-diag", "-1"])
    assert parse_config(["--preset", "tiny", "--residual", "kromhc", "--expansion", "8"]).expansion == 8


def test_its_parameters_grow_as_n_squared_not_n_factorial():
    def mixing_logits(arm, n):
        return GPT(tiny_config(arm, expansion=n, depth=1)).blocks[0].attn_conn.phi.out_features
    assert mixing_logits("kromhc", 8) == 2 * 8 + 6 and mixing_logits("mhc", 8) == 2 * 8 + 64
    assert mixing_logits("mhc-lite", 5) == 2 * 5 + math.factorial(5)
