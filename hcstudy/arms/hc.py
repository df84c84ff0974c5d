"""Dynamic Hyper-Connections (Zhu et al., arXiv 2409.19606), the HC paper's default.

Per token, per stream i, from that stream's own normalised vector xb_i = norm(x_i) (C values):
    A_m[i]    = s_a * tanh(xb_i . W_m)   + A_m_static[i]        read weights    H_pre  = A_m
    A_r[i, :] = s_a * tanh(xb_i @ W_r)   + A_r_static[i, :]     mixing          H_res  = A_r^T
    B[i]      = s_b * tanh(xb_i . W_b)   + B_static[i]          write weights   H_post = B
Init, under which HC computes exactly a pre-norm transformer: W = 0, A_m_static = one_hot(k mod n), A_r_static = I,
B_static = 1, s_a = s_b = 0.01. Row i of A_r says where stream i goes: the matrix that acts on x is its transpose.
Nothing bounds H_res: its products over depth are the amplification the study measures.

The public study's HC, which makes its coefficients another way, is an arm of its own: study_hc.py.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from hcstudy.kernels import fused
from hcstudy.stream_mixing import StreamMixing, fused_update, mixing_autocast, read_stream, triton_update

ARM = dict(
    name="hc", label="HC", order=1,
    summary="dynamic Hyper-Connections: learned, unconstrained read, mix and write of n streams",
    paper="Zhu et al., Hyper-Connections, arXiv 2409.19606",
    kernels=("fused", "triton"),
    settings={
        "hc_scale_init": (0.01, (-1e6, 1e6), "initial HC dynamic scales s_a, s_b"),
    },
    style={"color": "tab:red", "ls": "-", "marker": "^", "zorder": 3},
)


class Connection(StreamMixing):

    def __init__(self, cfg, sublayer_index: int, path: str = "reference"):
        super().__init__(cfg, path)
        n = self.n
        self.dynamic = nn.Linear(cfg.width, n + 2, bias=False)       # W_m | W_r (n columns) | W_b, of each stream
        nn.init.zeros_(self.dynamic.weight)
        self.A_m_static = nn.Parameter(read_stream(cfg, sublayer_index).float())
        self.A_r_static = nn.Parameter(torch.eye(n))
        self.B_static = nn.Parameter(torch.ones(n))
        self.s_a, self.s_b = (nn.Parameter(torch.tensor(cfg.hc_scale_init)) for _ in range(2))

    def coefficients(self, x):
        """H_pre, H_post (..., n), H_res (..., n, n) and no logits, for the streams x (..., n, C)."""
        n, dtype = self.n, torch.promote_types(x.dtype, torch.float32)
        with mixing_autocast(x, self.autocast):                       # the coefficients in fp32 (or fp64)
            xb = self.scaled(F.layer_norm(x.to(dtype), x.shape[-1:], eps=self.eps))   # each stream's own, no affine
            d = torch.tanh(F.linear(xb, self.dynamic.weight.to(dtype)))         # (..., n, n + 2)
            A_m = self.s_a * d[..., 0] + self.A_m_static
            A_r = self.s_a * d[..., 1:n + 1] + self.A_r_static
            B = self.s_b * d[..., n + 1] + self.B_static
        return A_m, B, A_r.transpose(-1, -2), None


Connection.KERNEL_PATHS = {"fused": fused_update(fused.hc_coefficients), "triton": triton_update("hc_read")}


def res_logit_count(n: int) -> int:
    """The logits a token's H_res is made from (the planner's count): HC's n x n mixing weights."""
    return n * n
