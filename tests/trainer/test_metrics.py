"""The streams' probe metrics on states and matrices whose values are known by hand: a dominated state, equal
streams, copies of one stream; H_res at the identity, at J/n, at a permutation; HC-like composites with negative
entries against a brute-force nearest permutation."""
import contextlib
import itertools
import math

import pytest
import torch

from hcstudy.arms import mhc_lite
from hcstudy.contract import STREAM_KEYS, STREAM_LAYER_KEYS
from hcstudy.metrics import gain_metrics, instability_probe, permutation_distance, state_metrics, stream_gram, stream_metrics
from hcstudy.model import GPT
from helpers import tiny_config


def gram(*streams):
    """The Gram matrix of one token whose n streams are the given vectors: (1, 1, n, n), one connection."""
    return stream_gram(torch.tensor(streams, dtype=torch.float64)[None, None])


def readings(G):
    dominance, streams, rank = state_metrics(G)[:, 0].tolist()
    return dominance, streams, rank


def test_a_state_held_by_one_stream_counts_one_stream_of_rank_one():
    assert readings(gram([3.0, -4.0, 1.0], [0, 0, 0], [0, 0, 0], [0, 0, 0])) == pytest.approx((1, 1, 1))


def test_equal_orthogonal_streams_count_n_streams_of_rank_n():
    assert readings(gram([2.0, 0, 0, 0], [0, -2.0, 0, 0], [0, 0, 2.0, 0], [0, 0, 0, 2.0])) == pytest.approx((0.25, 4, 4))


def test_copies_of_one_stream_share_the_energy_but_carry_rank_one():
    """The state at initialisation: the embedding copied into every stream."""
    assert readings(gram([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0])) == pytest.approx((1 / 3, 3, 1))


def test_a_hand_computed_two_stream_state():
    # energies 3 and 1 (shares 3/4, 1/4), orthogonal: singular values sqrt(3) and 1
    shares, singular = (0.75, 0.25), (math.sqrt(3) / (math.sqrt(3) + 1), 1 / (math.sqrt(3) + 1))
    expected = (0.75, math.exp(-sum(p * math.log(p) for p in shares)),
                math.exp(-sum(q * math.log(q) for q in singular)))
    assert readings(gram([math.sqrt(3), 0.0], [0.0, 1.0])) == pytest.approx(expected, rel=1e-12)
    assert expected[1] == pytest.approx(1.7548, abs=1e-4) and expected[2] == pytest.approx(1.9286, abs=1e-4)


def test_the_readings_are_token_means_and_their_depth_max_mean_and_min_after_the_first_connection():
    """The first connection reads the embedding copied n times (rank 1 by construction): the depth readings leave it
    out, so an effective_rank_min of 1 means a learned collapse, not the input."""
    held, spread = gram([1.0, 0.0], [0.0, 0.0]), gram([1.0, 0.0], [0.0, 1.0])
    G = torch.cat([torch.cat([held, held], 1), torch.cat([held, spread], 1), torch.cat([spread, spread], 1)])
    H = torch.eye(2, dtype=torch.float64).expand(3, 2, 2, 2)                # 3 connections, 2 tokens
    m = stream_metrics(G, H)
    assert m["layer_stream_dominance"] == pytest.approx([1, 0.75, 0.5])
    assert m["stream_dominance"] == pytest.approx(0.75) and m["stream_dominance_mean"] == pytest.approx(0.625)
    assert m["layer_effective_streams"] == pytest.approx([1, 1.5, 2]) and m["effective_streams_min"] == pytest.approx(1.5)
    assert m["effective_streams"] == pytest.approx(1.75) and m["effective_rank"] == pytest.approx(1.75)
    assert m["effective_rank_min"] == pytest.approx(1.5)


def mixing(H, depth=3, n=4):
    """stream_metrics' mixing readings for H (n, n) at every sublayer of `depth` and one token."""
    G = torch.eye(n, dtype=torch.float64).expand(depth, 1, n, n)
    keys = ("res_to_identity", "res_to_identity_mean", "composite_to_uniform", "composite_to_permutation")
    m = stream_metrics(G, H.expand(depth, 1, n, n))
    return tuple(m.get(key) for key in keys)


def test_the_identity_is_kept_apart_one_from_the_average():
    assert mixing(torch.eye(4)) == pytest.approx((0, 0, 1, 0))


def test_the_uniform_matrix_is_one_from_the_identity_and_from_every_permutation():
    assert mixing(torch.full((4, 4), 0.25)) == pytest.approx((1, 1, 0, 1))


def test_a_permutation_other_than_the_identity():
    shift = torch.eye(4).roll(1, 0)         # no fixed point: |P - I| sums to 2n, over the unit 2(n - 1)
    assert mixing(shift) == pytest.approx((8 / 6, 8 / 6, 1, 0))


def test_the_composite_readings_ask_about_its_shape_not_its_size():
    """HC's composites grow: scaled to absolute entries summing to n (a doubly stochastic matrix's sum), 100 I is
    still a permutation and 100 J/n still the average; the gains say the size."""
    assert mixing(torch.eye(4) * 100 ** (1 / 3))[2:] == pytest.approx((1, 0))
    assert mixing(torch.full((4, 4), 0.25) * 7)[2:] == pytest.approx((0, 1))


def test_the_nearest_permutation_of_hc_like_matrices_is_found_among_all_of_them():
    """Negative entries and entries over 1 (HC's composites): the linear scoring against a brute force."""
    M = torch.randn(50, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    perms = [torch.eye(4, dtype=torch.float64)[list(p)] for p in itertools.permutations(range(4))]
    brute = torch.stack([torch.stack([(m - P).abs().sum() for P in perms]).min() for m in M])
    assert torch.allclose(permutation_distance(M), brute, rtol=1e-12)


def test_per_token_distances_are_averaged_over_the_tokens():
    H = torch.stack([torch.eye(3), torch.full((3, 3), 1 / 3)]).double().expand(2, 2, 3, 3)    # 2 sublayers
    m = stream_metrics(torch.eye(3, dtype=torch.float64).expand(2, 2, 3, 3), H)
    assert m["layer_res_to_identity"] == pytest.approx([0.5, 0.5])
    assert m["composite_to_uniform"] == pytest.approx(0.5) and m["composite_to_permutation"] == pytest.approx(0.5)


def test_too_many_permutations_to_score_leave_that_reading_out():
    n = mhc_lite.MAX_EXPANSION + 1
    m = stream_metrics(torch.eye(n, dtype=torch.float64).expand(2, 1, n, n), torch.eye(n).expand(2, 1, n, n))
    assert "composite_to_permutation" not in m and m["composite_to_uniform"] == pytest.approx(1)


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc", "mhc-lite", "identity-hc"])
def test_the_probe_logs_them_for_every_arm_with_streams(residual):
    cfg = tiny_config(residual=residual)
    model = GPT(cfg)
    tokens = torch.randint(0, 100, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    m = instability_probe(model, tokens, contextlib.nullcontext, with_layers=True)
    if residual == "baseline":
        assert not {*STREAM_KEYS, *STREAM_LAYER_KEYS} & m.keys()
        return
    assert {*STREAM_KEYS, *STREAM_LAYER_KEYS} <= m.keys() and len(m["layer_effective_rank"]) == 2 * cfg.depth
    # every stream starts as a copy of the embedding: shares 1/n, rank one
    assert m["layer_stream_dominance"][0] == pytest.approx(1 / cfg.expansion)
    assert m["layer_effective_rank"][0] == pytest.approx(1, abs=1e-5)
    if residual in ("hc", "identity-hc"):                   # H_res = I at initialisation
        assert (m["res_to_identity"], m["composite_to_permutation"]) == (0, 0)
    without = instability_probe(model, tokens, contextlib.nullcontext, with_layers=False)
    assert set(STREAM_KEYS) <= without.keys() and not set(STREAM_LAYER_KEYS) & without.keys()


def test_a_learned_diagonal_reads_as_docs_model_md_says():
    d, n = 0.96, 4              # diagonal d, the rest even: n(1 - d) / (n - 1)
    H = torch.full((n, n), (1 - d) / (n - 1)).fill_diagonal_(d).double()
    assert mixing(H)[0] == pytest.approx(n * (1 - d) / (n - 1)) and mixing(H)[0] == pytest.approx(0.0533, abs=1e-4)


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
