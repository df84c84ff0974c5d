"""mHC-lite (arXiv 2601.05732): H_res a convex combination of the n! permutation matrices,

    H_res = sum_k w_k P_k,   w = softmax(a_res * z_res + b_res)      z_res: n! logits per token, from mHC's projection

exactly doubly stochastic with no iterations. mHC's read and write. Decision (docs/model.md): b_res is one logit
on the identity, chosen so that H_res's diagonal at init equals mHC's at b_res = c I (identity_logit).
"""
import itertools
import math

import torch
import torch.nn.functional as F

from hcstudy.arms import mhc
from hcstudy.contract import ConfigError
from hcstudy.stream_mixing import triton_update

ARM = dict(
    name="mhc-lite", label="mHC-lite", order=3, pilot=False,        # its n! logits: the pilot's CPU hour has no room
    summary="H_res a softmax mixture of the n! permutation matrices: doubly stochastic, no iterations",
    paper="mHC-lite, arXiv 2601.05732",
    kernels=("triton",),
    uses=("mhc_res_diag", "mhc_gate_init", "mhc_pre_bias", "mhc_post_bias"),
    style={"color": "tab:green", "ls": "-", "marker": "D", "zorder": 2},
)
MAX_EXPANSION = 6       # 720 permutations; 7 would be 5,040 logits per token and sublayer


def validate(cfg) -> None:
    if cfg.mhc_res_diag < 0:
        raise ConfigError(f"--residual mhc-lite matches mHC's H_res diagonal at init only for --mhc-res-diag >= 0, "
                          f"got {cfg.mhc_res_diag:g}")
    if cfg.expansion > MAX_EXPANSION:
        raise ConfigError(f"--residual mhc-lite mixes all n! permutations: --expansion {cfg.expansion} would need "
                          f"{math.factorial(cfg.expansion):,} logits per token; use at most {MAX_EXPANSION}")


def permutation_matrices(n: int) -> torch.Tensor:
    """The n! permutation matrices (n!, n, n), the identity first: P_k[i, j] = 1 where row i takes stream j."""
    return F.one_hot(torch.tensor(list(itertools.permutations(range(n)))), n).float()


def identity_logit(res_diag: float, n: int) -> float:
    """The logit on the identity (all others 0) whose H_res diagonal equals mHC's at b_res = c I: solve
    (e^b + (n-1)! - 1) / (e^b + n! - 1) = e^c / (e^c + n - 1), i.e. e^b = (n-1)! e^c - (n-1)! + 1 (docs/model.md)."""
    m = math.factorial(n - 1)
    return res_diag + math.log(m - (m - 1) * math.exp(-res_diag))      # written so that a large c cannot overflow


res_logit_count = math.factorial


class Connection(mhc.Connection):
    TRITON_MIX = "permutations"
    res_logit_count = staticmethod(res_logit_count)
    KERNEL_PATHS = {"triton": triton_update("mhc_read")}

    def __init__(self, cfg, sublayer_index: int, path: str = "reference"):
        super().__init__(cfg, sublayer_index, path)
        self.register_buffer("permutations", permutation_matrices(self.n), persistent=False)     # rebuilt from n

    def res_bias(self, cfg) -> torch.Tensor:
        return F.one_hot(torch.tensor(0), math.factorial(cfg.expansion)) * identity_logit(cfg.mhc_res_diag,
                                                                                           cfg.expansion)

    def mixing(self, z_res):
        # the softmax in fp32 or wider: w >= 0 summing to 1, so every row and column of H_res sums to 1 up to rounding
        w = torch.softmax(self.a_res * z_res + self.b_res, dim=-1)
        return torch.einsum("...k,kij->...ij", w, self.permutations.to(w.dtype)), None
