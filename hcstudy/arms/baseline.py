"""The baseline: a standard pre-norm residual, x_next = x + F(norm(x)), on the same transformer body, so that the
arms differ only in the residual path. One stream; its gains are 1 by definition."""
import torch.nn as nn

from hcstudy.stream_mixing import wide

ARM = dict(
    name="baseline", label="baseline", order=0, streams=False,
    summary="plain pre-norm residual, x + F(norm(x))",
    paper="GPT-2 (Radford et al. 2019)",
    kernels=(),
    style={"color": "0.15", "ls": (0, (4, 3)), "marker": "o", "zorder": 4},
)


class Connection(nn.Module):
    """x + F(norm(x)) on one stream; its mixing record is None: gain 1. u and the add in fp32 (or wider) as for the
    streams, the sum rounded once to the state's dtype."""

    def __init__(self, cfg, sublayer_index: int, path: str = "reference"):
        super().__init__()

    def forward(self, x, sublayer):
        state = wide(x)
        # the add promotes a bf16 sublayer output itself: no cast kernel of its own, the same sum
        return (state + sublayer(state.squeeze(-2)).unsqueeze(-2)).to(x.dtype), None
