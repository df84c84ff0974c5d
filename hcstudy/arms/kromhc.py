"""KromHC (Zhou, Gu, Iacovides and Mandic, arXiv 2601.21579): H_res a Kronecker product of small doubly stochastic
factors, one per mode of the streams seen as a tensor.

With n = i_1 i_2 ... i_K (for n = 2^K every i_k = 2), per token:
    U_k    = sum_m w_k,m P_m,   w_k = softmax(a_res * z_res,k + b_res,k)     the i_k! permutations P_m of size i_k
    H_res  = U_1 (x) U_2 (x) ... (x) U_K                                      (x): the Kronecker product
z_res holds sum_k i_k! logits (4 at n = 4, 6 at n = 8) from mHC's projection; a_res is one gate shared by the
factors. A Kronecker product of doubly stochastic matrices is doubly stochastic (its row sums are products of the
factors' row sums), so H_res is exactly doubly stochastic with no iterations, from O(n^2 C) parameters, against
mHC-lite's n! logits per token. mHC's read and write.

Decisions where the paper is silent or where its code differs from ours (docs/model.md, "KromHC"):
- the factors are n's prime factors, smallest first (n = 2^K: K factors of 2, as the paper's code); a prime factor
  above 5 is refused, as mHC-lite refuses n > 6 (its i_k! logits);
- b_res puts one logit on each factor's identity and 0 on its other permutations, the logit chosen so that H_res's
  diagonal at init equals mHC's at b_res = c I, each factor taking an equal share of it (the paper's code puts 0 on
  the identity and -8 elsewhere: H_res within 3e-4 of I); so every arm of the study starts from the same diagonal.
"""
import math

import torch
import torch.nn.functional as F

from hcstudy.arms import mhc, mhc_lite
from hcstudy.contract import ConfigError

ARM = dict(
    name="kromhc", label="KromHC", order=5,
    summary="H_res a Kronecker product of small doubly stochastic factors: exact, no iterations, few logits",
    paper="Zhou et al., KromHC, arXiv 2601.21579",
    kernels=(),
    uses=("mhc_res_diag", "mhc_gate_init", "mhc_pre_bias", "mhc_post_bias"),
    style={"color": "tab:orange", "ls": "-.", "marker": "X", "zorder": 3},
)
LARGEST_FACTOR = 5      # a factor of 7 would be 5,040 logits per token and sublayer, as mHC-lite's n = 7


def factors(n: int) -> list[int]:
    """n's prime factors, smallest first: the sizes of the Kronecker factors (none for n = 1)."""
    found, p = [], 2
    while n > 1:
        while n % p == 0:
            found.append(p)
            n //= p
        p += 1
    return found


def res_logit_count(n: int) -> int:
    return sum(math.factorial(i) for i in factors(n))


def validate(cfg) -> None:
    if cfg.mhc_res_diag < 0:
        raise ConfigError(f"--residual kromhc matches mHC's H_res diagonal at init only for --mhc-res-diag >= 0, "
                          f"got {cfg.mhc_res_diag:g}")
    if max(factors(cfg.expansion), default=1) > LARGEST_FACTOR:
        raise ConfigError(f"--residual kromhc mixes each prime factor of n by its permutations: --expansion "
                          f"{cfg.expansion} has the factor {max(factors(cfg.expansion))}; use an n whose prime factors "
                          f"are at most {LARGEST_FACTOR} (2, 4, 6, 8, ...)")


def identity_logit(diagonal: float, size: int) -> float:
    """The logit on the identity (0 on the other permutations of `size` streams) that gives a factor this diagonal:
    solve (e^b + (m-1)! - 1) / (e^b + m! - 1) = d for e^b, m = size (docs/model.md)."""
    rest = math.factorial(size - 1) - 1
    return math.log((diagonal * (math.factorial(size) - 1) - rest) / (1 - diagonal))


def kronecker(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """A (x) B per token: (..., a, a) and (..., b, b) to (..., ab, ab), entry [(i, k), (j, l)] = A[i, j] B[k, l]."""
    a, b = A.shape[-1], B.shape[-1]
    return torch.einsum("...ij,...kl->...ikjl", A, B).reshape(*A.shape[:-2], a * b, a * b)


class Connection(mhc.Connection):
    res_logit_count = staticmethod(res_logit_count)
    KERNEL_PATHS = {}

    def __init__(self, cfg, sublayer_index: int, path: str = "reference"):
        self.sizes = factors(cfg.expansion)
        super().__init__(cfg, sublayer_index, path)
        for k, size in enumerate(self.sizes):         # rebuilt from n: not in the checkpoint
            self.register_buffer(f"permutations_{k}", mhc_lite.permutation_matrices(size), persistent=False)

    def res_bias(self, cfg) -> torch.Tensor:
        # mHC's diagonal at b_res = c I, shared equally: the factors' diagonals multiply to it
        target = math.exp(cfg.mhc_res_diag) / (math.exp(cfg.mhc_res_diag) + cfg.expansion - 1)
        share = target ** (1 / len(self.sizes))
        return torch.cat([F.one_hot(torch.tensor(0), math.factorial(size)) * identity_logit(share, size)
                          for size in self.sizes])

    def mixing(self, z_res):
        H_res = torch.ones(*z_res.shape[:-1], 1, 1, dtype=z_res.dtype, device=z_res.device)
        if not self.sizes:              # one stream: H_res = [[1]]
            return H_res, None
        logits = (self.a_res * z_res + self.b_res).split([math.factorial(size) for size in self.sizes], dim=-1)
        for k, factor_logits in enumerate(logits):
            # the softmax in fp32 or wider: every factor's rows and columns sum to 1 up to rounding
            w = torch.softmax(factor_logits, dim=-1)
            U = torch.einsum("...m,mij->...ij", w, getattr(self, f"permutations_{k}").to(w.dtype))
            H_res = kronecker(H_res, U)
        return H_res, None
