"""The public 1.7B study's HC, as its published trainer builds it (docs/model.md, "The public study's model").

Per token, from the whole flattened state v = vec(x) (n C values), divided by one RMS of it:
    xb     = v / sqrt(mean(v^2) + eps)                      every stream by the same RMS (the paper: each its own)
    d      = tanh(xb @ W)                                   W: (n C, 2n + n*n), read | write | mix of the whole state
    H_pre  = s_a * d_pre  + A_m_static                      read weights (n,)
    H_post = s_b * d_post + B_static                        write weights (n,)
    H_res  = s_r * d_res.view(n, n) + A_r_static            the mix as it acts on x (n, n)
Init: W = 0 (re-drawn at --dynamic-init-std by the body's init, as the study's own init does), s_a = s_b = s_r =
0.01, A_m_static = the stream read (--read-stream), A_r_static = I, B_static = e_0: the write goes to stream 0 only.
Nothing bounds H_res, as in the paper's HC.

Its declaration's preset, seed-study, gives it the rest of the study's model and recipe (the RMSNorm's learnable
scale, stream 0 read and collapsed, per-sequence coefficients, ...): `--residual study-hc` is the study's HC.
The kernels implement the papers' arms only: this one runs on its formulas.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from hcstudy.arms import hc
from hcstudy.stream_mixing import StreamMixing, mixing_autocast, read_stream

ARM = dict(
    name="study-hc", label="study's HC", order=10, pilot=False, preset="seed-study",
    summary="the public 1.7B study's HC: read, write and mix each a tanh of one projection of the whole state",
    paper="the public 1.7B study's trainer; HC after Zhu et al., arXiv 2409.19606",
    uses=("hc_scale_init",),
    style={"color": "tab:red", "ls": (0, (5, 2)), "marker": "<", "zorder": 3},
)


class Connection(StreamMixing):
    KERNEL_PATHS = {}

    def __init__(self, cfg, sublayer_index: int, path: str = "reference"):
        super().__init__(cfg, path)
        n = self.n
        self.dynamic = nn.Linear(n * cfg.width, 2 * n + n * n, bias=False)        # read | write | mix
        nn.init.zeros_(self.dynamic.weight)
        self.A_m_static = nn.Parameter(read_stream(cfg, sublayer_index).float())
        self.A_r_static = nn.Parameter(torch.eye(n))
        self.B_static = nn.Parameter(torch.eye(n)[0])
        self.s_a, self.s_b, self.s_r = (nn.Parameter(torch.tensor(cfg.hc_scale_init)) for _ in range(3))

    def coefficients(self, x):
        """H_pre, H_post (..., n), H_res (..., n, n) and no logits, for the streams x (..., n, C)."""
        n, dtype = self.n, torch.promote_types(x.dtype, torch.float32)
        with mixing_autocast(x, self.autocast):       # fp32, or the run's autocast (--mixing-precision autocast)
            x = x.to(dtype)
            xb = self.scaled(x * torch.rsqrt(x.square().mean((-2, -1), keepdim=True) + self.eps))
            d = torch.tanh(F.linear(xb.flatten(-2), self.dynamic.weight.to(dtype)))     # (..., 2n + n^2)
            return (self.s_a * d[..., :n] + self.A_m_static, self.s_b * d[..., n:2 * n] + self.B_static,
                    self.s_r * d[..., 2 * n:].unflatten(-1, (n, n)) + self.A_r_static, None)


res_logit_count = hc.res_logit_count          # its n x n mixing weights, as HC's
