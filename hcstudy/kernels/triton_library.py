"""The Triton kernels' launches as torch.library operators (torch.ops.hcstudy.*), so that torch.compile traces the
triton path's connections through them: per operator, its schema (what it reads, what it writes in place:
`Tensor(a!)`), its fake implementation (the outputs' shapes, dtypes and strides, without running a kernel: what
dynamo and AOTAutograd trace with) and its kernel on the CPU (Triton's interpreter) and on CUDA, the launch itself.
triton_kernels.py holds the kernels, triton_ops.py the autograd Functions that call these operators, with
everything else (the cuBLAS matmuls, the sums over the tokens, the casts) in plain torch; choice.triton_kernels
imports this module before it hands triton_ops to a connection, which defines the operators.

Custom operators, opaque to the compiler, rather than torch.library.triton_op, whose body Inductor would see: a
triton_op traces its body with fake tensors, and in Triton's interpreter (TRITON_INTERPRET=1, where the tests run
on the CPU) wrap_triton hands back the interpreted kernel, which cannot run on fake tensors. Opaque, the same
operators serve the interpreter and the GPU, and Inductor calls each as one extern kernel.

Each launch reads triton_ops' block sizes and kernels when it runs (the tests force small blocks; the planner
replaces the kernels by their byte counts). A state x arrives as (T, n, C) with any strides (the write's in its
own shape); every other tensor is tokens-first and contiguous, as the kernels index them."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hcstudy.kernels import triton_ops as ops

NAMESPACE = "hcstudy"
_library = torch.library.Library(NAMESPACE, "DEF")      # held for the life of the process: the operators live in it
_OUTPUTS = {}                                           # each operator's outputs, allocated and left empty, by name


def _operator(schema: str):
    """Define an operator from its schema; the decorated function allocates its outputs, left empty: the fake
    implementation, and the buffers the launch writes into. Its .launch decorator registers the kernel."""
    name = schema.split("(", 1)[0]
    _library.define(schema)

    def define(outputs):
        torch.library.register_fake(f"{NAMESPACE}::{name}", outputs, lib=_library)
        _OUTPUTS[name] = outputs

        def launch(kernel):
            torch.library.register_kernel(f"{NAMESPACE}::{name}", ("cpu", "cuda"), kernel, lib=_library)
            return kernel
        outputs.launch = launch
        return outputs
    return define


class without_kernels(TorchDispatchMode):
    """Each operator answered by its outputs, allocated and left empty, no kernel run: what the memory plan needs
    of the triton path (the sizes of what it keeps, not the values) on a CPU, without Triton's interpreter."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == NAMESPACE:
            return _OUTPUTS[func._opname](*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _f32(x: torch.Tensor, *shapes) -> list[torch.Tensor]:       # the coefficients and their gradients: fp32 always
    return [x.new_empty(shape, dtype=torch.float32) for shape in shapes]


def _or(tensor, placeholder):
    """A pointer argument the kernel's constexprs leave unread (identity-HC's H_res logits, say)."""
    return placeholder if tensor is None else tensor


# ------------------------------------------------------------------------------------------------------------------
# mHC's family: the coefficients (gates, Sinkhorn or the permutation mix) and the read u = H_pre x


@_operator("mhc_read_forward(Tensor x, Tensor phi, Tensor? raw, Tensor a_pre, Tensor a_post, Tensor? a_res, "
           "Tensor b_pre, Tensor b_post, Tensor? b_res, Tensor? perms, int mixing, int iters, float eps, "
           "ScalarType u_dtype, bool store_sums) -> (Tensor u, Tensor h_pre, Tensor h_post, Tensor h_res, "
           "Tensor inv_rms, Tensor raw_out, Tensor logits, Tensor sums)")
def mhc_read_forward(x, phi, raw, a_pre, a_post, a_res, b_pre, b_post, b_res, perms, mixing, iters, eps, u_dtype,
                     store_sums):
    """raw: cuBLAS's projection (T, 2n + R) where the kernel cannot hold the logits (triton_ops._projects), else None
    and the kernel projects with phi itself, returning raw_out (empty where raw came in: no output aliases an
    input). logits and sums are empty where there are none (mixing != 1: mhc-lite, identity-hc; sums: stored only)."""
    T, n, C = x.shape
    return (x.new_empty((T, C), dtype=u_dtype),
            *_f32(x, (T, n), (T, n), (T, n, n), (T,), (T, phi.shape[0]) if raw is None else (0,),
                  (T, n, n) if mixing == 1 else (0,), (T, max(iters - 1, 0), 2, n) if store_sums else (0,)))


@mhc_read_forward.launch
def _(x, phi, raw, a_pre, a_post, a_res, b_pre, b_post, b_res, perms, mixing, iters, eps, u_dtype, store_sums):
    outputs = mhc_read_forward(x, phi, raw, a_pre, a_post, a_res, b_pre, b_post, b_res, perms, mixing, iters, eps,
                               u_dtype, store_sums)
    u, h_pre, h_post, h_res, inv_rms, raw_out, logits, sums = outputs
    project, raw = raw is None, _or(raw, raw_out)
    T, n, C = x.shape
    K, R = phi.shape[0], phi.shape[0] - 2 * n
    BT, BC, NP = (ops.dot_block_sizes if project else ops.block_sizes)(n, C)
    KP, KT = ops._logit_tiles(K)
    ops._mhc_read_forward[(ops._cdiv(T, BT),)](
        x, *x.stride(), phi, raw, a_pre, a_post, _or(a_res, raw), b_pre, b_post, _or(b_res, raw), _or(perms, raw),
        u, h_pre, h_post, h_res, logits if mixing == 1 else raw, sums if store_sums else raw, inv_rms, T, C, eps,
        iters, N=n, NP=NP, MIX=mixing, R=R, STORE_SUMS=store_sums, PROJECT=project, KP=KP, KT=KT, BT=BT, BC=BC,
        BR=ops._chunk(R, BT, NP, KT > 0))
    return outputs


@_operator("mhc_read_backward(Tensor x, Tensor raw, Tensor inv_rms, Tensor a_pre, Tensor a_post, Tensor? a_res, "
           "Tensor b_pre, Tensor b_post, Tensor? b_res, Tensor? perms, Tensor h_pre, Tensor h_post, Tensor h_res, "
           "Tensor? sums, Tensor grad_u, Tensor grad_post, Tensor grad_res, int mixing, int iters, bool stored) -> "
           "(Tensor gl, Tensor glz, Tensor scale)")
def mhc_read_backward(x, raw, *_):
    """The coefficients' backward, per token: the logits' gradients dl (T, 2n + R), each gate's sum(dl z) (T, 3)
    and the RMS term's multiple of x (T), which mhc_read_columns adds into x's gradient."""
    T = x.shape[0]
    return _f32(x, raw.shape, (T, 3), (T,))


@mhc_read_backward.launch
def _(x, raw, inv_rms, a_pre, a_post, a_res, b_pre, b_post, b_res, perms, h_pre, h_post, h_res, sums,
      grad_u, grad_post, grad_res, mixing, iters, stored):
    outputs = mhc_read_backward(x, raw)
    T, n, C = x.shape
    R = raw.shape[1] - 2 * n
    BT, BC, NP = ops.block_sizes(n, C)
    ops._mhc_read_backward[(ops._cdiv(T, BT),)](
        x, *x.stride(), raw, inv_rms, a_pre, a_post, _or(a_res, raw), b_pre, b_post, _or(b_res, raw),
        _or(perms, raw), h_pre, h_post, h_res, _or(sums, raw), grad_u, grad_post, grad_res, *outputs, T, C, iters,
        N=n, NP=NP, MIX=mixing, R=R, STORED=stored, BT=BT, BC=BC, BR=ops._chunk(R, BT, NP))
    return outputs


@_operator("mhc_read_columns(Tensor x, Tensor grad_u, Tensor? grad_write, Tensor(a!) grad_x, Tensor h_pre, "
           "Tensor scale, Tensor gl, Tensor inv_rms, Tensor a_pre, Tensor a_post, Tensor? a_res, Tensor phi, "
           "bool project) -> Tensor partials")
def mhc_read_columns(x, grad_u, grad_write, grad_x, h_pre, scale, gl, inv_rms, a_pre, a_post, a_res, phi, project):
    """The read's share of x's gradient, added into grad_x in place: the write's gradient on entry, in the state's
    dtype (rounded once where stored), unless grad_write brings that and grad_x is cuBLAS's fp32 accumulator (not
    project). project: the projection's term graw phi too, and phi's gradient as one partial per token group
    (groups, 2n + R, n C); empty where cuBLAS projects."""
    T, n, C = x.shape
    return _f32(x, (ops.column_grid(T, C, ops.column_blocks(n))[1], phi.shape[0], n * C) if project else (0,))[0]


@mhc_read_columns.launch
def _(x, grad_u, grad_write, grad_x, h_pre, scale, gl, inv_rms, a_pre, a_post, a_res, phi, project):
    partials = mhc_read_columns(x, grad_u, grad_write, grad_x, h_pre, scale, gl, inv_rms, a_pre, a_post, a_res, phi,
                                project)
    T, n, C = x.shape
    K = phi.shape[0]
    BT, BC, NP, warps = blocks = ops.column_blocks(n)
    KP, KT = ops._logit_tiles(K)
    ops._mhc_read_columns[ops.column_grid(T, C, blocks)](
        x, *x.stride(), grad_u, _or(grad_write, grad_x), grad_x, h_pre, scale, gl, inv_rms, a_pre, a_post,
        _or(a_res, a_pre), phi, partials if project else gl, T, C, K, N=n, NP=NP, PROJECT=project,
        KP=KP, KT=KT, BT=BT, BC=BC, num_warps=warps)
    return partials


# ------------------------------------------------------------------------------------------------------------------
# HC: each stream's norm folded into the projection, the coefficients and the read


@_operator("hc_read_forward(Tensor x, Tensor W, Tensor w_sum, Tensor A_m, Tensor A_r, Tensor B, Tensor s_a, "
           "Tensor s_b, float eps, ScalarType u_dtype) -> (Tensor u, Tensor h_pre, Tensor h_post, Tensor h_res, "
           "Tensor mean, Tensor rstd, Tensor raw)")
def hc_read_forward(x, W, w_sum, A_m, A_r, B, s_a, s_b, eps, u_dtype):
    """raw: the kernel's projection x_i W^T (T, n, n + 2), kept for the backward."""
    T, n, C = x.shape
    return x.new_empty((T, C), dtype=u_dtype), *_f32(x, (T, n), (T, n), (T, n, n), (T, n), (T, n), (T, n, n + 2))


@hc_read_forward.launch
def _(x, W, w_sum, A_m, A_r, B, s_a, s_b, eps, u_dtype):
    outputs = hc_read_forward(x, W, w_sum, A_m, A_r, B, s_a, s_b, eps, u_dtype)
    T, n, C = x.shape
    BT, BC, NP = ops.dot_block_sizes(n, C)
    ops._hc_read_forward[(ops._cdiv(T, BT),)](x, *x.stride(), W, w_sum, A_m, A_r, B, s_a, s_b, *outputs, T, C,
                                              eps, N=n, NP=NP, KP=ops._logit_pad(n + 2), BT=BT, BC=BC)
    return outputs


@_operator("hc_read_backward(Tensor x, Tensor raw, Tensor w_sum, Tensor mean, Tensor rstd, Tensor s_a, "
           "Tensor s_b, Tensor h_pre, Tensor grad_u, Tensor grad_post, Tensor grad_res) -> (Tensor gcoef, "
           "Tensor gcd, Tensor gz, Tensor scale, Tensor shift)")
def hc_read_backward(x, *_):
    """The coefficients' backward, per token: their gradients dc and dc tanh(z) (the statics' and scales' sums),
    the projection's g (T, n, n + 2) each, and the norm's multiple of x and constant (T, n) each, which
    hc_read_columns adds into x's gradient."""
    T, n, _C = x.shape
    return _f32(x, (T, n, n + 2), (T, n, n + 2), (T, n, n + 2), (T, n), (T, n))


@hc_read_backward.launch
def _(x, raw, w_sum, mean, rstd, s_a, s_b, h_pre, grad_u, grad_post, grad_res):
    outputs = hc_read_backward(x)
    T, n, C = x.shape
    BT, BC, NP = ops.block_sizes(n, C)
    ops._hc_read_backward[(ops._cdiv(T, BT),)](
        x, *x.stride(), raw, w_sum, mean, rstd, s_a, s_b, h_pre, grad_u, grad_post, grad_res, *outputs, T, C, N=n,
        NP=NP, KP=ops._next_power_of_2(n + 2), BT=BT, BC=BC)
    return outputs


@_operator("hc_read_columns(Tensor x, Tensor grad_u, Tensor(a!) grad_x, Tensor h_pre, Tensor gz, Tensor scale, "
           "Tensor shift, Tensor mean, Tensor W) -> Tensor partials")
def hc_read_columns(x, grad_u, grad_x, h_pre, gz, scale, shift, mean, W):
    """The read's share of x's gradient, added into grad_x in place (the write's gradient on entry, in the state's
    dtype, rounded once where stored), the projection's term included; W's gradient as one partial per token group
    (groups, n + 2, C)."""
    T, n, C = x.shape
    return _f32(x, (ops.column_grid(T, C, ops.hc_column_blocks(n))[1], n + 2, C))[0]


@hc_read_columns.launch
def _(x, grad_u, grad_x, h_pre, gz, scale, shift, mean, W):
    partials = hc_read_columns(x, grad_u, grad_x, h_pre, gz, scale, shift, mean, W)
    T, n, C = x.shape
    BT, BC, NP, warps = blocks = ops.hc_column_blocks(n)
    ops._hc_read_columns[ops.column_grid(T, C, blocks)](
        x, *x.stride(), grad_u, grad_x, h_pre, gz, scale, shift, mean, W, partials, T, C, N=n, NP=NP,
        KP=ops._logit_pad(n + 2), BT=BT, BC=BC, num_warps=warps)
    return partials


# ------------------------------------------------------------------------------------------------------------------
# every arm's write, x_next = H_res x + H_post y, and its backward


@_operator("write_forward(Tensor x, Tensor y, Tensor h_res, Tensor h_post) -> Tensor")
def write_forward(x, *_):
    """The state x (..., n, C) and y (..., C) in their own shapes: x_next comes out in x's, contiguous, in its dtype
    (not a view of a (T, n, C) result: dynamo refuses a custom Function's view that the next read passes through)."""
    return x.new_empty(x.shape)


@write_forward.launch
def _(x, y, h_res, h_post):
    out = write_forward(x)
    x, y = x.reshape(-1, *x.shape[-2:]), y.reshape(-1, y.shape[-1])      # views wherever the strides allow
    T, n, C = x.shape
    BT, BC, NP = ops.block_sizes(n, C)
    ops._write_forward[(ops._cdiv(T, BT), ops._cdiv(C, BC))](x, *x.stride(), y, *y.stride(), h_res, h_post, out, T,
                                                             C, N=n, NP=NP, BT=BT, BC=BC)
    return out


@_operator("write_backward(Tensor x, Tensor y, Tensor h_res, Tensor h_post, Tensor grad) -> (Tensor grad_x, "
           "Tensor grad_y, Tensor grad_res, Tensor grad_post)")
def write_backward(x, y, h_res, h_post, *_):
    """grad (x_next's gradient) may have any strides: the collapse's arrives as one stride-0 view."""
    return x.new_empty(x.shape), y.new_empty(y.shape), *_f32(x, h_res.shape, h_post.shape)


@write_backward.launch
def _(x, y, h_res, h_post, grad):
    outputs = write_backward(x, y, h_res, h_post)
    T, n, C = x.shape
    BT, BC, NP = ops.block_sizes(n, C)
    ops._write_backward[(ops._cdiv(T, BT),)](x, *x.stride(), y, *y.stride(), h_res, h_post, grad, *grad.stride(),
                                             *outputs, T, C, N=n, NP=NP, BT=BT, BC=BC)
    return outputs
