"""The residual streams on the GPU: Triton kernels (hcstudy/kernels/triton_kernels.py) for every arm with per-token
coefficients (hc, mhc, mhc-lite, identity-hc), chosen by --kernels triton (or auto on CUDA, train_c4.kernel_path),
proven equal to train_c4.py's formulas in the interpreter (tests/kernels/test_triton_ops.py), compiled for sm_90 by
benchmarks/triton_compile.py. This module launches them (the autograd Functions) and counts their bytes (traffic).

One mHC-family connection, per direction (the maths: docs/model.md, "The Triton path"):
  forward   coefficients and read (one kernel: the projection vec(x) phi^T by tl.dot and the RMS in one pass over x,
            gates, Sinkhorn / permutation mix, then u = H_pre x in a second)
            -> the sublayer -> write (one kernel: x_next = H_res x + H_post y)
  backward  the write's backward (one kernel) -> the sublayer
            -> the coefficients' backward (one kernel over token blocks: dH_pre from x and du, then the logits')
            -> the read's share of x's gradient (one kernel over channel chunks: H_pre du, the RMS term and the
               projection's graw phi added into the write's dx in place; phi's gradient from per-group partials)
HC's read is shaped the same way: its kernel projects each stream x_i W^T by tl.dot with the norms' sums in its
first pass over x, its coefficients' backward makes dH_pre in one pass over x and du, and its column pass adds the
norm's terms and the projection's g W into the write's dx in place, forming W's gradient from per-group partials
(the rows of its tiles are (token, stream) pairs: W is shared by the streams). The formulas run hundreds of small kernels for the
same connection (mHC's Sinkhorn alone 40 half-steps each way). Each kernel's launch is a torch.library operator
(triton_library.py: its schema, its fake implementation, the launch), which the autograd Functions below call:
torch.compile traces a block of this path as one graph (the operators opaque, the matmuls and sums around them
compiled), with and without activation checkpointing, which recomputes the sublayer and leaves the connection's
kernels to run once (train_c4.Block).

The state x is (tokens, n, C) in fp32 or bf16 (--stream-dtype: loaded into fp32, rounded once where stored) with
any strides; the coefficients are fp32, tokens-first and contiguous: H_pre, H_post (tokens, n), H_res (tokens, n, n)
with H_res[t, i, j] the weight of stream j in stream i; u is fp32 as on the formulas' path. Every reduction over the
tokens (the weights' gradients) is a cuBLAS matmul, a torch sum, or a kernel's sum over the tokens its program owns
(then torch's over the programs): no atomics, so two runs with the same seed give the same bits.

The planner runs this path on the CPU with each kernel replaced by its byte count (traffic, step_work.counting),
also where setup.sh without --dev installed no triton: triton is imported at the first launch (load).
"""
from __future__ import annotations

import torch

from hcstudy import arms
from hcstudy.kernels.fused import autocast_off  # the coefficients in fp32 whatever the autocast, as on the fused path
from hcstudy.kernels.triton_kernels import (  # noqa: F401  (load: triton_compile's and the launch layer's)
    _hc_read_backward, _hc_read_columns, _hc_read_forward, _mhc_read_backward, _mhc_read_columns, _mhc_read_forward,
    _write_backward, _write_forward, load)


def _next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for n >= 1, without triton: block sizes are chosen before any kernel is loaded."""
    return 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# how an mHC-family read kernel makes H_res (its constexpr MIX), as the arm's Connection.TRITON_MIX names it
MIX_MODES = {"identity": 0, "sinkhorn": 1, "permutations": 2}
# "stored": the forward keeps Sinkhorn's 2(iters - 1) sum vectors per token and the backward walks them back;
# "recompute": nothing kept, each pair's input recomputed from the first exp (docs/benchmarks.md has both timed)
SINKHORN_BACKWARD = "stored"


# The read kernels project the logits themselves (tl.dot) in tiles of at most LOGIT_TILE a token, two where there
# are more (mhc-lite at n = 5: 128 + 16 for its 130, where one tile of 256 takes the forward to 200 registers and the
# column pass to 184 KiB of shared memory), up to PROJECTED_LOGITS in all: _projects, _logit_tiles
LOGIT_TILE = 128
PROJECTED_LOGITS = 256
COLUMN_PROGRAMS = 512        # _mhc_read_columns' programs (channel chunks x token groups): a card's SMs a few times


def dot_block_sizes(n: int, C: int) -> tuple[int, int, int]:
    """block_sizes for the read kernel that projects with tl.dot over a token block: 16 tokens (tl.dot's least), a
    (tokens, n, chunk) tile of about 2,048 values, chunks of 16 channels at least (tl.dot's least)."""
    n_pad = _next_power_of_2(n)
    return 16, max(16, min(_next_power_of_2(C), 2048 // (16 * n_pad))), n_pad


def column_blocks(n: int) -> tuple[int, int, int, int]:
    """(tokens per block, C per chunk, padded n, warps) of _mhc_read_columns: a program's columns are 64 of vec(x) (its
    chunk of every stream) and its share of phi's gradient a (2n + R, 64) tile held over all its tokens, with 8 warps
    so that it stays in registers (0 spills at n <= 8, either stream dtype: docs/benchmarks.md)."""
    n_pad = _next_power_of_2(n)
    return 16, max(1, 64 // n_pad), n_pad, 8


def hc_column_blocks(n: int) -> tuple[int, int, int, int]:
    """(tokens per block, C per chunk, padded n, warps) of _hc_read_columns: a tile of 16 (token, stream) rows
    (tl.dot's least) by 32 channels, W's chunk and its share of W's gradient two (16, 32) tiles held over all its
    tokens: about 100 registers and 0 spills at n <= 8, either stream dtype, where 32 rows or 64 channels take
    170-250 and spill at some (docs/benchmarks.md)."""
    n_pad = _next_power_of_2(n)
    return max(1, 16 // n_pad), 32, n_pad, 4


def column_grid(T: int, C: int, blocks: tuple) -> tuple[int, int]:
    """A column pass's grid (blocks: column_blocks(n) or hc_column_blocks(n)): (channel chunks, token groups), about
    COLUMN_PROGRAMS programs where the tokens allow; each group adds its own partial of the weights' gradient."""
    tokens, chunk = blocks[:2]
    chunks = _cdiv(C, chunk)
    return chunks, max(1, min(_cdiv(T, tokens), _cdiv(COLUMN_PROGRAMS, chunks)))


def block_sizes(n: int, C: int) -> tuple[int, int, int]:
    """(tokens per program, C per chunk, padded n): a program holds a (tokens, n, chunk) fp32 tile of about 2,048
    values, 16 per thread at 4 warps, so that the per-token coefficients stay in registers beside it (0 spills at
    n <= 8: docs/benchmarks.md). Chunks of 128+ values keep each warp's loads 16 bytes wide."""
    n_pad = _next_power_of_2(n)
    chunk = min(_next_power_of_2(C), 256 if n_pad <= 4 else 128)
    tokens = max(1, 2048 // (n_pad * chunk))
    return tokens, chunk, n_pad


# ------------------------------------------------------------------------------------------------------------------
# the autograd Functions and what the connections call
#
# Each kernel is launched through its torch.library operator (torch.ops.hcstudy.*, defined by triton_library.py,
# which choice.triton_kernels imports), everything around it is plain torch: dynamo traces these Functions into the
# block's one graph. Under checkpointing train_c4.Block recomputes the sublayer alone: these Functions keep what
# their backwards read (the state itself, no copy, and per-token coefficients), so the connection's kernels run once
# a step.

def _launch_shape(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x (..., n, C) as (T, n, C) (a view wherever the strides allow), T, n, C."""
    xt = x.reshape(-1, *x.shape[-2:])
    return xt, *xt.shape


def u_dtype(x: torch.Tensor) -> torch.dtype:     # the formulas' (stream_update), under autocast too: one policy
    return torch.promote_types(x.dtype, torch.float32)


def mhc_read(conn, x: torch.Tensor):
    """An mHC-family connection's (train_c4.ManifoldHyperConnection and subclasses) read: (u, H_post, H_res, the
    logits Sinkhorn projected or None, x passed through for `write`)."""
    n, mixing = conn.n, MIX_MODES[conn.TRITON_MIX]
    f32 = torch.float32
    with autocast_off(x):
        a_res, b_res = (conn.a_res.to(f32), conn.b_res.to(f32)) if mixing else (None, None)
        perms = conn.permutations.argmax(-1).int() if mixing == 2 else None
        u, h_post, h_res, logits, x = _MHCRead.apply(
            x, conn.phi.weight.to(f32), conn.a_pre.to(f32), conn.a_post.to(f32), a_res, conn.b_pre.to(f32),
            conn.b_post.to(f32), b_res, perms, (n, mixing, conn.iters, conn.eps, u_dtype(x)))
    return u, h_post, h_res, logits, x


def hc_read(conn, x: torch.Tensor):
    """HC's (train_c4.HyperConnection) read, as mhc_read (HC has no logits)."""
    f32 = torch.float32
    with autocast_off(x):
        u, h_post, h_res, x = _HCRead.apply(x, conn.dynamic.weight.to(f32), conn.A_m_static.to(f32),
                                            conn.A_r_static.to(f32), conn.B_static.to(f32), conn.s_a.to(f32),
                                            conn.s_b.to(f32), conn.eps, u_dtype(x))
    return u, h_post, h_res, None, x


def write(x: torch.Tensor, H_res: torch.Tensor, H_post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x_next = H_res x + H_post^T y per token, the state (..., n, C) in its dtype (y in the sublayer's)."""
    with autocast_off(x):
        return _Write.apply(H_res, x, H_post, y)


def _zeros_if_none(grad, shape, like):
    return like.new_zeros(shape, dtype=torch.float32) if grad is None else grad


def _accumulator(grad_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x's fp32 gradient that a read's backward adds into in place before cuBLAS adds the projection's term, the
    write's gradient where that is another tensor): the write's own if fp32 (no copy), else a new fp32 tensor and
    the bf16 gradient read beside it. The mHC family's where cuBLAS projects (_read_columns)."""
    if grad_in.dtype == torch.float32:
        return grad_in, None
    return torch.empty_like(grad_in, dtype=torch.float32), grad_in


class _MHCRead(torch.autograd.Function):
    """(u, H_post, H_res, logits, x) from x (..., n, C): the operator mhc_read_forward, whose kernel projects
    raw = vec(x) phi^T itself (after cuBLAS where the logits are too many: _projects). Kept for the backward: x (the
    input, no copy), the raw logits, 1/rms, the coefficients and, for mhc with SINKHORN_BACKWARD = "stored", the
    Sinkhorn sums: 2n + R + 1 + 2n + n^2 (+ 2n(iters - 1)) floats a token."""

    @staticmethod
    def forward(ctx, x, phi, a_pre, a_post, a_res, b_pre, b_post, b_res, perms, spec):
        n, mixing, iters, eps, u_dtype = spec
        xt, T, _, C = _launch_shape(x)
        # cuBLAS's projection where the kernel cannot hold the logits: a copy of x for an unusual layout or bf16
        given = None if _projects(phi.shape[0]) else xt.reshape(T, n * C).to(phi.dtype) @ phi.t()
        stored = mixing == 1 and SINKHORN_BACKWARD == "stored"
        u, h_pre, h_post, h_res, inv_rms, raw, logits, sums = torch.ops.hcstudy.mhc_read_forward(
            xt, phi.contiguous(), given, a_pre, a_post, a_res, b_pre, b_post, b_res, perms, mixing, iters, eps,
            u_dtype, stored)
        raw = raw if given is None else given            # (T, 2n + R): the kernel's (empty where cuBLAS's came in)
        logits, sums = logits if mixing == 1 else None, sums if stored else None        # empty where the arm has none
        ctx.spec = (n, mixing, iters, stored)
        ctx.save_for_backward(x, phi, raw, inv_rms, a_pre, a_post, a_res, b_pre, b_post, b_res, perms,
                              h_pre, h_post, h_res, sums)
        ctx.mark_non_differentiable(*(t for t in (logits,) if t is not None))
        ctx.set_materialize_grads(False)
        lead = x.shape[:-2]
        return (u.view(*lead, C), h_post.view(*lead, n), h_res.view(*lead, n, n),
                None if logits is None else logits.view(*lead, n, n), x.detach())

    @staticmethod
    def backward(ctx, grad_u, grad_post, grad_res, _grad_logits, grad_x):
        (x, phi, raw, inv_rms, a_pre, a_post, a_res, b_pre, b_post, b_res, perms,
         h_pre, h_post, h_res, sums) = ctx.saved_tensors
        n, mixing, iters, stored = ctx.spec
        xt, T, _, C = _launch_shape(x)
        grad_u = _zeros_if_none(grad_u, (T, C), x).reshape(T, C).contiguous()
        grad_post = _zeros_if_none(grad_post, (T, n), x).reshape(T, n).contiguous()
        grad_res = _zeros_if_none(grad_res, (T, n, n), x).reshape(T, n, n).contiguous()
        grad_in = _zeros_if_none(grad_x, (T, n, C), x).reshape(T, n, C).contiguous()     # the write's dx
        gl, glz, scale = torch.ops.hcstudy.mhc_read_backward(
            xt, raw, inv_rms, a_pre, a_post, a_res, b_pre, b_post, b_res, perms, h_pre, h_post, h_res, sums,
            grad_u, grad_post, grad_res, mixing, iters, stored)
        grad_x, grad_phi = _read_columns(xt, grad_u, grad_in, h_pre, scale, gl, inv_rms, (a_pre, a_post, a_res), phi)
        bias_grad, gate_grad = gl.sum(0), glz.sum(0)             # sums over the tokens: torch's, deterministic
        gates = [gate_grad[0], gate_grad[1], gate_grad[2]]
        biases = [bias_grad[:n], bias_grad[n:2 * n], bias_grad[2 * n:]]
        grads = [_like(g, p) for g, p in zip(gates + biases, (a_pre, a_post, a_res, b_pre, b_post, b_res))]
        return (grad_x.view(x.shape).to(x.dtype), grad_phi, grads[0], grads[1], grads[2], grads[3], grads[4],
                grads[5], None, None)


def _read_columns(xt, grad_u, grad_in, h_pre, scale, gl, inv_rms, gates, phi):
    """(x's gradient, phi's): the operator mhc_read_columns adds the read's terms into the write's dx (grad_in), in
    place in its dtype where the kernel projects (phi's gradient then from its partials over the token groups), else
    into an fp32 accumulator that cuBLAS adds graw phi to (graw = dl gate / rms, the raw logits' gradient), forming
    phi's gradient from an fp32 copy of x. gates: a_pre, a_post, a_res (None for identity-HC)."""
    T, n, C = xt.shape
    K = phi.shape[0]
    a_pre, a_post, a_res = gates
    project = _projects(K)
    grad_x, grad_write = (grad_in, None) if project else _accumulator(grad_in)      # cuBLAS's addmm_ needs fp32
    partials = torch.ops.hcstudy.mhc_read_columns(xt, grad_u, grad_write, grad_x, h_pre, scale, gl, inv_rms, a_pre,
                                                  a_post, a_res, phi.contiguous(), project)
    if project:
        return grad_x, partials[0] if partials.shape[0] == 1 else partials.sum(0)   # torch's sum: the same bits
    gate = torch.cat([a.reshape(1).expand(m) for a, m in ((a_pre, n), (a_post, n), (a_res, K - 2 * n)) if m])
    graw = gl * gate * inv_rms[:, None]
    with autocast_off(xt):       # a backward called under autocast would round these matmuls to bf16
        grad_x.view(T, n * C).addmm_(graw, phi)              # the projection's term, in place (cuBLAS)
        return grad_x, graw.t() @ xt.reshape(T, n * C).to(phi.dtype)


class _HCRead(torch.autograd.Function):
    """(u, H_post, H_res, x) from the state x (..., n, C): the operator hc_read_forward, whose kernel projects
    raw = x_i W^T for every stream itself (tl.dot). Kept for the backward: x (the input, no copy), W, raw
    (n (n + 2) a token), each stream's mean and 1/std and H_pre."""

    @staticmethod
    def forward(ctx, x, W, A_m, A_r, B, s_a, s_b, eps, u_dtype):
        xt, T, n, C = _launch_shape(x)
        w_sum = W.sum(-1)
        u, h_pre, h_post, h_res, mean, rstd, raw = torch.ops.hcstudy.hc_read_forward(
            xt, W.contiguous(), w_sum, A_m, A_r, B, s_a, s_b, eps, u_dtype)
        ctx.save_for_backward(x, W, raw, w_sum, mean, rstd, s_a, s_b, h_pre)
        ctx.set_materialize_grads(False)
        lead = x.shape[:-2]
        return u.view(*lead, C), h_post.view(*lead, n), h_res.view(*lead, n, n), x.detach()

    @staticmethod
    def backward(ctx, grad_u, grad_post, grad_res, grad_x):
        x, W, raw, w_sum, mean, rstd, s_a, s_b, h_pre = ctx.saved_tensors
        xt, T, n, C = _launch_shape(x)
        grad_u = _zeros_if_none(grad_u, (T, C), x).reshape(T, C).contiguous()
        grad_post = _zeros_if_none(grad_post, (T, n), x).reshape(T, n).contiguous()
        grad_res = _zeros_if_none(grad_res, (T, n, n), x).reshape(T, n, n).contiguous()
        grad_x = _zeros_if_none(grad_x, (T, n, C), x).reshape(T, n, C).contiguous()     # the write's dx
        gcoef, gcd, gz, scale, shift = torch.ops.hcstudy.hc_read_backward(xt, raw, w_sum, mean, rstd, s_a, s_b, h_pre,
                                                                          grad_u, grad_post, grad_res)
        partials = torch.ops.hcstudy.hc_read_columns(xt, grad_u, grad_x, h_pre, gz, scale, shift, mean,
                                                     W.contiguous())
        grad_W = partials[0] if partials.shape[0] == 1 else partials.sum(0)      # torch's sum: the same bits
        statics, by_scale = torch.stack([gcoef, gcd]).sum(1)       # (n, n + 2) each
        return (grad_x.view(x.shape), grad_W, statics[:, 0], statics[:, 1:n + 1], statics[:, n + 1],
                _like(by_scale[:, :n + 1].sum(), s_a), _like(by_scale[:, n + 1].sum(), s_b), None, None)


class _Write(torch.autograd.Function):
    """x_next = H_res x + H_post^T y: _write_forward over (token, C) tiles, _write_backward over token blocks.
    Kept for the backward: its inputs, nothing new."""

    @staticmethod
    def forward(ctx, H_res, x, H_post, y):
        _, T, n, C = _launch_shape(x)
        ctx.save_for_backward(H_res, x, H_post, y)
        return torch.ops.hcstudy.write_forward(x, y, H_res.reshape(T, n, n).contiguous(),
                                               H_post.reshape(T, n).contiguous())

    @staticmethod
    def backward(ctx, grad):
        H_res, x, H_post, y = ctx.saved_tensors
        xt, T, n, C = _launch_shape(x)
        # the collapse's gradient: a stride-0 view, read as is
        grad_x, grad_y, grad_res, grad_post = torch.ops.hcstudy.write_backward(
            xt, y.reshape(T, C), H_res.reshape(T, n, n).contiguous(), H_post.reshape(T, n).contiguous(),
            grad.reshape(T, n, C))
        return (grad_res.view(H_res.shape), grad_x.view(x.shape), grad_post.view(H_post.shape),
                grad_y.view(y.shape))


def _projects(K: int) -> bool:
    """Whether the read kernels project the state themselves (tl.dot over a token block), for K = 2n + R logits a
    token: in one tile identity-hc, mhc to n = 10 and mhc-lite to n = 4, in two mhc-lite at n = 5 (130) and mhc to
    n = 15. Not beyond: there the projection's 6 nC K fp32 FLOPs a token outweigh the connection's bytes (mhc-lite at
    n = 6, 732 logits: 0.81 us a token at an H100's 67 TFLOP/s fp32 against 0.24 us for its bytes, arithmetic bound
    fused or not, docs/benchmarks.md), and the column pass's tile of phi's gradient outgrows shared memory: cuBLAS
    matmuls on an fp32 copy of x each way."""
    return K <= PROJECTED_LOGITS


def _logit_pad(K: int) -> int:
    """A tile's width for K logits: a power of two, 16 at least (tl.dot's least)."""
    return max(16, _next_power_of_2(K))


def _logit_tiles(K: int) -> tuple[int, int]:
    """(first, second): the widths of the read kernels' tiles of logits, [0, first) and [first, K) (second 0: one
    tile); (16, 0) where the kernels do not project."""
    if not _projects(K):
        return 16, 0
    if K <= LOGIT_TILE:
        return _logit_pad(K), 0
    return LOGIT_TILE, _logit_pad(K - LOGIT_TILE)


def _chunk(R: int, tokens: int, n_pad: int, split: bool = False) -> int:
    """mHC-lite's permutations per chunk: a power of two, 64 at most and 16 at least, fewer only to keep the
    (tokens, chunk, n) tile of its mix within 2,048 values, or 1,024 beside the read's two tiles of logits (split):
    8 a chunk in the read at n = 5, 146-156 registers, where 16 took 198-200 and 64 spilled (docs/benchmarks.md)."""
    return min(64, max(16, _next_power_of_2(max(R, 1))), (1024 if split else 2048) // (tokens * n_pad))


def _like(grad, param):
    """A gradient in its parameter's shape and dtype: under FSDP a scalar parameter is a (1,) vector."""
    return None if param is None else grad.reshape(param.shape).to(param.dtype)


def self_check(make_connection, device: torch.device, tokens: int = 37, tolerance: float = 1e-4) -> str | None:
    """None when one connection on this path equals the formulas' (make_connection("reference")) on `device`, in the
    output and every gradient, to `tolerance` of each tensor's largest entry (fp32; the GPU sums in another order);
    else what differs. The global RNG is left as it was: the model's init must not depend on the path."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        reference, fast = make_connection("reference").to(device), make_connection("triton").to(device)
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(0.1 * torch.randn_like(p))
        fast.load_state_dict(reference.state_dict())
        x = torch.randn(2, tokens, reference.n, reference.width, device=device)
        weight = torch.randn(reference.width, device=device)
        grad = torch.randn_like(x)
        results = [_step(conn, x, weight, grad) for conn in (reference, fast)]
    for name, ref in results[0].items():
        error = (results[1][name] - ref).abs().max().item()
        scale = ref.abs().max().item()
        if not error <= tolerance * max(scale, 1e-30):
            return f"disagree with the formulas in {name} (largest error {error:.3g} against {scale:.3g})"
    return None


def _step(conn, x, weight, grad):
    x = x.clone().requires_grad_()
    out, _ = conn(x, lambda u: torch.tanh(u.float() * weight))
    out.backward(grad)
    return {"output": out.detach(), "x's gradient": x.grad, **{f"{k}'s gradient": p.grad
                                                              for k, p in conn.named_parameters()}}


# ------------------------------------------------------------------------------------------------------------------
# what each kernel moves: the planner's and the benchmarks' byte counts


def traffic(arm: str, n: int, width: int, activation_bytes: int = 2, iters: int = 20, stream_bytes: int = 4):
    """Device-memory bytes per token one connection's kernels and cuBLAS matmuls move, forward and backward: the state
    n C values of stream_bytes, u and du C fp32, y and dy C of activation_bytes; where cuBLAS projects (mhc-lite at
    n = 6), a bf16 state's copies (x widened each way, dx rounded back) with the matmuls. Re-reads count (a
    read's second pass over x; the mHC family's column pass reads x and du again; HC's read backward reads x and du
    twice and writes dx in fp32), the weights do not, nor phi's partial gradients (a few weights' worth a step)."""
    f, C = 4, width
    state, wide, u, vec = stream_bytes * n * C, f * n * C, f * C, activation_bytes * C
    cast = state + wide if stream_bytes < f else 0
    write = {"_write_forward": 2 * state + vec + f * (n * n + n),
             "_write_backward": 3 * state + 2 * vec + 2 * f * (n * n + n)}
    if arm == "hc":         # raw written and read back; each stream's mean, 1/std, H_pre and the norm's two terms
        coef = f * n * (n + 2)
        return {"_hc_read_forward": 2 * state + 2 * coef + u + f * (4 * n + n * n),
                **write,
                "_hc_read_backward": state + u + coef + f * (6 * n + n * n) + 3 * coef,
                "_hc_read_columns": 3 * state + u + coef + f * 4 * n,
                "sums over the tokens (torch)": 2 * coef}
    K = f * (2 * n + arms.res_logit_count(arm, n))
    mix = arms.connection(arm).TRITON_MIX
    sinkhorn = mix == "sinkhorn"
    stored = f * 2 * n * (iters - 1) * (sinkhorn and SINKHORN_BACKWARD == "stored")    # Sinkhorn's sums
    res = {"sinkhorn": 2 if stored else 1, "permutations": 1}.get(mix, 0) * f * n * n   # the backward's dH_res (and H_res)
    forward = {"_mhc_read_forward": 2 * state + K + u + f * (2 * n + 1 + n * n * (2 if sinkhorn else 1)) + stored}
    backward = {"_mhc_read_backward": state + u + K + f * (3 * n + 1) + res + stored + K + f * 4}  # dl, sums, scale
    sums = {"sums over the tokens (torch)": K + 3 * f}
    if _projects(2 * n + arms.res_logit_count(arm, n)):         # raw written, then read back; dl read by the column pass
        return {**forward, "_mhc_read_forward": forward["_mhc_read_forward"] + K, **write, **backward,
                "_mhc_read_columns": 3 * state + u + f * (n + 2) + K, **sums}
    return {"projection (cuBLAS)": wide + K + cast, **forward, **write, **backward,
            "_mhc_read_columns": 2 * state + wide + u + f * (n + 1), "graw (torch)": 4 * K + f,
            "projection backward (cuBLAS)": 3 * wide + 2 * K + 2 * cast, **sums}


def floor(n: int, width: int, activation_bytes: int = 2, stream_bytes: int = 4):
    """The fewest bytes per token one connection must move: each tensor read or written once on each side of the
    sublayer. Forward: x read, u written (fp32); x and y read, x_next written. Backward: dx_next, x, y read, dx, dy
    written; x and du read, dx read and written. The coefficients (n^2 + 2n a token, under 1%) are left out."""
    state, u, vec = stream_bytes * n * width, 4 * width, activation_bytes * width
    return {"forward": 3 * state + u + vec, "backward": 6 * state + u + 2 * vec}
