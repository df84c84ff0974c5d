"""Dynamic Hyper-Connections (Zhu et al., arXiv 2409.19606), the HC paper's default.

Per token, per stream i, from that stream's own normalised vector xb_i = norm(x_i) (C values):
    A_m[i]    = s_a * tanh(xb_i . W_m)   + A_m_static[i]        read weights    H_pre  = A_m
    A_r[i, :] = s_a * tanh(xb_i @ W_r)   + A_r_static[i, :]     mixing          H_res  = A_r^T
    B[i]      = s_b * tanh(xb_i . W_b)   + B_static[i]          write weights   H_post = B
Init, under which HC computes exactly a pre-norm transformer: W = 0, A_m_static = one_hot(k mod n), A_r_static = I,
B_static = 1, s_a = s_b = 0.01. Row i of A_r says where stream i goes: the matrix that acts on x is its transpose.
Nothing bounds H_res: its products over depth are the amplification the study measures.

The public study's variants (--coefficient-norm flat, --hc-dynamic state, --hc-write-init first) are settings of
this arm: docs/model.md, "The public study's model".
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
        "coefficient_norm": ("stream", ("stream", "flat"), "HC's coefficients from each stream's own LayerNorm, or "
                             "from the streams divided by the RMS of the flattened state (mHC-style)"),
        "hc_dynamic": ("stream", ("stream", "state"), "HC's dynamic weights: a width-C Linear of each stream (W_m | "
                       "W_r | W_b, s_a shared by read and mix), or Linears of the whole flattened n*C state (read n, "
                       "write n, mix n*n outputs), each tanh-scaled by its own scale (the study's)"),
        "hc_write_init": ("all", ("all", "first"), "HC's static write B: ones (every stream), or stream 0 only (the "
                          "study's)"),
    },
    style={"color": "tab:red", "ls": "-", "marker": "^", "zorder": 3},
)


class Connection(StreamMixing):
    arm = "hc"

    def __init__(self, cfg, sublayer_index: int, path: str = "reference"):
        super().__init__(cfg, path)
        n, self.flat_norm, self.of_state = self.n, cfg.coefficient_norm == "flat", cfg.hc_dynamic == "state"
        # the HC paper's W_m | W_r (n columns) | W_b of each stream; the study's read | write | mix of the whole state
        self.dynamic = nn.Linear(n * cfg.width, 2 * n + n * n, bias=False) if self.of_state else nn.Linear(
            cfg.width, n + 2, bias=False)
        if self.of_state:               # the study's mix has a scale of its own
            self.s_r = nn.Parameter(torch.tensor(cfg.hc_scale_init))
        nn.init.zeros_(self.dynamic.weight)
        self.A_m_static = nn.Parameter(read_stream(cfg, sublayer_index).float())
        self.A_r_static = nn.Parameter(torch.eye(n))
        self.B_static = nn.Parameter(torch.ones(n) if cfg.hc_write_init == "all" else torch.eye(n)[0])
        self.s_a, self.s_b = (nn.Parameter(torch.tensor(cfg.hc_scale_init)) for _ in range(2))

    def coefficients(self, x):
        """H_pre, H_post (..., n), H_res (..., n, n) and no logits, for the streams x (..., n, C)."""
        n, dtype = self.n, torch.promote_types(x.dtype, torch.float32)
        with mixing_autocast(x, self.autocast):                       # the coefficients in fp32 (or fp64)
            x = x.to(dtype)
            if self.flat_norm:          # the public study's: every stream divided by one RMS of the whole state
                xb = self.scaled(x * torch.rsqrt(x.square().mean((-2, -1), keepdim=True) + self.eps))
            else:                       # the paper's: each stream's own norm, no affine
                xb = self.scaled(F.layer_norm(x, x.shape[-1:], eps=self.eps))
            if self.of_state:           # (..., 2n + n^2); its mixing block is H_res itself, as it acts on x
                d = torch.tanh(F.linear(xb.flatten(-2), self.dynamic.weight.to(dtype)))
                return (self.s_a * d[..., :n] + self.A_m_static, self.s_b * d[..., n:2 * n] + self.B_static,
                        self.s_r * d[..., 2 * n:].unflatten(-1, (n, n)) + self.A_r_static, None)
            d = torch.tanh(F.linear(xb, self.dynamic.weight.to(dtype)))         # (..., n, n + 2)
            A_m = self.s_a * d[..., 0] + self.A_m_static
            A_r = self.s_a * d[..., 1:n + 1] + self.A_r_static
            B = self.s_b * d[..., n + 1] + self.B_static
        return A_m, B, A_r.transpose(-1, -2), None


Connection.KERNEL_PATHS = {"fused": fused_update(fused.hc_coefficients), "triton": triton_update("hc_read")}


def res_logit_count(n: int) -> int:
    """The logits a token's H_res is made from (the planner's count): HC's n x n mixing weights."""
    return n * n
