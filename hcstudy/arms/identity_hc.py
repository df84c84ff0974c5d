"""Identity-HC: mHC's read and write (H_pre, H_post), H_res = I fixed: no mixing and no Sinkhorn. Its composite
gain is 1 by construction; the arm asks whether the mixing is needed at all."""
import torch

from hcstudy.arms import mhc
from hcstudy.stream_mixing import triton_update

ARM = dict(
    name="identity-hc", label="identity-HC", order=4,
    summary="mHC's read and write, H_res = I fixed: is the mixing needed at all?",
    paper="an ablation of mHC (arXiv 2512.24880)",
    kernels=("triton",),
    uses=("mhc_gate_init", "mhc_pre_bias", "mhc_post_bias"),
    style={"color": "tab:purple", "ls": (0, (1, 2)), "marker": "v", "zorder": 4},
)


def res_logit_count(n: int) -> int:
    return 0


class Connection(mhc.Connection):
    TRITON_MIX = "identity"
    res_logit_count = staticmethod(res_logit_count)
    KERNEL_PATHS = {"triton": triton_update("mhc_read")}

    def mixing(self, z_res):
        return torch.eye(self.n, dtype=z_res.dtype, device=z_res.device).expand(*z_res.shape[:-1], self.n, self.n), None
