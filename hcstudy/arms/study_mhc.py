"""The public 1.7B study's mHC, as its published trainer and Sinkhorn code build it (docs/model.md, "The public
study's model"): mHC's read and write (mhc.py) with three differences, all in the study's code.

    z      = tanh((v / rms(v)) @ phi)                       the RMS division before the projection, then a tanh
    b_pre  = c e_read,  b_post = c_post e_read              0 off the stream read (mHC's b_pre: -c there)
    H_res  = sinkhorn_rows_first(a_res * z_res + b_res)     exp, then `iters` x (rows / (sum + 1e-8), columns /
                                                            (sum + 1e-8)) on the linear scale: the columns exact
The tanh caps the logits at +-1, so the gates alone set their range. Dividing before the projection matters under
the study's bf16 autocast (--mixing-precision autocast): z, tanh(z) and a * z are then bf16 as in its code.

Its declaration's preset, seed-study, gives it the rest of the study's model and recipe (c = c_post = 2, b_res =
2 I, ...): `--residual study-mhc` is the study's mHC. It runs on its formulas.
"""
import torch
import torch.nn.functional as F

from hcstudy.arms import mhc

ARM = dict(
    name="study-mhc", label="study's mHC", order=11, pilot=False, preset="seed-study", sinkhorn=True,
    summary="the public 1.7B study's mHC: a tanh on its logits, its biases and its rows-first Sinkhorn",
    paper="the public 1.7B study's trainer; mHC after Xie et al. (DeepSeek), arXiv 2512.24880",
    uses=("sinkhorn_iters", "mhc_res_diag", "mhc_gate_init", "mhc_pre_bias", "mhc_post_bias"),
    style={"color": "tab:blue", "ls": (0, (5, 2)), "marker": ">", "zorder": 2},
)


def sinkhorn_rows_first(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """The study's Sinkhorn: exp, then `iters` row-then-column normalisations, each sum + 1e-8, in fp32 or wider."""
    P = logits.to(torch.promote_types(logits.dtype, torch.float32)).exp()
    for _ in range(iters):
        P = P / (P.sum(-1, keepdim=True) + 1e-8)
        P = P / (P.sum(-2, keepdim=True) + 1e-8)
    return P


res_logit_count = mhc.res_logit_count


class Connection(mhc.Connection):
    KERNEL_PATHS = {}

    def read_biases(self, cfg, read: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cfg.mhc_pre_bias * read.float(), cfg.mhc_post_bias * read.float()

    def logits(self, v: torch.Tensor) -> torch.Tensor:
        normed = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + self.eps)
        return torch.tanh(F.linear(self.scaled(normed.unflatten(-1, (self.n, -1))).flatten(-2),
                                   self.phi.weight.to(v.dtype)))

    def mixing(self, z_res):
        res_logits = self.a_res * z_res.unflatten(-1, (self.n, self.n)) + self.b_res
        return sinkhorn_rows_first(res_logits, self.iters), res_logits
