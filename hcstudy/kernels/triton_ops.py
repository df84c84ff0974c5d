"""The residual streams on the GPU: Triton kernels for every arm with per-token coefficients (hc, mhc, mhc-lite,
identity-hc), chosen by --kernels triton (or auto on CUDA, train_c4.kernel_path), proven equal to train_c4.py's
formulas in the interpreter (tests/kernels/test_triton_ops.py), compiled for sm_90 by benchmarks/triton_compile.py.

One connection, per direction (the maths: docs/model.md, "The Triton path"):
  forward   the coefficients' projection (one cuBLAS matmul)
            -> coefficients and read (one kernel: RMS or per-stream norm, gates, Sinkhorn / permutation mix, u)
            -> the sublayer -> write (one kernel: x_next = H_res x + H_post y)
  backward  the write's backward (one kernel) -> the sublayer
            -> the read's and the coefficients' backward (one kernel, adding into x's gradient: in place in fp32)
            -> the projection's backward (two cuBLAS matmuls, one accumulating into x's gradient in place)
where the formulas run hundreds of small kernels (mHC's Sinkhorn alone 40 half-steps each way). Each kernel's launch
is a torch.library operator (triton_library.py: its schema, its fake implementation, the launch), which the autograd
Functions below call: torch.compile traces a block of this path as one graph (the operators opaque, the matmuls and
sums around them compiled), with and without activation checkpointing, which recomputes the sublayer and leaves
the connection's kernels to run once (train_c4.Block).

The state x is (tokens, n, C) in fp32 or bf16 (--stream-dtype: loaded into fp32, rounded once where stored) with
any strides; the coefficients are fp32, tokens-first and contiguous: H_pre, H_post (tokens, n), H_res (tokens, n, n)
with H_res[t, i, j] the weight of stream j in stream i; u is fp32 as on the formulas' path. Every reduction over the
tokens (the weights' gradients) is a cuBLAS matmul or a torch sum and every program owns its tokens: no atomics, so
two runs with the same seed give the same bits.

Triton is imported at the first launch (load): the planner runs this path on the CPU with each kernel replaced by
its byte count (traffic, plan.counting), also where setup.sh without --dev installed no triton. Without CUDA the
kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before the import): slow, for tests and demos only.
"""
from __future__ import annotations

import math
import os
import sys

import torch

from hcstudy.kernels.fused import autocast_off  # the coefficients in fp32 whatever the autocast, as on the fused path

triton = tl = None                    # the modules, once load has imported them
_SOURCES = {}                         # every kernel and helper as written, by name: load compiles them


def _jit(fn):
    """triton.jit, deferred to load: the module-level name holds a stand-in until then."""
    _SOURCES[fn.__name__] = fn
    return _Unloaded(fn.__name__)


class _Unloaded:
    """A kernel before triton is imported: its first launch (kernel[grid](...)) loads every kernel."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):
        load()
        return globals()[self.name][grid]


def load() -> None:
    """Import triton (its interpreter where there is no CUDA) and put each kernel's triton.jit in place of its
    stand-in; a second call does nothing. Raises ImportError where triton is not installed (fused.triton_problem
    turns that into the formulas' path and a warning)."""
    global triton, tl
    if triton is not None:
        return
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:     # "0": compile only, for sm_90
        # the interpreter is chosen when a function is decorated, triton.language's own included: a triton imported
        # before (torch._dynamo imports it) is imported again, so that its functions run in the interpreter too
        os.environ["TRITON_INTERPRET"] = "1"
        for name in [name for name in sys.modules if name == "triton" or name.startswith("triton.") and not
                     name.startswith("triton._C")]:         # the compiled extension stays: it cannot be loaded twice
            del sys.modules[name]
    import triton as module  # ships with CUDA builds of torch; CPU: setup.sh --dev
    import triton.language as language
    tl = language
    globals().update({name: module.jit(fn) for name, fn in _SOURCES.items()})
    triton = module                                     # last: a load that failed above is tried again


def _next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for n >= 1, without triton: block sizes are chosen before any kernel is loaded."""
    return 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


MIXING = {"identity-hc": 0, "mhc": 1, "mhc-lite": 2}    # how an mHC-family kernel makes H_res (constexpr MIX)
# "stored": the forward keeps Sinkhorn's 2(iters - 1) sum vectors per token and the backward walks them back;
# "recompute": nothing kept, each pair's input recomputed from the first exp (docs/benchmarks.md has both timed)
SINKHORN_BACKWARD = "stored"


def block_sizes(n: int, C: int) -> tuple[int, int, int]:
    """(tokens per program, C per chunk, padded n): a program holds a (tokens, n, chunk) fp32 tile of about 2,048
    values, 16 per thread at 4 warps, so that the per-token coefficients stay in registers beside it (0 spills at
    n <= 8: docs/benchmarks.md). Chunks of 128+ values keep each warp's loads 16 bytes wide."""
    n_pad = _next_power_of_2(n)
    chunk = min(_next_power_of_2(C), 256 if n_pad <= 4 else 128)
    tokens = max(1, 2048 // (n_pad * chunk))
    return tokens, chunk, n_pad


# ------------------------------------------------------------------------------------------------------------------
# shared pieces


@_jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@_jit
def _tanh(x):
    # written out (libdevice is not in the interpreter); exp(2x) = inf gives 1 exactly, 0 gives -1
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@_jit
def _stream_tile(ptr, t, s, c, st, ss, sc, mask):
    """Load the (tokens, streams, chunk) tile of a (T, n, C) tensor with strides (st, ss, sc), as fp32."""
    offsets = t[:, None, None] * st + s[None, :, None] * ss + c[None, None, :] * sc
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@_jit
def _tile_mask(t, s, c, T, N, C):
    return (t < T)[:, None, None] & (s < N)[None, :, None] & (c < C)[None, None, :]


@_jit
def _log_normalise(L, valid, axis: tl.constexpr):
    """L minus its logsumexp along `axis` over the valid entries; padding stays at -1e30 (exp gives 0)."""
    L = tl.where(valid, L, -1e30)
    top = tl.max(L, axis=axis, keep_dims=True)
    lse = top + tl.log(tl.sum(tl.exp(L - top), axis=axis, keep_dims=True))
    return tl.where(valid, L - lse, -1e30)


@_jit
def _sums(P, axis: tl.constexpr, valid_line):
    """P's sums along `axis`, 1 on padded lines so that dividing by them leaves the zeros of the padding."""
    return tl.where(valid_line, tl.sum(P, axis=axis, keep_dims=True), 1.0)


# ------------------------------------------------------------------------------------------------------------------
# mHC's family (mhc, mhc-lite, identity-hc): coefficients from the flattened state, then the read


@_jit
def _sinkhorn_forward(L, valid, valid_row, valid_col, sums_ptr, t, s, tmask, iters, N: tl.constexpr,
                      STORE: tl.constexpr):
    """train_c4.sinkhorn on (tokens, n, n) logits held in registers: a log-domain column-then-row pair, then
    iters - 1 linear pairs; with STORE the pairs' column and row sums go to sums (T, iters - 1, 2, n)."""
    P = tl.exp(_log_normalise(_log_normalise(L, valid, 1), valid, 2))
    P = tl.where(valid, P, 0.0)
    store_mask = tmask[:, None] & (s < N)[None, :]
    for k in range(iters - 1):
        col = _sums(P, 1, valid_col)
        P = P / col
        row = _sums(P, 2, valid_row)
        P = P / row
        if STORE:
            base = sums_ptr + t[:, None] * ((iters - 1) * 2 * N) + k * 2 * N + s[None, :]
            tl.store(base, tl.sum(col, axis=1), mask=store_mask)
            tl.store(base + N, tl.sum(row, axis=2), mask=store_mask)
    return P


@_jit
def _sinkhorn_backward(grad, L, H, valid, valid_row, valid_col, sums_ptr, t, s, tmask, iters, N: tl.constexpr,
                       STORED: tl.constexpr):
    """The logits' gradient from H_res's. Through Q = P / sums(P): dP = (dQ - sums(dQ * Q)) / sums(P) along the
    same axis. STORED: walk the pairs back from H with the forward's sums, recovering each earlier P as Q * sums
    (O(iters)); else recompute each pair's input from the first exp (O(iters^2) half-steps, all in registers)."""
    E = tl.where(valid, tl.exp(_log_normalise(_log_normalise(L, valid, 1), valid, 2)), 0.0)
    if STORED:
        Q = H
        load_mask = tmask[:, None] & (s < N)[None, :]
        for back in range(iters - 1):
            base = sums_ptr + t[:, None] * ((iters - 1) * 2 * N) + (iters - 2 - back) * 2 * N + s[None, :]
            row = tl.where(valid_row, tl.load(base + N, mask=load_mask, other=1.0)[:, :, None], 1.0)
            grad = (grad - tl.sum(grad * Q, axis=2, keep_dims=True)) / row
            Q = Q * row
            col = tl.where(valid_col, tl.load(base, mask=load_mask, other=1.0)[:, None, :], 1.0)
            grad = (grad - tl.sum(grad * Q, axis=1, keep_dims=True)) / col
            Q = Q * col
    else:
        for back in range(iters - 1):
            A = E
            for k in range(iters - 2 - back):
                A = A / _sums(A, 1, valid_col)
                A = A / _sums(A, 2, valid_row)
            col = _sums(A, 1, valid_col)
            B = A / col
            row = _sums(B, 2, valid_row)
            grad = (grad - tl.sum(grad * (B / row), axis=2, keep_dims=True)) / row
            grad = (grad - tl.sum(grad * B, axis=1, keep_dims=True)) / col
    # exp, then the two log-domain normalisations: softmax's backward along each axis
    grad = grad * E
    grad = grad - E * tl.sum(grad, axis=2, keep_dims=True)
    first = tl.where(valid, tl.exp(_log_normalise(L, valid, 1)), 0.0)
    return tl.where(valid, grad - first * tl.sum(grad, axis=1, keep_dims=True), 0.0)


@_jit
def _lite_softmax_stats(raw_ptr, t, tmask, K, inv_rms, a_res, b_res_ptr, R: tl.constexpr, N: tl.constexpr,
                        BR: tl.constexpr):
    """Running max and denominator of mHC-lite's softmax over the n! permutation logits, in chunks of BR."""
    top = tl.full((t.shape[0],), -1e30, tl.float32)
    total = tl.zeros((t.shape[0],), tl.float32)
    for k0 in range(0, R, BR):
        logit = _lite_logits(raw_ptr, t, tmask, K, k0, inv_rms, a_res, b_res_ptr, R, N, BR)
        new_top = tl.maximum(top, tl.max(logit, axis=1))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(logit - new_top[:, None]), axis=1)
        top = new_top
    return top, total


@_jit
def _lite_logits(raw_ptr, t, tmask, K, k0, inv_rms, a_res, b_res_ptr, R: tl.constexpr, N: tl.constexpr,
                 BR: tl.constexpr):
    k = k0 + tl.arange(0, BR)
    mask = tmask[:, None] & (k < R)[None, :]
    z = tl.load(raw_ptr + t[:, None] * K + 2 * N + k[None, :], mask=mask, other=0.0) * inv_rms[:, None]
    logit = a_res * z + tl.load(b_res_ptr + k, mask=k < R, other=0.0)[None, :]
    return tl.where(mask, logit, -1e30)


@_jit
def _lite_onehot(perm_ptr, k0, i: tl.constexpr, s, R: tl.constexpr, N: tl.constexpr, BR: tl.constexpr):
    """(BR, n_pad): row k is 1 at the stream that row i of permutation k0 + k takes."""
    k = k0 + tl.arange(0, BR)
    target = tl.load(perm_ptr + k * N + i, mask=k < R, other=-1)
    return (target[:, None] == s[None, :]).to(tl.float32)


@_jit
def _lite_mixing(raw_ptr, perm_ptr, b_res_ptr, a_res, inv_rms, t, tmask, s, K, R: tl.constexpr, N: tl.constexpr,
                 NP: tl.constexpr, BR: tl.constexpr):
    """H_res = sum_k w_k P_k, w = softmax(a_res z_res + b_res) over the n! permutations, chunk by chunk."""
    top, total = _lite_softmax_stats(raw_ptr, t, tmask, K, inv_rms, a_res, b_res_ptr, R, N, BR)
    H = tl.zeros((t.shape[0], NP, NP), tl.float32)
    for k0 in range(0, R, BR):
        w = tl.exp(_lite_logits(raw_ptr, t, tmask, K, k0, inv_rms, a_res, b_res_ptr, R, N, BR) - top[:, None])
        w = w / total[:, None]
        for i in tl.static_range(N):
            row = tl.sum(w[:, :, None] * _lite_onehot(perm_ptr, k0, i, s, R, N, BR)[None, :, :], axis=1)
            H = tl.where((s == i)[None, :, None], H + row[:, None, :], H)
    return H


@_jit
def _lite_backward(grad_res, raw_ptr, perm_ptr, b_res_ptr, a_res, inv_rms, t, tmask, s, K, gl_ptr, glz_ptr, graw_ptr,
                   R: tl.constexpr, N: tl.constexpr, BR: tl.constexpr):
    """mHC-lite's logits' gradient, written per token: dl = w (dw - sum(w dw)), dw_k = sum_i dH[i, perm_k(i)].
    Returns the logits' share of sum(dz z), for the RMS term."""
    top, total = _lite_softmax_stats(raw_ptr, t, tmask, K, inv_rms, a_res, b_res_ptr, R, N, BR)
    mean_dw = tl.zeros((t.shape[0],), tl.float32)
    for k0 in range(0, R, BR):
        w = tl.exp(_lite_logits(raw_ptr, t, tmask, K, k0, inv_rms, a_res, b_res_ptr, R, N, BR) - top[:, None])
        mean_dw += tl.sum(w / total[:, None] * _lite_weight_grad(grad_res, perm_ptr, k0, s, R, N, BR), axis=1)
    zdot = tl.zeros((t.shape[0],), tl.float32)
    for k0 in range(0, R, BR):
        k = k0 + tl.arange(0, BR)
        mask = tmask[:, None] & (k < R)[None, :]
        w = tl.exp(_lite_logits(raw_ptr, t, tmask, K, k0, inv_rms, a_res, b_res_ptr, R, N, BR) - top[:, None])
        gl = w / total[:, None] * (_lite_weight_grad(grad_res, perm_ptr, k0, s, R, N, BR) - mean_dw[:, None])
        z = tl.load(raw_ptr + t[:, None] * K + 2 * N + k[None, :], mask=mask, other=0.0) * inv_rms[:, None]
        zdot += tl.sum(gl * a_res * z, axis=1)
        _store_logit_grads(gl, z, a_res, inv_rms[:, None], t[:, None] * K + 2 * N + k[None, :], mask,
                           gl_ptr, glz_ptr, graw_ptr)
    return zdot


@_jit
def _lite_weight_grad(grad_res, perm_ptr, k0, s, R: tl.constexpr, N: tl.constexpr, BR: tl.constexpr):
    dw = tl.zeros((grad_res.shape[0], BR), tl.float32)
    for i in tl.static_range(N):
        row = tl.sum(tl.where((s == i)[None, :, None], grad_res, 0.0), axis=1)          # dH[:, i, :]
        dw += tl.sum(row[:, None, :] * _lite_onehot(perm_ptr, k0, i, s, R, N, BR)[None, :, :], axis=2)
    return dw


@_jit
def _store_logit_grads(gl, z, gate, inv_rms, offsets, mask, gl_ptr, glz_ptr, graw_ptr):
    """Per token and logit: the gradient of the biases (gl), of the gates (gl z) and of the raw projection
    (gl gate / rms; inv_rms comes broadcastable to gl); their sums over the tokens are torch's, so no program adds
    into another's."""
    tl.store(gl_ptr + offsets, gl, mask=mask)
    tl.store(glz_ptr + offsets, gl * z, mask=mask)
    tl.store(graw_ptr + offsets, gl * gate * inv_rms, mask=mask)


@_jit
def _mhc_read_forward(x_ptr, sxt, sxn, sxc, raw_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, b_pre_ptr, b_post_ptr,
                      b_res_ptr, perm_ptr, u_ptr, h_pre_ptr, h_post_ptr, h_res_ptr, logits_ptr, sums_ptr, inv_rms_ptr,
                      T, C, eps, iters, N: tl.constexpr, NP: tl.constexpr, MIX: tl.constexpr, R: tl.constexpr,
                      STORE_SUMS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr):
    """mHC's coefficients and read for BT tokens. Reads x twice (the RMS, then u = H_pre x: the second pass mostly
    from L2), the projection's raw logits (2n + R per token) once; writes u (fp32), H_pre, H_post,
    H_res, 1/rms and, for mhc, the logits and the Sinkhorn sums. Everything per token stays in registers between."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)      # offsets past 2^31 values
    s = tl.arange(0, NP)
    tmask, smask = t < T, s < N
    squares = tl.zeros((BT,), tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        x = _stream_tile(x_ptr, t, s, c, sxt, sxn, sxc, _tile_mask(t, s, c, T, N, C))
        squares += tl.sum(tl.sum(x * x, axis=2), axis=1)
    inv_rms = 1.0 / tl.sqrt(squares / (N * C) + eps)
    tl.store(inv_rms_ptr + t, inv_rms, mask=tmask)
    K = 2 * N + R
    m2 = tmask[:, None] & smask[None, :]
    z_pre = tl.load(raw_ptr + t[:, None] * K + s[None, :], mask=m2, other=0.0) * inv_rms[:, None]
    z_post = tl.load(raw_ptr + t[:, None] * K + N + s[None, :], mask=m2, other=0.0) * inv_rms[:, None]
    h_pre = _sigmoid(tl.load(a_pre_ptr).to(tl.float32) * z_pre + tl.load(b_pre_ptr + s, mask=smask, other=0.0))
    h_pre = tl.where(m2, h_pre, 0.0)
    b_post = tl.load(b_post_ptr + s, mask=smask, other=0.0)
    h_post = 2.0 * _sigmoid(tl.load(a_post_ptr).to(tl.float32) * z_post + b_post)
    tl.store(h_pre_ptr + t[:, None] * N + s[None, :], h_pre, mask=m2)
    tl.store(h_post_ptr + t[:, None] * N + s[None, :], h_post, mask=m2)
    i3, j3 = s[None, :, None], s[None, None, :]
    valid = (i3 < N) & (j3 < N)
    m3 = tmask[:, None, None] & valid
    if MIX == 0:
        H = tl.where(m3 & (i3 == j3), 1.0, 0.0)
    elif MIX == 1:
        a_res = tl.load(a_res_ptr).to(tl.float32)
        z_res = tl.load(raw_ptr + t[:, None, None] * K + 2 * N + i3 * N + j3, mask=m3, other=0.0)
        L = a_res * z_res * inv_rms[:, None, None] + tl.load(b_res_ptr + i3 * N + j3, mask=valid, other=0.0)
        tl.store(logits_ptr + t[:, None, None] * N * N + i3 * N + j3, L, mask=m3)
        H = _sinkhorn_forward(L, valid, i3 < N, j3 < N, sums_ptr, t, s, tmask, iters, N, STORE_SUMS)
    else:
        H = _lite_mixing(raw_ptr, perm_ptr, b_res_ptr, tl.load(a_res_ptr).to(tl.float32), inv_rms, t, tmask, s, K,
                         R, N, NP, BR)
    tl.store(h_res_ptr + t[:, None, None] * N * N + i3 * N + j3, H, mask=m3)
    _read(x_ptr, sxt, sxn, sxc, h_pre, u_ptr, t, s, T, N, C, BC)


@_jit
def _read(x_ptr, sxt, sxn, sxc, h_pre, u_ptr, t, s, T, N: tl.constexpr, C, BC: tl.constexpr):
    """u = sum_j H_pre[j] x[j] over C in chunks, stored in u's dtype (fp32, as the formulas')."""
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        x = _stream_tile(x_ptr, t, s, c, sxt, sxn, sxc, _tile_mask(t, s, c, T, N, C))
        u = tl.sum(h_pre[:, :, None] * x, axis=1)
        tl.store(u_ptr + t[:, None] * C + c[None, :], u.to(u_ptr.dtype.element_ty),
                 mask=(t < T)[:, None] & (c < C)[None, :])


@_jit
def _read_grad(x_ptr, sxt, sxn, sxc, gu_ptr, t, s, T, N: tl.constexpr, C, BC: tl.constexpr, NP: tl.constexpr):
    """dH_pre[j] = sum_c du[c] x[j, c] for BT tokens: one pass over x and du."""
    grad = tl.zeros((t.shape[0], NP), tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        x = _stream_tile(x_ptr, t, s, c, sxt, sxn, sxc, _tile_mask(t, s, c, T, N, C))
        gu = tl.load(gu_ptr + t[:, None] * C + c[None, :], mask=(t < T)[:, None] & (c < C)[None, :],
                     other=0.0).to(tl.float32)
        grad += tl.sum(x * gu[:, None, :], axis=2)
    return grad


@_jit
def _add_read_grad(x_ptr, sxt, sxn, sxc, gu_ptr, gx_ptr, gxo_ptr, h_pre, scale, shift, t, s, T, N: tl.constexpr,
                   C, BC: tl.constexpr):
    """dx[j] = gx[j] + H_pre[j] du + scale[j] x[j] + shift[j] into the contiguous (T, n, C) fp32 gxo: the write's
    gradient gx (the state's dtype; gxo itself if fp32), the read's term, the norm's (mHC's RMS, HC's per stream)."""
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        mask = _tile_mask(t, s, c, T, N, C)
        x = _stream_tile(x_ptr, t, s, c, sxt, sxn, sxc, mask)
        gu = tl.load(gu_ptr + t[:, None] * C + c[None, :], mask=(t < T)[:, None] & (c < C)[None, :],
                     other=0.0).to(tl.float32)
        offsets = t[:, None, None] * (N * C) + s[None, :, None] * C + c[None, None, :]
        gx = tl.load(gx_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        gx += h_pre[:, :, None] * gu[:, None, :] + scale[:, :, None] * x + shift[:, :, None]
        tl.store(gxo_ptr + offsets, gx, mask=mask)


@_jit
def _mhc_read_backward(x_ptr, sxt, sxn, sxc, raw_ptr, inv_rms_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, b_pre_ptr,
                       b_post_ptr, b_res_ptr, perm_ptr, h_pre_ptr, h_post_ptr, h_res_ptr, logits_ptr, sums_ptr,
                       gu_ptr, g_post_ptr, g_res_ptr, gx_ptr, gxo_ptr, gl_ptr, glz_ptr, graw_ptr,
                       T, C, iters, N: tl.constexpr, NP: tl.constexpr, MIX: tl.constexpr, R: tl.constexpr,
                       STORED: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr):
    """The read's and the coefficients' backward for BT tokens. Pass 1 over x and du: dH_pre. Then per token in
    registers: the gates' and Sinkhorn's (or the permutation mix's) backward to the logits' gradients, written per
    token (T, 2n + R), and the RMS's term. Pass 2 adds H_pre du + (RMS term) x into x's gradient in place. Nothing
    of size n x C per token is stored by the forward for this: x is re-read, the coefficients recomputed from the
    raw logits (2n + R per token) where that is cheaper than keeping them."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)      # offsets past 2^31 values
    s = tl.arange(0, NP)
    tmask, smask = t < T, s < N
    m2 = tmask[:, None] & smask[None, :]
    K = 2 * N + R
    g_pre = _read_grad(x_ptr, sxt, sxn, sxc, gu_ptr, t, s, T, N, C, BC, NP)
    inv_rms = tl.load(inv_rms_ptr + t, mask=tmask, other=1.0)
    h_pre = tl.load(h_pre_ptr + t[:, None] * N + s[None, :], mask=m2, other=0.0)
    h_post = tl.load(h_post_ptr + t[:, None] * N + s[None, :], mask=m2, other=0.0)
    g_post = tl.load(g_post_ptr + t[:, None] * N + s[None, :], mask=m2, other=0.0)
    a_pre = tl.load(a_pre_ptr).to(tl.float32)
    a_post = tl.load(a_post_ptr).to(tl.float32)
    offsets = t[:, None] * K + s[None, :]
    z_pre = tl.load(raw_ptr + offsets, mask=m2, other=0.0) * inv_rms[:, None]
    z_post = tl.load(raw_ptr + offsets + N, mask=m2, other=0.0) * inv_rms[:, None]
    gl_pre = g_pre * h_pre * (1.0 - h_pre)
    gl_post = g_post * h_post * (1.0 - 0.5 * h_post)
    _store_logit_grads(gl_pre, z_pre, a_pre, inv_rms[:, None], offsets, m2, gl_ptr, glz_ptr, graw_ptr)
    _store_logit_grads(gl_post, z_post, a_post, inv_rms[:, None], offsets + N, m2, gl_ptr, glz_ptr, graw_ptr)
    zdot = tl.sum(gl_pre * a_pre * z_pre + gl_post * a_post * z_post, axis=1)
    i3, j3 = s[None, :, None], s[None, None, :]
    valid = (i3 < N) & (j3 < N)
    m3 = tmask[:, None, None] & valid
    if MIX == 1:
        a_res = tl.load(a_res_ptr).to(tl.float32)
        g_res = tl.load(g_res_ptr + t[:, None, None] * N * N + i3 * N + j3, mask=m3, other=0.0)
        L = tl.load(logits_ptr + t[:, None, None] * N * N + i3 * N + j3, mask=m3, other=0.0)
        H = tl.load(h_res_ptr + t[:, None, None] * N * N + i3 * N + j3, mask=m3, other=0.0)
        gl_res = _sinkhorn_backward(g_res, L, H, valid, i3 < N, j3 < N, sums_ptr, t, s, tmask, iters, N, STORED)
        z_res = tl.load(raw_ptr + t[:, None, None] * K + 2 * N + i3 * N + j3, mask=m3, other=0.0)
        z_res = z_res * inv_rms[:, None, None]
        _store_logit_grads(gl_res, z_res, a_res, inv_rms[:, None, None], t[:, None, None] * K + 2 * N + i3 * N + j3, m3,
                           gl_ptr, glz_ptr, graw_ptr)
        zdot += tl.sum(tl.sum(gl_res * a_res * z_res, axis=2), axis=1)
    elif MIX == 2:
        g_res = tl.load(g_res_ptr + t[:, None, None] * N * N + i3 * N + j3, mask=m3, other=0.0)
        zdot += _lite_backward(g_res, raw_ptr, perm_ptr, b_res_ptr, tl.load(a_res_ptr).to(tl.float32), inv_rms, t,
                               tmask, s, K, gl_ptr, glz_ptr, graw_ptr, R, N, BR)
    # z = raw / rms: d(1/rms)/dx = -x / (nC rms^3), so x's gradient gains -(sum dz z) / (nC rms^2) x
    scale = tl.where(m2, (-zdot * inv_rms * inv_rms / (N * C))[:, None] + tl.zeros((BT, NP), tl.float32), 0.0)
    _add_read_grad(x_ptr, sxt, sxn, sxc, gu_ptr, gx_ptr, gxo_ptr, h_pre, scale, tl.zeros((BT, NP), tl.float32), t,
                   s, T, N, C, BC)


# ------------------------------------------------------------------------------------------------------------------
# HC: coefficients from each stream's own norm, then the read


@_jit
def _hc_coefficient_tile(raw_ptr, w_sum_ptr, mean, rstd, t, s, k, T, N: tl.constexpr):
    """z = rstd (x W^T - mean W 1) for the (tokens, n, n + 2) coefficients: the norm folded into the projection."""
    KH = N + 2
    mask = (t < T)[:, None, None] & (s < N)[None, :, None] & (k < KH)[None, None, :]
    raw = tl.load(raw_ptr + t[:, None, None] * (N * KH) + s[None, :, None] * KH + k[None, None, :], mask=mask,
                  other=0.0)
    w_sum = tl.load(w_sum_ptr + k, mask=k < KH, other=0.0)
    return rstd[:, :, None] * (raw - mean[:, :, None] * w_sum[None, None, :]), mask


@_jit
def _hc_stats(x_ptr, sxt, sxn, sxc, t, s, T, N: tl.constexpr, C, eps, BC: tl.constexpr, NP: tl.constexpr):
    """Each stream's mean and 1/std over C (layer_norm without affine), one pass: sum and sum of squares."""
    total = tl.zeros((t.shape[0], NP), tl.float32)
    squares = tl.zeros((t.shape[0], NP), tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        x = _stream_tile(x_ptr, t, s, c, sxt, sxn, sxc, _tile_mask(t, s, c, T, N, C))
        total += tl.sum(x, axis=2)
        squares += tl.sum(x * x, axis=2)
    mean = total / C
    return mean, 1.0 / tl.sqrt(tl.maximum(squares / C - mean * mean, 0.0) + eps)


@_jit
def _hc_read_forward(x_ptr, sxt, sxn, sxc, raw_ptr, w_sum_ptr, a_m_ptr, a_r_ptr, b_ptr, s_a_ptr, s_b_ptr,
                     u_ptr, h_pre_ptr, h_post_ptr, h_res_ptr, mean_ptr, rstd_ptr, T, C, eps,
                     N: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """HC's coefficients and read for BT tokens: per stream mean and 1/std (pass 1 over x), coefficient
    c[i, k] = scale_k tanh(z[i, k]) + static[k, i] in registers (k = 0: H_pre, 1..n: column i of H_res, n+1:
    H_post), u = sum_i H_pre[i] x[i] (pass 2). Writes u, the coefficients and each stream's mean and 1/std."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)      # offsets past 2^31 values
    s = tl.arange(0, NP)
    k = tl.arange(0, KP)
    tmask, smask = t < T, s < N
    m2 = tmask[:, None] & smask[None, :]
    mean, rstd = _hc_stats(x_ptr, sxt, sxn, sxc, t, s, T, N, C, eps, BC, NP)
    tl.store(mean_ptr + t[:, None] * N + s[None, :], mean, mask=m2)
    tl.store(rstd_ptr + t[:, None] * N + s[None, :], rstd, mask=m2)
    z, mask = _hc_coefficient_tile(raw_ptr, w_sum_ptr, mean, rstd, t, s, k, T, N)
    coef = _hc_scale(s_a_ptr, s_b_ptr, k, N) * _tanh(z) + _hc_statics(a_m_ptr, a_r_ptr, b_ptr, s, k, N)
    s3, k3, t3 = s[None, :, None], k[None, None, :], t[:, None, None]
    tl.store(h_pre_ptr + t3 * N + s3 + 0 * k3, coef, mask=mask & (k3 == 0))
    tl.store(h_res_ptr + t3 * N * N + (k3 - 1) * N + s3, coef, mask=mask & (k3 >= 1) & (k3 <= N))
    tl.store(h_post_ptr + t3 * N + s3 + 0 * k3, coef, mask=mask & (k3 == N + 1))
    h_pre = tl.where(m2, tl.sum(tl.where(k3 == 0, coef, 0.0), axis=2), 0.0)
    _read(x_ptr, sxt, sxn, sxc, h_pre, u_ptr, t, s, T, N, C, BC)


@_jit
def _hc_scale(s_a_ptr, s_b_ptr, k, N: tl.constexpr):
    return tl.where(k == N + 1, tl.load(s_b_ptr).to(tl.float32), tl.load(s_a_ptr).to(tl.float32))[None, None, :]


@_jit
def _hc_statics(a_m_ptr, a_r_ptr, b_ptr, s, k, N: tl.constexpr):
    """static[k, i]: A_m[i] (k = 0), A_r[i, k - 1] (1..n), B[i] (n + 1), as a (1, n_pad, k_pad) tile."""
    s3, k3 = s[None, :, None], k[None, None, :]
    valid = s3 < N
    a_m = tl.load(a_m_ptr + s3 + 0 * k3, mask=valid & (k3 == 0), other=0.0)
    a_r = tl.load(a_r_ptr + s3 * N + k3 - 1, mask=valid & (k3 >= 1) & (k3 <= N), other=0.0)
    b = tl.load(b_ptr + s3 + 0 * k3, mask=valid & (k3 == N + 1), other=0.0)
    return a_m + a_r + b


@_jit
def _hc_read_backward(x_ptr, sxt, sxn, sxc, raw_ptr, w_sum_ptr, mean_ptr, rstd_ptr, s_a_ptr, s_b_ptr, h_pre_ptr,
                      gu_ptr, g_post_ptr, g_res_ptr, gx_ptr, gxo_ptr, gcoef_ptr, gcd_ptr, gz_ptr, T, C,
                      N: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """HC's read and coefficients backward for BT tokens. Pass 1: dH_pre. In registers: dc (the coefficients'
    gradient), written with dc tanh(z) for the statics' and scales' sums, and g = dc scale (1 - tanh^2) rstd for
    the projection's matmuls; the norm's per-stream terms a (x's multiple) and b (a constant). Pass 2: dx +=
    H_pre du + a x + b in place (the g W term is the caller's cuBLAS matmul)."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)      # offsets past 2^31 values
    s = tl.arange(0, NP)
    k = tl.arange(0, KP)
    tmask, smask = t < T, s < N
    m2 = tmask[:, None] & smask[None, :]
    g_pre = _read_grad(x_ptr, sxt, sxn, sxc, gu_ptr, t, s, T, N, C, BC, NP)
    mean = tl.load(mean_ptr + t[:, None] * N + s[None, :], mask=m2, other=0.0)
    rstd = tl.load(rstd_ptr + t[:, None] * N + s[None, :], mask=m2, other=0.0)
    z, mask = _hc_coefficient_tile(raw_ptr, w_sum_ptr, mean, rstd, t, s, k, T, N)
    d = _tanh(z)
    s3, k3, t3 = s[None, :, None], k[None, None, :], t[:, None, None]
    g_post = tl.load(g_post_ptr + t[:, None] * N + s[None, :], mask=m2, other=0.0)
    g_res = tl.load(g_res_ptr + t3 * N * N + (k3 - 1) * N + s3, mask=mask & (k3 >= 1) & (k3 <= N), other=0.0)
    dc = tl.where(k3 == 0, g_pre[:, :, None], tl.where(k3 == N + 1, g_post[:, :, None], g_res))
    dc = tl.where(mask, dc, 0.0)
    KH = N + 2
    offsets = t3 * (N * KH) + s3 * KH + k3
    tl.store(gcoef_ptr + offsets, dc, mask=mask)
    tl.store(gcd_ptr + offsets, dc * d, mask=mask)
    g = dc * _hc_scale(s_a_ptr, s_b_ptr, k, N) * (1.0 - d * d) * rstd[:, :, None]
    tl.store(gz_ptr + offsets, g, mask=mask)
    # layer_norm's backward with the projection folded in: dx = g (W - W's row means) + a (x - mean)
    a = -tl.sum(g * z, axis=2) * rstd / C
    w_mean = tl.load(w_sum_ptr + k, mask=k < KH, other=0.0)[None, None, :] / C
    shift = tl.where(m2, -a * mean - tl.sum(g * w_mean, axis=2), 0.0)
    h_pre = tl.load(h_pre_ptr + t[:, None] * N + s[None, :], mask=m2, other=0.0)
    _add_read_grad(x_ptr, sxt, sxn, sxc, gu_ptr, gx_ptr, gxo_ptr, h_pre, tl.where(m2, a, 0.0), shift, t, s, T, N, C,
                   BC)


# ------------------------------------------------------------------------------------------------------------------
# the write, every arm


@_jit
def _stored(value, ptr):
    """fp32 `value` in ptr's dtype, bf16 rounded to nearest-even by its bits (the interpreter's cast truncates)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return value.to(ptr.dtype.element_ty)


@_jit
def _write_forward(x_ptr, sxt, sxn, sxc, y_ptr, syt, syc, h_res_ptr, h_post_ptr, out_ptr, T, C,
                   N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """x_next[i] = sum_j H_res[i, j] x[j] + H_post[i] y on a (BT tokens, BC) chunk: reads x (n values) and y (one)
    once, sums in fp32, writes n in the state's dtype; the n x n coefficients come from L2 for every chunk."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)      # offsets past 2^31 values
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    s = tl.arange(0, NP)
    tmask, cmask = t < T, c < C
    m2 = tmask[:, None] & (s < N)[None, :]
    y = tl.load(y_ptr + t[:, None] * syt + c[None, :] * syc, mask=tmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    h_post = tl.load(h_post_ptr + t[:, None] * N + s[None, :], mask=m2, other=0.0)
    out = h_post[:, :, None] * y[:, None, :]
    for j in tl.static_range(N):
        x = tl.load(x_ptr + t[:, None] * sxt + j * sxn + c[None, :] * sxc, mask=tmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        h = tl.load(h_res_ptr + t[:, None] * N * N + s[None, :] * N + j, mask=m2, other=0.0)     # column j
        out += h[:, :, None] * x[:, None, :]
    mask = _tile_mask(t, s, c, T, N, C)
    tl.store(out_ptr + t[:, None, None] * (N * C) + s[None, :, None] * C + c[None, None, :],
             _stored(out, out_ptr), mask=mask)             # rounded once to the state's dtype


@_jit
def _write_backward(x_ptr, sxt, sxn, sxc, y_ptr, syt, syc, h_res_ptr, h_post_ptr, g_ptr, sgt, sgn, sgc,
                    gx_ptr, gy_ptr, g_res_ptr, g_post_ptr, T, C,
                    N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """The write's backward for BT tokens over all of C: dx[j] = sum_i H_res[i, j] dout[i] (the state's dtype),
    dy = sum_i H_post[i] dout[i] (y's dtype), and the per-token sums dH_res[i, j] = dout[i] . x[j],
    dH_post[i] = dout[i] . y accumulated in registers. Reads dout (n values, any strides: the collapse's gradient
    arrives as one stride-0 view), x (n) and y (one) once; writes n + 1."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)      # offsets past 2^31 values
    s = tl.arange(0, NP)
    tmask = t < T
    m2 = tmask[:, None] & (s < N)[None, :]
    h_post = tl.load(h_post_ptr + t[:, None] * N + s[None, :], mask=m2, other=0.0)
    g_res = tl.zeros((BT, NP, NP), tl.float32)
    g_post = tl.zeros((BT, NP), tl.float32)
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        m2c = tmask[:, None] & (c < C)[None, :]
        g = _stream_tile(g_ptr, t, s, c, sgt, sgn, sgc, _tile_mask(t, s, c, T, N, C))
        y = tl.load(y_ptr + t[:, None] * syt + c[None, :] * syc, mask=m2c, other=0.0).to(tl.float32)
        tl.store(gy_ptr + t[:, None] * C + c[None, :], tl.sum(h_post[:, :, None] * g, axis=1).to(
            gy_ptr.dtype.element_ty), mask=m2c)
        g_post += tl.sum(g * y[:, None, :], axis=2)
        for j in tl.static_range(N):
            x = tl.load(x_ptr + t[:, None] * sxt + j * sxn + c[None, :] * sxc, mask=m2c, other=0.0).to(tl.float32)
            h = tl.load(h_res_ptr + t[:, None] * N * N + s[None, :] * N + j, mask=m2, other=0.0)   # column j
            tl.store(gx_ptr + t[:, None] * (N * C) + j * C + c[None, :],
                     _stored(tl.sum(h[:, :, None] * g, axis=1), gx_ptr), mask=m2c)
            column = tl.sum(g * x[:, None, :], axis=2)                                    # dH_res[:, j]
            g_res = tl.where((s == j)[None, None, :], g_res + column[:, :, None], g_res)
    i3, j3 = s[None, :, None], s[None, None, :]
    tl.store(g_res_ptr + t[:, None, None] * N * N + i3 * N + j3, g_res,
             mask=tmask[:, None, None] & (i3 < N) & (j3 < N))
    tl.store(g_post_ptr + t[:, None] * N + s[None, :], g_post, mask=m2)


# ------------------------------------------------------------------------------------------------------------------
# the autograd Functions and what the connections call
#
# Each kernel is launched through its torch.library operator (torch.ops.hcstudy.*, defined by triton_library.py,
# which choice.triton_kernels imports), everything around it is plain torch: dynamo traces these Functions into the
# block's one graph. Under checkpointing
# train_c4.Block recomputes the sublayer alone: these Functions keep what their backwards read (the state itself,
# no copy, and per-token coefficients), so the connection's kernels run once a step.

def _launch_shape(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x (..., n, C) as (T, n, C) (a view wherever the strides allow), T, n, C."""
    xt = x.reshape(-1, *x.shape[-2:])
    return xt, *xt.shape


def u_dtype(x: torch.Tensor) -> torch.dtype:     # the formulas' (stream_update), under autocast too: one policy
    return torch.promote_types(x.dtype, torch.float32)


def mhc_read(conn, x: torch.Tensor):
    """An mHC-family connection's (train_c4.ManifoldHyperConnection and subclasses) read: (u, H_post, H_res, the
    logits Sinkhorn projected or None, x passed through for `write`)."""
    n, mixing = conn.n, MIXING[conn.arm]
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
    """(x's fp32 gradient that the read's backward adds into in place, the write's gradient where that is another
    tensor): the write's own if fp32 (no copy), else a new fp32 tensor and the bf16 gradient read beside it."""
    if grad_in.dtype == torch.float32:
        return grad_in, None
    return torch.empty_like(grad_in, dtype=torch.float32), grad_in


class _MHCRead(torch.autograd.Function):
    """(u, H_post, H_res, logits, x) from x (..., n, C): raw = vec(x) phi^T (cuBLAS), then _mhc_read_forward. Kept
    for the backward: x (the input, no copy), the raw logits, 1/rms, the coefficients and, for mhc, the logits and
    (SINKHORN_BACKWARD = "stored") the Sinkhorn sums: 2n + R + 1 + 2n + n^2 (+ n^2 + 2n(iters - 1)) floats a token."""

    @staticmethod
    def forward(ctx, x, phi, a_pre, a_post, a_res, b_pre, b_post, b_res, perms, spec):
        n, mixing, iters, eps, u_dtype = spec
        xt, T, _, C = _launch_shape(x)
        raw = xt.reshape(T, n * C).to(phi.dtype) @ phi.t()  # (T, 2n + R); a copy for an unusual layout or bf16
        stored = mixing == 1 and SINKHORN_BACKWARD == "stored"
        u, h_pre, h_post, h_res, inv_rms, logits, sums = torch.ops.hcstudy.mhc_read_forward(
            xt, raw, a_pre, a_post, a_res, b_pre, b_post, b_res, perms, mixing, iters, eps, u_dtype, stored)
        logits, sums = logits if mixing == 1 else None, sums if stored else None        # empty where the arm has none
        ctx.spec = (n, mixing, iters, stored)
        ctx.save_for_backward(x, phi, raw, inv_rms, a_pre, a_post, a_res, b_pre, b_post, b_res, perms,
                              h_pre, h_post, h_res, logits, sums)
        ctx.mark_non_differentiable(*(t for t in (logits,) if t is not None))
        ctx.set_materialize_grads(False)
        lead = x.shape[:-2]
        return (u.view(*lead, C), h_post.view(*lead, n), h_res.view(*lead, n, n),
                None if logits is None else logits.view(*lead, n, n), x.detach())

    @staticmethod
    def backward(ctx, grad_u, grad_post, grad_res, _grad_logits, grad_x):
        (x, phi, raw, inv_rms, a_pre, a_post, a_res, b_pre, b_post, b_res, perms,
         h_pre, h_post, h_res, logits, sums) = ctx.saved_tensors
        n, mixing, iters, stored = ctx.spec
        xt, T, _, C = _launch_shape(x)
        grad_u = _zeros_if_none(grad_u, (T, C), x).reshape(T, C).contiguous()
        grad_post = _zeros_if_none(grad_post, (T, n), x).reshape(T, n).contiguous()
        grad_res = _zeros_if_none(grad_res, (T, n, n), x).reshape(T, n, n).contiguous()
        # the write's gradient of x (nothing else holds it); the read's backward adds its own into it in fp32
        grad_x, grad_write = _accumulator(_zeros_if_none(grad_x, (T, n, C), x).reshape(T, n, C).contiguous())
        gl, glz, graw = torch.ops.hcstudy.mhc_read_backward(
            xt, raw, inv_rms, a_pre, a_post, a_res, b_pre, b_post, b_res, perms, h_pre, h_post, h_res, logits, sums,
            grad_u, grad_post, grad_res, grad_write, grad_x, mixing, iters, stored)
        with autocast_off(x):       # a backward called under autocast would round these matmuls to bf16
            grad_x.view(T, n * C).addmm_(graw, phi)              # the projection's term, in place (cuBLAS)
            grad_phi = graw.t() @ xt.reshape(T, n * C).to(phi.dtype)
        bias_grad, gate_grad = torch.stack([gl, glz]).sum(1)     # sums over the tokens: torch's, deterministic
        gates = [gate_grad[:n].sum(), gate_grad[n:2 * n].sum(), gate_grad[2 * n:].sum()]
        biases = [bias_grad[:n], bias_grad[n:2 * n], bias_grad[2 * n:]]
        grads = [_like(g, p) for g, p in zip(gates + biases, (a_pre, a_post, a_res, b_pre, b_post, b_res))]
        return (grad_x.view(x.shape).to(x.dtype), grad_phi, grads[0], grads[1], grads[2], grads[3], grads[4],
                grads[5], None, None)


class _HCRead(torch.autograd.Function):
    """(u, H_post, H_res, x) from the state x (..., n, C): raw = x_i W^T for every stream (cuBLAS), then
    _hc_read_forward. Kept for the backward: x, raw (n (n + 2) per token), each stream's mean and 1/std and H_pre."""

    @staticmethod
    def forward(ctx, x, W, A_m, A_r, B, s_a, s_b, eps, u_dtype):
        xt, T, n, C = _launch_shape(x)
        raw = xt.reshape(T * n, C).to(W.dtype) @ W.t()        # (T n, n + 2)
        w_sum = W.sum(-1)
        u, h_pre, h_post, h_res, mean, rstd = torch.ops.hcstudy.hc_read_forward(xt, raw, w_sum, A_m, A_r, B, s_a,
                                                                                s_b, eps, u_dtype)
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
        grad_x, grad_write = _accumulator(_zeros_if_none(grad_x, (T, n, C), x).reshape(T, n, C).contiguous())
        gcoef, gcd, gz = torch.ops.hcstudy.hc_read_backward(xt, raw, w_sum, mean, rstd, s_a, s_b, h_pre, grad_u,
                                                            grad_post, grad_res, grad_write, grad_x)
        g = gz.view(T * n, n + 2)
        with autocast_off(x):       # as in _MHCRead's backward
            grad_x.view(T * n, C).addmm_(g, W)                   # dx's g W term, in place (cuBLAS)
            grad_W = (g.t() @ xt.reshape(T * n, C).to(W.dtype)).sub_((g.t() @ mean.view(-1)).unsqueeze(-1))
        statics, by_scale = torch.stack([gcoef, gcd]).sum(1)       # (n, n + 2) each
        return (grad_x.view(x.shape).to(x.dtype), grad_W, statics[:, 0], statics[:, 1:n + 1], statics[:, n + 1],
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


def _chunk(R: int) -> int:
    """mHC-lite's permutations per chunk: 16 at least (a power of two), 64 at most (the (tokens, chunk, n) tile)."""
    return min(64, max(16, _next_power_of_2(max(R, 1))))


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


def res_logit_count(arm: str, n: int) -> int:
    return {"mhc": n * n, "mhc-lite": math.factorial(n), "identity-hc": 0}.get(arm, 0)


def traffic(arm: str, n: int, width: int, activation_bytes: int = 2, iters: int = 20, stream_bytes: int = 4):
    """Device-memory bytes per token one connection's kernels and cuBLAS matmuls move, forward and backward: the state
    n C values of stream_bytes, u and du C fp32, y and dy C of activation_bytes; a bf16 state's copies (x widened for
    cuBLAS each way, dx rounded back) with the matmuls. Re-reads count (a read's second pass: x and du; its dx is
    read in the state's dtype, written in fp32), the weights do not."""
    f, C = 4, width
    state, wide, u, vec = stream_bytes * n * C, f * n * C, f * C, activation_bytes * C
    cast, read_backward = state + wide if stream_bytes < f else 0, 3 * state + wide + 2 * u
    write = {"_write_forward": 2 * state + vec + f * (n * n + n),
             "_write_backward": 3 * state + 2 * vec + 2 * f * (n * n + n)}
    if arm == "hc":
        coef = f * n * (n + 2)
        return {"projection (cuBLAS)": wide + coef + cast,
                "_hc_read_forward": 2 * state + coef + u + f * (4 * n + n * n),
                **write,
                "_hc_read_backward": read_backward + coef + f * (4 * n + n * n) + 3 * coef,
                "projection backward (cuBLAS)": 3 * wide + 2 * coef + 2 * cast,
                "sums over the tokens (torch)": 2 * coef}
    K = f * (2 * n + res_logit_count(arm, n))
    sinkhorn = f * (n * n + 2 * n * (iters - 1) * (SINKHORN_BACKWARD == "stored")) if arm == "mhc" else 0
    return {"projection (cuBLAS)": wide + K + cast,
            "_mhc_read_forward": 2 * state + K + u + f * (2 * n + n * n + 1) + sinkhorn,
            **write,
            "_mhc_read_backward": read_backward + K + f * (3 * n + 2 * n * n + 1) + sinkhorn + 3 * K,
            "projection backward (cuBLAS)": 3 * wide + 2 * K + 2 * cast,
            "sums over the tokens (torch)": 2 * K}


def floor(n: int, width: int, activation_bytes: int = 2, stream_bytes: int = 4):
    """The fewest bytes per token one connection must move: each tensor read or written once on each side of the
    sublayer. Forward: x read, u written (fp32); x and y read, x_next written. Backward: dx_next, x, y read, dx, dy
    written; x and du read, dx read and written. The coefficients (n^2 + 2n a token, under 1%) are left out."""
    state, u, vec = stream_bytes * n * width, 4 * width, activation_bytes * width
    return {"forward": 3 * state + u + vec, "backward": 6 * state + u + 2 * vec}
