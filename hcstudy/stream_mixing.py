"""What every residual arm with n streams shares: the sublayer update, the connections' norm of the streams, the
stream each sublayer reads at init, and the choice of the path (formulas, fused, triton) made when a model is built.

An arm (hcstudy/arms/) subclasses StreamMixing and writes only its coefficients: H_pre, H_post (..., n) and
H_res (..., n, n) from the streams x (..., n, C). The update is the same for every arm (docs/model.md):

    u      = H_pre @ x                    the weighted read of the streams
    y      = F(norm(u))                   the block's own pre-norm sublayer
    x_next = H_res @ x + H_post^T * y     mix the streams, write y into each with weight H_post[i]
"""
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from hcstudy.kernels import choice, fused


def mixing_autocast(x: torch.Tensor, autocast: bool = False):
    """Autocast off, so that the streams are mixed in fp32 and never rounded to bf16; or, for the study's
    --mixing-precision autocast, left as the run set it."""
    return contextlib.nullcontext() if autocast else torch.autocast(x.device.type, enabled=False)


def stream_update(x, H_pre, H_post, H_res, sublayer, autocast: bool = False):
    """x_next = H_res x + H_post^T F(norm(H_pre x)) per token, x (..., n, C), H_pre and H_post (..., n), H_res
    (..., n, n); sublayer is F(norm(.)). x is the state widened (fp32, or fp64): u and the mixing in its dtype,
    the caller rounds the result once to --stream-dtype."""
    with mixing_autocast(x, autocast):
        u = torch.einsum("...j,...jc->...c", H_pre, x)
    y = sublayer(u).to(x.dtype)
    with mixing_autocast(x, autocast):
        return H_res @ x + H_post.unsqueeze(-1) * y.unsqueeze(-2)


def read_stream(cfg, sublayer_index: int) -> torch.Tensor:
    """The stream sublayer k reads at init, one-hot: k mod n (every stream in turn), or 0 (the public study's)."""
    return F.one_hot(torch.tensor(sublayer_index % cfg.expansion if cfg.read_stream == "rotate" else 0), cfg.expansion)


def wide(x: torch.Tensor) -> torch.Tensor:
    """The state in fp32 (or wider): a bf16 state widened once, exactly."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class StreamMixing(nn.Module):
    """One connection of an arm with streams: its coefficients (the subclass's `coefficients`), then the update,
    on the path chosen when the model was built (`kernels`, as --kernels names it): the formulas with autograd, or
    a kernel path the arm registers in its `KERNEL_PATHS` (fused.py's hand-written backwards, triton_ops.py's
    kernels). Returns the next state and the probe's record (H_res, the logits Sinkhorn projected or None),
    detached."""
    # how the mHC family's Triton read makes H_res: "identity", "sinkhorn" or "permutations" (triton_ops.MIX_MODES);
    # "" for an arm whose Triton path, if any, is its own
    TRITON_MIX = ""

    def __init__(self, cfg, path: str = "reference"):
        super().__init__()
        self.n, self.width, self.kernels = cfg.expansion, cfg.width, path
        self.per_sequence, self.autocast = cfg.coefficients == "sequence", cfg.mixing_precision == "autocast"
        # the study's RMSNorm of the streams: a learnable scale per entry of the n x C state, eps 1e-8
        self.eps = 1e-8 if cfg.mixing_norm == "scaled" else cfg.norm_eps
        self.norm_scale = nn.Parameter(torch.ones(self.n, self.width)) if cfg.mixing_norm == "scaled" else None

    def scaled(self, x_normed: torch.Tensor) -> torch.Tensor:
        return x_normed if self.norm_scale is None else x_normed * self.norm_scale.to(x_normed.dtype)

    def forward(self, x, sublayer):
        update = formulas_update if self.kernels == "reference" else type(self).KERNEL_PATHS[self.kernels]
        x, H_res, res_logits = update(self, x, sublayer)
        return x, (H_res.detach(), None if res_logits is None else res_logits.detach())


def formulas_update(conn: StreamMixing, x, sublayer):
    """The papers' formulas with autograd. The one fp32 copy of a bf16 state that the coefficients and the update
    share: autograd saves it once per connection, as it saves an fp32 state itself (docs/model.md, "Precision")."""
    state = wide(x)
    # per sequence: one set from the streams averaged over the positions (B, 1, n, C), broadcast to every
    # position; a later token then changes an earlier position's output (not causal, docs/model.md)
    H_pre, H_post, H_res, res_logits = conn.coefficients(state.mean(-3, keepdim=True) if conn.per_sequence else state)
    return stream_update(state, H_pre, H_post, H_res, sublayer, conn.autocast).to(x.dtype), H_res, res_logits


def fused_update(coefficients):
    """A fused.py path: the arm's coefficients with hand-written backwards (`coefficients(conn, x)`, stream axes
    first, x passed through their maths), then fused.py's update."""
    def update(conn, x, sublayer):
        x, H_pre, H_post, H_res, res_logits = coefficients(conn, x)
        x = fused.stream_update(x, H_pre, H_post, H_res, sublayer)
        return x, H_res.detach().movedim((0, 1), (-2, -1)), res_logits
    return update


def triton_update(read: str):
    """A triton_ops.py path: the arm's read kernel (`read`: its name there), the sublayer, the write kernel."""
    def update(conn, x, sublayer):
        kernels = choice.triton_kernels()
        u, H_post, H_res, res_logits, x = getattr(kernels, read)(conn, x)
        return kernels.write(x, H_res, H_post, sublayer(u)), H_res, res_logits
    return update
