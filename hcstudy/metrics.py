"""The instability probe: how much the residual streams amplify, and what they carry (docs/model.md, "Instability
metrics").

The mixing matrices H_res act as x_next = H_res @ x, per token. For a matrix M, the forward gain is its largest
absolute row sum and the backward gain its largest absolute column sum; the composite gains are those of the
prefix products H_k ... H_1 and the suffix products H_L ... H_k. Gains are computed per token, then averaged over
the tokens of a fixed probe batch of held-out sequences, in fp64, without grad. The baseline reads 1 for all.
"""
import itertools
import math

import torch
import torch.nn as nn

from hcstudy.arms.mhc import balance, sinkhorn
from hcstudy.arms.mhc_lite import MAX_EXPANSION, permutation_matrices
from hcstudy.contract import STREAM_KEYS, STREAM_LAYER_KEYS
from hcstudy.stream_mixing import mixing_autocast


def row_gain(M):                    # g_fwd: the largest absolute row sum
    return M.sum(dim=-1).abs().amax(dim=-1)


def col_gain(M):                    # g_bwd: the largest absolute column sum
    return M.sum(dim=-2).abs().amax(dim=-1)


def composites(H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix products P_k = H_k ... H_1 and suffix products S_k = H_L ... H_k of H (L, tokens, n, n)."""
    prefix, suffix = [H[0]], [H[-1]]
    for k in range(1, H.shape[0]):
        prefix.append(H[k] @ prefix[-1])
        suffix.append(suffix[-1] @ H[-1 - k])
    return torch.stack(prefix), torch.stack(suffix[::-1])


def study_gains(H: torch.Tensor) -> torch.Tensor:
    """The public 1.7B study's reading, one value per k: H averaged over the tokens, multiplied as H_1 ... H_k, the
    larger of the largest absolute row and column sums (docs/model.md)."""
    products = list(itertools.accumulate(H.mean(dim=1), torch.matmul))
    return torch.stack([torch.maximum(Q.abs().sum(-1).amax(), Q.abs().sum(-2).amax()) for Q in products])


def batch_mean_mixing(records: list, device: torch.device) -> torch.Tensor:
    """(L, n, n): each sublayer's H_res as a forward recorded it, averaged over its tokens (the plain residual: 1)."""
    if records[0] is None:
        return torch.ones(len(records), 1, 1, device=device)
    return torch.stack([H.float().reshape(-1, *H.shape[-2:]).mean(0) for H, _ in records])


def gain_metrics(H: torch.Tensor) -> dict:
    """Every probe metric of H (L sublayers, tokens, n, n): per-token gains averaged, then the max (min) over L."""
    H = H.double()
    P, S = composites(H)
    scalars = torch.stack([row_gain(P).mean(-1).max(), col_gain(S).mean(-1).max(),
                           P.abs().sum(-1).amax(-1).mean(-1).max(), S.abs().sum(-2).amax(-1).mean(-1).max(),
                           P.sum(-1).amin(-1).mean(-1).min(), S.sum(-2).amin(-1).mean(-1).min(), study_gains(H).max()])
    layers = torch.stack([row_gain(H).mean(-1), col_gain(H).mean(-1)])
    # one device-to-host copy for everything the probe logs, not one synchronisation per value
    values = torch.cat([scalars, layers.flatten()]).tolist()
    keys = ("amax_fwd", "amax_bwd", "amax_fwd_abs", "amax_bwd_abs", "min_row_sum", "min_col_sum", "amax_study")
    layer_fwd, layer_bwd = values[len(keys):len(keys) + H.shape[0]], values[len(keys) + H.shape[0]:]
    return {**dict(zip(keys, values)), "amax_l0_fwd": layer_fwd[0], "amax_l0_bwd": layer_bwd[0],
            "layer_gain_fwd": layer_fwd, "layer_gain_bwd": layer_bwd}


def stochastic_errors(H: torch.Tensor) -> torch.Tensor:
    """(2, L): max |row sum - 1| and max |column sum - 1| over the tokens of each sublayer's H (L, tokens, n, n)."""
    return torch.stack([(H.sum(-1) - 1).abs().amax((1, 2)), (H.sum(-2) - 1).abs().amax((1, 2))])


@torch.no_grad()
def sinkhorn_converged(logits: torch.Tensor, tol: float = 1e-6, max_iters: int = 20_000) -> tuple[torch.Tensor, int]:
    """The logits projected in fp64 until every row and column sum is within `tol` of 1, and the iterations that
    took; each round of 20 only on the matrices still off (a few need thousands, most tens: docs/model.md)."""
    n = logits.shape[-1]
    # stored (n, n, matrices): each sum over a matrix axis adds n contiguous rows of matrices
    stored = logits.double().reshape(-1, n, n).movedim(0, -1).contiguous()
    matrices, done = sinkhorn(stored.movedim(-1, 0), 1).movedim(0, -1), 1
    todo = torch.arange(matrices.shape[-1], device=logits.device)
    while done < max_iters:
        off = matrices[..., todo]
        todo = todo[torch.maximum((off.sum(1) - 1).abs().amax(0), (off.sum(0) - 1).abs().amax(0)) > tol]
        if not len(todo):
            break
        matrices[..., todo] = balance(matrices[..., todo].movedim(-1, 0), 20).movedim(0, -1)
        done += 20
    return matrices.movedim(-1, 0).reshape(logits.shape), done


def projection_metrics(H: torch.Tensor, logits: torch.Tensor) -> dict:
    """mHC: the truncation error of the H_res used, and the gains of its logits projected to convergence."""
    converged, iters = sinkhorn_converged(logits)
    exact = gain_metrics(converged)
    layer_row, layer_col = stochastic_errors(H.double()).tolist()
    # non-negative H with column sums within e_k of 1: no suffix product's column sum exceeds prod(1 + e_k)
    bound = math.prod(1 + e for e in layer_col)
    return {"sinkhorn_row_err": max(layer_row), "sinkhorn_col_err": max(layer_col), "layer_sinkhorn_row_err": layer_row,
            "layer_sinkhorn_col_err": layer_col, "sinkhorn_bwd_bound": bound, "amax_fwd_converged": exact["amax_fwd"],
            "amax_bwd_converged": exact["amax_bwd"], "amax_study_converged": exact["amax_study"],
            "sinkhorn_converged_iters": iters, "sinkhorn_converged_err": stochastic_errors(converged).max().item()}


def stream_gram(x: torch.Tensor) -> torch.Tensor:
    """x x^T (B, T, n, n) of the streams x (B, T, n, C), in fp64 a sequence at a time: its eigenvalues are squared
    singular values, so fp32 would put a near-rank-one state's small ones at sqrt(eps), 3e-4 of the largest; a copy
    of the whole state in fp64 would be 0.7 GB a connection at the study's sizes."""
    grams = []
    with mixing_autocast(x):
        for sequence in x.split(1):
            sequence = sequence.double()
            grams.append(sequence @ sequence.transpose(-1, -2))
    return torch.cat(grams)


def spread(p: torch.Tensor) -> torch.Tensor:
    """exp of the entropy of the distributions p (..., n): how many of their n entries count, from 1 to n."""
    return torch.special.entr(p).sum(-1).exp()


def state_metrics(G: torch.Tensor) -> torch.Tensor:
    """(3, L) from the Gram matrices G (L, tokens, n, n) of the states at each connection's input, token means of:
    the largest stream's share of the energy, the effective number of streams, the effective rank (docs/model.md)."""
    energy = G.diagonal(dim1=-2, dim2=-1)
    shares = energy / energy.sum(-1, keepdim=True).clamp_min(torch.finfo(G.dtype).tiny)
    singular = torch.linalg.eigvalsh(G).clamp_min(0).sqrt()
    weights = singular / singular.sum(-1, keepdim=True).clamp_min(torch.finfo(G.dtype).tiny)
    return torch.stack([shares.amax(-1), spread(shares), spread(weights)]).mean(-1)


def permutation_distance(M: torch.Tensor) -> torch.Tensor:
    """sum |M - P| (...) for the permutation P nearest to each M (..., n, n): sum |M| plus, over P's n entries,
    |M_ij - 1| - |M_ij|; linear in P, so one matmul scores all n! of them."""
    gain = ((M - 1).abs() - M.abs()).flatten(-2) @ permutation_matrices(M.shape[-1]).to(M).flatten(1).T
    return M.abs().sum((-2, -1)) + gain.amin(-1)


def stream_metrics(G: torch.Tensor, H: torch.Tensor) -> dict:
    """What the streams carry (G: their Gram matrices) and how far H_res (L, tokens, n, n) and its full-depth
    product sit from I, J/n and a permutation: per token, then averaged (docs/model.md); n >= 2."""
    n, H = H.shape[-1], H.double()
    unit = 2 * (n - 1)          # sum |P - J/n| for every permutation P: J/n and a permutation are 1 apart
    composite = composites(H)[0][-1]            # H_L ... H_1, scaled as a doubly stochastic matrix is: its shape
    composite = composite * n / composite.abs().sum((-2, -1), keepdim=True).clamp_min(torch.finfo(H.dtype).tiny)
    dominance, streams, rank = state_metrics(G)
    to_identity = (H - torch.eye(n, dtype=H.dtype, device=H.device)).abs().sum((-2, -1)).mean(-1) / unit
    # over depth, the connections after the first: its input is the embedding copied n times, rank 1 by construction
    learned = [reading[1:] for reading in (dominance, streams, rank)]
    values = [learned[0].max(), learned[0].mean(), learned[1].mean(), learned[1].min(), learned[2].mean(),
              learned[2].min(), to_identity.max(), to_identity.mean(),
              (composite - 1 / n).abs().sum((-2, -1)).mean() / unit]
    if n <= MAX_EXPANSION:     # beyond, n! permutations are too many to score per token
        values.append(permutation_distance(composite).mean() / unit)
    layers = torch.cat([torch.stack(values), dominance, streams, rank, to_identity]).tolist()
    return dict(zip(STREAM_KEYS, layers[:len(values)])) | {
        key: layers[len(values) + i * len(H):len(values) + (i + 1) * len(H)] for i, key in enumerate(STREAM_LAYER_KEYS)}


LAYER_KEYS = ("layer_gain_fwd", "layer_gain_bwd", "layer_sinkhorn_row_err", "layer_sinkhorn_col_err",
              *STREAM_LAYER_KEYS)


@torch.no_grad()
def instability_probe(model: nn.Module, probe_idx: torch.Tensor, autocast_ctx, with_layers: bool) -> dict:
    """Run the fixed probe batch and measure the gains. No RNG, no autograd state; the mode is restored."""
    was_training, mixing, states = model.training, [], []
    model.eval()
    try:
        with autocast_ctx():
            model(probe_idx, mixing_out=mixing, states_out=states)
    finally:
        model.train(was_training)
    if mixing[0] is None:                          # the plain residual: H_res = 1 by definition
        metrics = gain_metrics(torch.ones(len(mixing), 1, 1, 1))
    else:
        n = mixing[0][0].shape[-1]
        H = torch.stack([h.float().reshape(-1, n, n) for h, _ in mixing])
        metrics = gain_metrics(H)
        if n > 1:
            metrics |= stream_metrics(torch.stack([g.reshape(-1, n, n) for g in states]), H)
        if mixing[0][1] is not None:
            metrics |= projection_metrics(H, torch.stack([z.float().reshape(-1, n, n) for _, z in mixing]))
    if not with_layers:
        metrics = {key: value for key, value in metrics.items() if key not in LAYER_KEYS}
    return metrics
