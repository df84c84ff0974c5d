"""The Triton kernels of the residual streams, as written: triton_ops.py launches them (its autograd Functions) and
counts their bytes; the maths is docs/model.md's "The Triton path". Every program owns a block of tokens (or, for the
read's column pass, a chunk of channels over a range of tokens), so no program adds into another's output.

Triton is imported at the first launch (load): until then each kernel's module-level name holds a stand-in, so that
the planner can run the launch layer on the CPU with each kernel replaced by its byte count (step_work.counting),
also where setup.sh without --dev installed no triton. Without CUDA the kernels run in Triton's interpreter
(TRITON_INTERPRET=1, set before the import): slow, for tests and demos only.
"""
from __future__ import annotations

import os
import sys

import torch

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
def _lite_backward(grad_res, raw_ptr, perm_ptr, b_res_ptr, a_res, inv_rms, t, tmask, s, K, gl_ptr,
                   R: tl.constexpr, N: tl.constexpr, BR: tl.constexpr):
    """mHC-lite's logits' gradient, written per token: dl = w (dw - sum(w dw)), dw_k = sum_i dH[i, perm_k(i)].
    Returns sum(dl z) over them, for a_res's gradient and the RMS term."""
    top, total = _lite_softmax_stats(raw_ptr, t, tmask, K, inv_rms, a_res, b_res_ptr, R, N, BR)
    mean_dw = tl.zeros((t.shape[0],), tl.float32)
    for k0 in range(0, R, BR):
        w = tl.exp(_lite_logits(raw_ptr, t, tmask, K, k0, inv_rms, a_res, b_res_ptr, R, N, BR) - top[:, None])
        mean_dw += tl.sum(w / total[:, None] * _lite_weight_grad(grad_res, perm_ptr, k0, s, R, N, BR), axis=1)
    glz = tl.zeros((t.shape[0],), tl.float32)
    for k0 in range(0, R, BR):
        k = k0 + tl.arange(0, BR)
        mask = tmask[:, None] & (k < R)[None, :]
        w = tl.exp(_lite_logits(raw_ptr, t, tmask, K, k0, inv_rms, a_res, b_res_ptr, R, N, BR) - top[:, None])
        gl = w / total[:, None] * (_lite_weight_grad(grad_res, perm_ptr, k0, s, R, N, BR) - mean_dw[:, None])
        z = tl.load(raw_ptr + t[:, None] * K + 2 * N + k[None, :], mask=mask, other=0.0) * inv_rms[:, None]
        glz += tl.sum(gl * z, axis=1)
        tl.store(gl_ptr + t[:, None] * K + 2 * N + k[None, :], gl, mask=mask)
    return glz


@_jit
def _lite_weight_grad(grad_res, perm_ptr, k0, s, R: tl.constexpr, N: tl.constexpr, BR: tl.constexpr):
    dw = tl.zeros((grad_res.shape[0], BR), tl.float32)
    for i in tl.static_range(N):
        row = tl.sum(tl.where((s == i)[None, :, None], grad_res, 0.0), axis=1)          # dH[:, i, :]
        dw += tl.sum(row[:, None, :] * _lite_onehot(perm_ptr, k0, i, s, R, N, BR)[None, :, :], axis=2)
    return dw


@_jit
def _mhc_read_forward(x_ptr, sxt, sxn, sxc, phi_ptr, raw_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, b_pre_ptr,
                      b_post_ptr, b_res_ptr, perm_ptr, u_ptr, h_pre_ptr, h_post_ptr, h_res_ptr, logits_ptr, sums_ptr,
                      inv_rms_ptr, T, C, eps, iters, N: tl.constexpr, NP: tl.constexpr, MIX: tl.constexpr,
                      R: tl.constexpr, STORE_SUMS: tl.constexpr, PROJECT: tl.constexpr, KP: tl.constexpr,
                      KT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr):
    """mHC's coefficients and read for BT tokens. Pass 1 over x: sum(x^2) and, with PROJECT, the projection's raw
    logits raw = vec(x) phi^T (2n + R per token, written for the backward; else cuBLAS wrote them). Then per token in
    registers the coefficients: writes H_pre, H_post, H_res, 1/rms and, for mhc, the logits and the Sinkhorn sums.
    Pass 2 over x (mostly from L2): u = H_pre x, written in fp32."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)      # offsets past 2^31 values
    s = tl.arange(0, NP)
    tmask, smask = t < T, s < N
    if PROJECT:
        squares = _project(x_ptr, sxt, sxn, sxc, phi_ptr, raw_ptr, t, T, N, C, 2 * N + R, BC, KP, KT)
    else:
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
        _, L = _res_logits(raw_ptr, a_res_ptr, b_res_ptr, inv_rms, t, i3, j3, valid, m3, K, N)
        tl.store(logits_ptr + t[:, None, None] * N * N + i3 * N + j3, L, mask=m3)
        H = _sinkhorn_forward(L, valid, i3 < N, j3 < N, sums_ptr, t, s, tmask, iters, N, STORE_SUMS)
    else:
        H = _lite_mixing(raw_ptr, perm_ptr, b_res_ptr, tl.load(a_res_ptr).to(tl.float32), inv_rms, t, tmask, s, K,
                         R, N, NP, BR)
    tl.store(h_res_ptr + t[:, None, None] * N * N + i3 * N + j3, H, mask=m3)
    _read(x_ptr, sxt, sxn, sxc, h_pre, u_ptr, t, s, T, N, C, BC)


@_jit
def _res_logits(raw_ptr, a_res_ptr, b_res_ptr, inv_rms, t, i3, j3, valid, m3, K, N: tl.constexpr):
    """(H_res's raw logits, its logits a_res raw / rms + b_res): the forward's, recomputed alike by the backward."""
    raw = tl.load(raw_ptr + t[:, None, None] * K + 2 * N + i3 * N + j3, mask=m3, other=0.0)
    logits = tl.load(a_res_ptr).to(tl.float32) * raw * inv_rms[:, None, None]
    return raw, logits + tl.load(b_res_ptr + i3 * N + j3, mask=valid, other=0.0)


@_jit
def _project(x_ptr, sxt, sxn, sxc, phi_ptr, raw_ptr, t, T, N: tl.constexpr, C, K, BC: tl.constexpr,
             KP: tl.constexpr, KT: tl.constexpr):
    """raw = vec(x) phi^T for the block's tokens (tl.dot in fp32: each (chunk, K) tile of phi serves every token of
    the block, from L2), stored to raw (T, K), where the coefficients read it and the backward finds it. The logits
    [0, KP) in one accumulator and, with KT, [KP, K) in a second of KT: mhc-lite's 130 at n 5 in 128 + 16 columns
    rather than 256, fewer registers (docs/benchmarks.md). Returns sum(x^2) per token, from the same loads."""
    head = tl.arange(0, KP)
    raw = tl.zeros((t.shape[0], KP), tl.float32)
    if KT:
        tail = KP + tl.arange(0, KT)
        raw_tail = tl.zeros((t.shape[0], KT), tl.float32)
    squares = tl.zeros((t.shape[0],), tl.float32)
    for j in tl.static_range(N):
        for c0 in range(0, C, BC):
            c = c0 + tl.arange(0, BC)
            x = tl.load(x_ptr + t[:, None] * sxt + j * sxn + c[None, :] * sxc,
                        mask=(t < T)[:, None] & (c < C)[None, :], other=0.0).to(tl.float32)
            raw = _project_tile(x, phi_ptr, raw, head, K, j, c, N, C)
            if KT:
                raw_tail = _project_tile(x, phi_ptr, raw_tail, tail, K, j, c, N, C)
            squares += tl.sum(x * x, axis=1)
    tl.store(raw_ptr + t[:, None] * K + head[None, :], raw, mask=(t < T)[:, None] & (head < K)[None, :])
    if KT:
        tl.store(raw_ptr + t[:, None] * K + tail[None, :], raw_tail, mask=(t < T)[:, None] & (tail < K)[None, :])
    tl.debug_barrier()      # every thread's logits stored before any thread loads another's (CUDA: bar.sync)
    return squares


@_jit
def _project_tile(x, phi_ptr, raw, k, K, j, c, N: tl.constexpr, C):
    """raw + x phi^T on stream j's channels c, for the logits k (those under K): one (chunk, len(k)) tile of phi^T."""
    phi_t = tl.load(phi_ptr + k[None, :] * (N * C) + j * C + c[:, None], mask=(k < K)[None, :] & (c < C)[:, None],
                    other=0.0)
    return tl.dot(x, phi_t, raw, input_precision="ieee")


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
def _mhc_read_backward(x_ptr, sxt, sxn, sxc, raw_ptr, inv_rms_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, b_pre_ptr,
                       b_post_ptr, b_res_ptr, perm_ptr, h_pre_ptr, h_post_ptr, h_res_ptr, sums_ptr,
                       gu_ptr, g_post_ptr, g_res_ptr, gl_ptr, glz_ptr, scale_ptr,
                       T, C, iters, N: tl.constexpr, NP: tl.constexpr, MIX: tl.constexpr, R: tl.constexpr,
                       STORED: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr):
    """The coefficients' backward for BT tokens. One pass over x and du: dH_pre. Then per token in registers: the
    gates' and Sinkhorn's (or the permutation mix's) backward to the logits' gradients dl, written per token
    (T, 2n + R), sum(dl z) for each gate (T, 3), and the RMS's multiple of x in x's gradient (T); _mhc_read_columns
    adds them into x's gradient. Nothing of size n x C per token is stored by the forward for this: x is re-read,
    the logits recomputed from the raw ones (2n + R per token) where that is cheaper than keeping them."""
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
    tl.store(gl_ptr + offsets, gl_pre, mask=m2)
    tl.store(gl_ptr + offsets + N, gl_post, mask=m2)
    glz_pre, glz_post = tl.sum(gl_pre * z_pre, axis=1), tl.sum(gl_post * z_post, axis=1)
    glz_res = tl.zeros((BT,), tl.float32)
    i3, j3 = s[None, :, None], s[None, None, :]
    valid = (i3 < N) & (j3 < N)
    m3 = tmask[:, None, None] & valid
    if MIX == 1:
        g_res = tl.load(g_res_ptr + t[:, None, None] * N * N + i3 * N + j3, mask=m3, other=0.0)
        raw_res, L = _res_logits(raw_ptr, a_res_ptr, b_res_ptr, inv_rms, t, i3, j3, valid, m3, K, N)
        H = tl.load(h_res_ptr + t[:, None, None] * N * N + i3 * N + j3, mask=m3, other=0.0)
        gl_res = _sinkhorn_backward(g_res, L, H, valid, i3 < N, j3 < N, sums_ptr, t, s, tmask, iters, N, STORED)
        tl.store(gl_ptr + t[:, None, None] * K + 2 * N + i3 * N + j3, gl_res, mask=m3)
        glz_res = tl.sum(tl.sum(gl_res * raw_res, axis=2), axis=1) * inv_rms
    elif MIX == 2:
        g_res = tl.load(g_res_ptr + t[:, None, None] * N * N + i3 * N + j3, mask=m3, other=0.0)
        glz_res = _lite_backward(g_res, raw_ptr, perm_ptr, b_res_ptr, tl.load(a_res_ptr).to(tl.float32), inv_rms, t,
                                 tmask, s, K, gl_ptr, R, N, BR)
    tl.store(glz_ptr + t * 3, glz_pre, mask=tmask)               # each gate's sum(dl z): its gradient's share
    tl.store(glz_ptr + t * 3 + 1, glz_post, mask=tmask)
    tl.store(glz_ptr + t * 3 + 2, glz_res, mask=tmask)
    zdot = a_pre * glz_pre + a_post * glz_post                  # sum(dz z), dz = gate dl
    if MIX != 0:
        zdot += tl.load(a_res_ptr).to(tl.float32) * glz_res
    # z = raw / rms: d(1/rms)/dx = -x / (nC rms^3), so x's gradient gains -(sum dz z) / (nC rms^2) x
    tl.store(scale_ptr + t, -zdot * inv_rms * inv_rms / (N * C), mask=tmask)


@_jit
def _mhc_read_columns(x_ptr, sxt, sxn, sxc, gu_ptr, gx_ptr, gxo_ptr, h_pre_ptr, scale_ptr, gl_ptr, inv_rms_ptr,
                      a_pre_ptr, a_post_ptr, a_res_ptr, phi_ptr, gphi_ptr, T, C, K, N: tl.constexpr,
                      NP: tl.constexpr, PROJECT: tl.constexpr, KP: tl.constexpr, KT: tl.constexpr, BT: tl.constexpr,
                      BC: tl.constexpr):
    """The read's share of x's gradient on BC channels of every stream, over the token blocks g, g + G, ... (g the
    second program id): dx[j] = gx[j] + H_pre[j] du + scale x[j] (+ graw phi[:, j C + c] with PROJECT, where
    graw = dl gate / rms is the raw logits' gradient), stored to gxo (gx itself in place, or an fp32 buffer for
    cuBLAS). One pass over x, du and gx. With PROJECT also phi's gradient graw^T x over those tokens, one partial
    per g: owning its columns, no program adds into another's. The logits as _project splits them: [0, KP) and,
    with KT, [KP, K) in a second tile (mhc-lite's 130 at n 5: 144 rows of phi's gradient held, not 256)."""
    q = tl.arange(0, NP * BC)                   # the tile's columns: stream q // BC, channel c
    j = q // BC
    c = tl.program_id(0) * BC + q % BC
    qmask = (j < N) & (c < C)
    column = j * C + c                          # in vec(x) and phi's rows
    head = tl.arange(0, KP)
    gate = _logit_gates(head, a_pre_ptr, a_post_ptr, a_res_ptr, N)
    gphi = tl.zeros((KP, NP * BC), tl.float32)
    if KT:
        tail = KP + tl.arange(0, KT)
        gate_tail = _logit_gates(tail, a_pre_ptr, a_post_ptr, a_res_ptr, N)
        gphi_tail = tl.zeros((KT, NP * BC), tl.float32)
    for block in range(tl.program_id(1), tl.cdiv(T, BT), tl.num_programs(1)):
        t = (block * BT + tl.arange(0, BT)).to(tl.int64)           # offsets past 2^31 values
        tmask = t < T
        mask = tmask[:, None] & qmask[None, :]
        x = tl.load(x_ptr + t[:, None] * sxt + j[None, :] * sxn + c[None, :] * sxc, mask=mask,
                    other=0.0).to(tl.float32)
        gu = tl.load(gu_ptr + t[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)     # one load a token
        h_pre = tl.load(h_pre_ptr + t[:, None] * N + j[None, :], mask=mask, other=0.0)
        scale = tl.load(scale_ptr + t, mask=tmask, other=0.0)
        offsets = t[:, None] * (N * C) + column[None, :]
        gx = tl.load(gx_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + h_pre * gu + scale[:, None] * x
        if PROJECT:
            gx, gphi = _project_grad(gl_ptr, inv_rms_ptr, phi_ptr, gate, x, gx, gphi, t, tmask, head, K, column,
                                     qmask, N, C)
            if KT:
                gx, gphi_tail = _project_grad(gl_ptr, inv_rms_ptr, phi_ptr, gate_tail, x, gx, gphi_tail, t, tmask,
                                              tail, K, column, qmask, N, C)
        tl.store(gxo_ptr + offsets, _stored(gx, gxo_ptr), mask=mask)
    if PROJECT:
        _store_phi_grad(gphi_ptr, gphi, head, K, column, qmask, N, C)
        if KT:
            _store_phi_grad(gphi_ptr, gphi_tail, tail, K, column, qmask, N, C)


@_jit
def _logit_gates(k, a_pre_ptr, a_post_ptr, a_res_ptr, N: tl.constexpr):
    """Each logit k's gate: a_pre for H_pre's n, a_post for H_post's, a_res for H_res's."""
    return tl.where(k < N, tl.load(a_pre_ptr), tl.where(k < 2 * N, tl.load(a_post_ptr), tl.load(a_res_ptr)))


@_jit
def _project_grad(gl_ptr, inv_rms_ptr, phi_ptr, gate, x, gx, gphi, t, tmask, k, K, column, qmask, N: tl.constexpr,
                  C):
    """(gx + graw phi, gphi + graw^T x) on the tile's columns, for the logits k (those under K):
    graw = dl gate / rms, the raw logits' gradient; phi's (len(k), columns) tile from L2."""
    kmask = k < K
    gl = tl.load(gl_ptr + t[:, None] * K + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
    graw = gl * gate.to(tl.float32)[None, :] * tl.load(inv_rms_ptr + t, mask=tmask, other=0.0)[:, None]
    phi = tl.load(phi_ptr + k[:, None] * (N * C) + column[None, :], mask=kmask[:, None] & qmask[None, :],
                  other=0.0)
    return (tl.dot(graw, phi, gx, input_precision="ieee"),
            tl.dot(tl.trans(graw), x, gphi, input_precision="ieee"))


@_jit
def _store_phi_grad(gphi_ptr, gphi, k, K, column, qmask, N: tl.constexpr, C):
    """This program's partial of phi's gradient, the logits k's rows on its columns, in its group's slice."""
    tl.store(gphi_ptr + tl.program_id(1) * K * N * C + k[:, None] * (N * C) + column[None, :], gphi,
             mask=(k < K)[:, None] & qmask[None, :])


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
def _hc_project(x_ptr, sxt, sxn, sxc, w_ptr, raw_ptr, mean_ptr, rstd_ptr, t, T, N: tl.constexpr, C, eps,
                BC: tl.constexpr, KP: tl.constexpr):
    """raw = x_j W^T for each stream j of the block's tokens (tl.dot in fp32: each (chunk, n + 2) tile of W^T, one
    for every stream, from L2), and each stream's mean and 1/std over C (layer_norm without affine) from the same
    loads, stored to raw (T, n, n + 2), mean and rstd (T, n), where the coefficients read them back and the
    backward finds them."""
    k = tl.arange(0, KP)
    KH = N + 2
    tmask = t < T
    for j in tl.static_range(N):
        raw = tl.zeros((t.shape[0], KP), tl.float32)
        total = tl.zeros((t.shape[0],), tl.float32)
        squares = tl.zeros((t.shape[0],), tl.float32)
        for c0 in range(0, C, BC):
            c = c0 + tl.arange(0, BC)
            x = tl.load(x_ptr + t[:, None] * sxt + j * sxn + c[None, :] * sxc,
                        mask=tmask[:, None] & (c < C)[None, :], other=0.0).to(tl.float32)
            w_t = tl.load(w_ptr + k[None, :] * C + c[:, None], mask=(k < KH)[None, :] & (c < C)[:, None],
                          other=0.0)                                                    # (chunk, KP) of W^T
            raw = tl.dot(x, w_t, raw, input_precision="ieee")
            total += tl.sum(x, axis=1)
            squares += tl.sum(x * x, axis=1)
        tl.store(raw_ptr + t[:, None] * (N * KH) + j * KH + k[None, :], raw, mask=tmask[:, None] & (k < KH)[None, :])
        mean = total / C
        tl.store(mean_ptr + t * N + j, mean, mask=tmask)
        tl.store(rstd_ptr + t * N + j, 1.0 / tl.sqrt(tl.maximum(squares / C - mean * mean, 0.0) + eps), mask=tmask)
    tl.debug_barrier()      # every thread's stores done before any thread loads another's (CUDA: bar.sync)


@_jit
def _hc_read_forward(x_ptr, sxt, sxn, sxc, w_ptr, w_sum_ptr, a_m_ptr, a_r_ptr, b_ptr, s_a_ptr, s_b_ptr,
                     u_ptr, h_pre_ptr, h_post_ptr, h_res_ptr, mean_ptr, rstd_ptr, raw_ptr, T, C, eps,
                     N: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """HC's coefficients and read for BT tokens. Pass 1 over x (_hc_project): the projection x_j W^T and each
    stream's mean and 1/std. Then in registers the coefficients c[i, k] = scale_k tanh(z[i, k]) + static[k, i]
    (k = 0: H_pre, 1..n: column i of H_res, n+1: H_post), written with the raw projection (n (n + 2) a token) for
    the backward. Pass 2 over x (mostly from L2): u = sum_i H_pre[i] x[i], written in fp32."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)      # offsets past 2^31 values
    s = tl.arange(0, NP)
    k = tl.arange(0, KP)
    tmask, smask = t < T, s < N
    m2 = tmask[:, None] & smask[None, :]
    _hc_project(x_ptr, sxt, sxn, sxc, w_ptr, raw_ptr, mean_ptr, rstd_ptr, t, T, N, C, eps, BC, KP)
    mean = tl.load(mean_ptr + t[:, None] * N + s[None, :], mask=m2, other=0.0)
    rstd = tl.load(rstd_ptr + t[:, None] * N + s[None, :], mask=m2, other=0.0)
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
                      gu_ptr, g_post_ptr, g_res_ptr, gcoef_ptr, gcd_ptr, gz_ptr, scale_ptr, shift_ptr, T, C,
                      N: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """HC's coefficients' backward for BT tokens. One pass over x and du: dH_pre. Then in registers: dc (the
    coefficients' gradient), written with dc tanh(z) for the statics' and scales' sums, g = dc scale (1 - tanh^2)
    rstd (the projection's gradient, for _hc_read_columns' two tl.dots) and the norm's per-stream terms in x's
    gradient, a multiple of x and a constant (T, n each). Nothing of size n x C a token is stored for this: x is
    re-read, z recomputed from the raw projection (n (n + 2) a token)."""
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
    tl.store(scale_ptr + t[:, None] * N + s[None, :], a, mask=m2)
    tl.store(shift_ptr + t[:, None] * N + s[None, :], -a * mean - tl.sum(g * w_mean, axis=2), mask=m2)


@_jit
def _hc_read_columns(x_ptr, sxt, sxn, sxc, gu_ptr, gx_ptr, h_pre_ptr, gz_ptr, scale_ptr, shift_ptr, mean_ptr,
                     w_ptr, gw_ptr, T, C, N: tl.constexpr, NP: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                     BC: tl.constexpr):
    """The read's share of x's gradient on BC channels, over the token blocks g, g + G, ... (g the second program
    id), a tile's rows the (token, stream) pairs: dx[j] = gx[j] + H_pre[j] du + a[j] x[j] + shift[j] + g[j] W (the
    projection's term by tl.dot), added into gx in place in the state's dtype (rounded once where stored). W's
    chunk (n + 2, BC) stays in registers for all the program's tokens, as does its share of W's gradient,
    sum over (token, stream) of g (x - mean) (tl.dot), one partial per g: owning its columns, no program adds into
    another's. One pass over x, du and gx."""
    r = tl.arange(0, BT * NP)                   # the tile's rows: token r // NP of the block, stream j
    j = r % NP
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    cmask = c < C
    k = tl.arange(0, KP)
    KH = N + 2
    wmask = (k < KH)[:, None] & cmask[None, :]
    w = tl.load(w_ptr + k[:, None] * C + c[None, :], mask=wmask, other=0.0)             # (KP, BC)
    gw = tl.zeros((KP, BC), tl.float32)
    for block in range(tl.program_id(1), tl.cdiv(T, BT), tl.num_programs(1)):
        t = (block * BT + r // NP).to(tl.int64)                    # offsets past 2^31 values
        rmask = (t < T) & (j < N)
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + t[:, None] * sxt + j[:, None] * sxn + c[None, :] * sxc, mask=mask,
                    other=0.0).to(tl.float32)
        gu = tl.load(gu_ptr + t[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)   # from L1: n rows
        row = t * N + j
        h_pre = tl.load(h_pre_ptr + row, mask=rmask, other=0.0)
        a = tl.load(scale_ptr + row, mask=rmask, other=0.0)
        shift = tl.load(shift_ptr + row, mask=rmask, other=0.0)
        mean = tl.load(mean_ptr + row, mask=rmask, other=0.0)
        g = tl.load(gz_ptr + row[:, None] * KH + k[None, :], mask=rmask[:, None] & (k < KH)[None, :], other=0.0)
        offsets = row[:, None] * C + c[None, :]
        gx = tl.load(gx_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        gx += h_pre[:, None] * gu + a[:, None] * x + shift[:, None]
        gx = tl.dot(g, w, gx, input_precision="ieee")
        gw = tl.dot(tl.trans(g), tl.where(mask, x - mean[:, None], 0.0), gw, input_precision="ieee")
        tl.store(gx_ptr + offsets, _stored(gx, gx_ptr), mask=mask)
    tl.store(gw_ptr + tl.program_id(1) * KH * C + k[:, None] * C + c[None, :], gw, mask=wmask)


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

