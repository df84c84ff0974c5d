"""Manifold-constrained Hyper-Connections (DeepSeek, arXiv 2512.24880).

Per token, from the flattened state v = vec(x) (n C values), in fp32:
    r      = sqrt(mean(v^2) + eps)                          a weight-less RMS over all n C values
    z      = (v @ phi) / r                                  phi: (n C, n*n + 2n), one fused projection
    H_pre  = sigmoid(a_pre * z_pre + b_pre)                 (n,)   a non-negative read
    H_post = 2 sigmoid(a_post * z_post + b_post)            (n,)   a non-negative write, 1 at b_post = 0
    H_res  = sinkhorn(a_res * z_res.view(n, n) + b_res)     (n, n) doubly stochastic: every gain 1
Gates a_* start at 0.01, phi at 0. Where the paper gives no init (decisions, docs/model.md): b_post = 0,
b_res = c I (c = 4: H_res's diagonal ~0.95), b_pre +c on stream k mod n and -c elsewhere.

Its family (the arms whose Connection subclasses this one) shares the read and the write (this file's settings and
`Connection.coefficients`) and makes H_res its own way (`mixing`, `res_logit_count`, `res_bias`); a member may make the logits z
(`logits`) and the biases of the read and the write (`read_biases`) its own way too.
The public study's mHC, a member of the family with its own logits, biases and Sinkhorn, is study_mhc.py.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from hcstudy.kernels import fused
from hcstudy.stream_mixing import StreamMixing, fused_update, mixing_autocast, read_stream, triton_update

ARM = dict(
    name="mhc", label="mHC", order=2, sinkhorn=True,
    summary="manifold-constrained HC: H_res projected onto the doubly stochastic matrices (Sinkhorn-Knopp)",
    paper="Xie et al. (DeepSeek), mHC, arXiv 2512.24880",
    kernels=("fused", "triton"),
    settings={
        "sinkhorn_iters": (20, (1, 10_000), "Sinkhorn-Knopp iterations per mHC mixing matrix"),
        "mhc_res_diag": (4.0, (-1e6, 1e6), "mHC b_res = c * I: the diagonal bias of H_res's logits (c=4: diagonal "
                         "~0.95 at init)"),
        "mhc_gate_init": (0.01, (-1e6, 1e6), "initial mHC gates a_pre, a_post, a_res"),
        "mhc_pre_bias": (4.0, (-1e6, 1e6), "mHC b_pre: +c on the stream read (--read-stream), -c elsewhere"),
        "mhc_post_bias": (0.0, (-1e6, 1e6), "mHC b_post: +c on the stream read (--read-stream), 0 elsewhere"),
    },
    style={"color": "tab:blue", "ls": "-", "marker": "s", "zorder": 2},
)


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """exp(logits) made doubly stochastic by `iters` column-then-row normalisations, in fp32 or wider."""
    P = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # the first pair in the log domain: the same maths, but it cannot overflow or leave a zero sum (docs/model.md)
    P = P - P.logsumexp(-2, keepdim=True)
    return balance((P - P.logsumexp(-1, keepdim=True)).exp(), iters - 1)


def balance(P: torch.Tensor, iters: int) -> torch.Tensor:
    """`iters` Sinkhorn pairs on the linear scale: divide by the column sums, then by the row sums."""
    for _ in range(iters):
        P = P / P.sum(-2, keepdim=True)
        P = P / P.sum(-1, keepdim=True)
    return P


def res_logit_count(n: int) -> int:
    """The logits a token's H_res is made from: n x n, projected to the doubly stochastic matrices."""
    return n * n


class Connection(StreamMixing):
    """mHC: coefficients from the whole flattened state. A family member overrides `res_logit_count` (its z_res's
    size), `res_bias` (b_res at init) and `mixing` (H_res from z_res), and may override `logits` (z from vec(x))
    and `read_biases` (b_pre, b_post at init)."""
    TRITON_MIX = "sinkhorn"
    res_logit_count = staticmethod(res_logit_count)

    def __init__(self, cfg, sublayer_index: int, path: str = "reference"):
        super().__init__(cfg, path)
        n, mixes = self.n, self.res_logit_count(self.n) > 0
        self.iters = cfg.sinkhorn_iters
        self.phi = nn.Linear(n * cfg.width, 2 * n + self.res_logit_count(n), bias=False)    # [z_pre | z_post | z_res]
        nn.init.zeros_(self.phi.weight)
        self.a_pre, self.a_post = (nn.Parameter(torch.tensor(cfg.mhc_gate_init)) for _ in range(2))
        if mixes:
            self.a_res = nn.Parameter(torch.tensor(cfg.mhc_gate_init))
        self.b_pre, self.b_post = (nn.Parameter(b) for b in self.read_biases(cfg, read_stream(cfg, sublayer_index)))
        if mixes:
            self.b_res = nn.Parameter(self.res_bias(cfg))

    # the paper gives no bias init (docs/model.md): read mostly one stream, write 1, H_res near I
    def read_biases(self, cfg, read: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """b_pre, b_post (n,) at init, `read` the one-hot stream this sublayer reads."""
        return torch.where(read.bool(), cfg.mhc_pre_bias, -cfg.mhc_pre_bias), cfg.mhc_post_bias * read.float()

    def res_bias(self, cfg) -> torch.Tensor:
        return cfg.mhc_res_diag * torch.eye(cfg.expansion)

    def logits(self, v: torch.Tensor) -> torch.Tensor:
        """z = (v phi) / rms(v) for the flattened state v (..., n C): the division after the projection, as the
        kernels fold it (the same maths as before it, but for rounding)."""
        inv_rms = torch.rsqrt(v.square().mean(-1, keepdim=True) + self.eps)
        return F.linear(self.scaled(v.unflatten(-1, (self.n, -1))).flatten(-2), self.phi.weight.to(v.dtype)) * inv_rms

    def coefficients(self, x):
        """H_pre, H_post (..., n), H_res (..., n, n) and the logits projected, for the streams x (..., n, C)."""
        n, dtype = self.n, torch.promote_types(x.dtype, torch.float32)
        with mixing_autocast(x, self.autocast):
            z = self.logits(x.flatten(-2).to(dtype))                           # from vec(x), nC per token
            z_pre, z_post, z_res = z.split([n, n, z.shape[-1] - 2 * n], dim=-1)
            H_pre = torch.sigmoid(self.a_pre * z_pre + self.b_pre)
            H_post = 2 * torch.sigmoid(self.a_post * z_post + self.b_post)
            return H_pre, H_post, *self.mixing(z_res)

    def mixing(self, z_res):
        """H_res (..., n, n) and the logits Sinkhorn projected (the probe measures their truncation)."""
        res_logits = self.a_res * z_res.unflatten(-1, (self.n, self.n)) + self.b_res
        return sinkhorn(res_logits, self.iters), res_logits


Connection.KERNEL_PATHS = {"fused": fused_update(fused.mhc_coefficients), "triton": triton_update("mhc_read")}
