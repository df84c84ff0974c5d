"""The fast path of the residual streams on any device: hand-written autograd Functions for HC and mHC, proven
equal to the readable formulas of train_c4.py in forward and every gradient (tests/kernels/test_fused.py).

The state (..., n, C) is stored stream-major, a view of (n, ..., C) (expand, below), so that each stream
is one contiguous slab: a per-token mixing becomes n x n scaled adds of slabs instead of one tiny matmul per
token, and each backward adds its term of x's gradient in place. Why each piece exists and what it saved, as
measured on a 2-core CPU: docs/benchmarks.md; the derivations of the backward passes: docs/model.md.
"""

import torch


def autocast_off(x: torch.Tensor):
    # mixing coefficients are computed in fp32 and the streams mixed in their own dtype, whatever the autocast
    return torch.autocast(x.device.type, enabled=False)


def expand(h, n):
    """The embedding h (..., C) copied into n streams, stored stream-major: (n, ..., C) seen as (..., n, C)."""
    return h.expand(n, *h.shape).contiguous().movedim(0, -2)


def stream_major(grad):
    """The gradient of the collapse (a sum over the streams) reaches the last block as one stride-0 view;
    the per-token dot products (_token_dots) want each stream's gradient a slab of its own."""
    return grad.movedim(-2, 0).contiguous().movedim(0, -2)


def hc_coefficients(conn, x):
    """HC's coefficients (train_c4.HyperConnection): x, then H_pre, H_post, H_res with their stream axes first
    (stream_update) and no logits; fp32 (fp64 for an fp64 state). x is passed through the Function, so that its whole
    gradient reaches the Function's backward, which adds its own term in place: one n x C gradient per token and
    sublayer instead of five (docs/benchmarks.md)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    with autocast_off(x):
        H_pre, H_post, H_res, x = _HCCoefficients.apply(
            x, conn.dynamic.weight.to(dtype), conn.A_m_static.to(dtype), conn.A_r_static.to(dtype),
            conn.B_static.to(dtype), conn.s_a.to(dtype), conn.s_b.to(dtype), conn.eps)
    return x, H_pre, H_post, H_res, None


def mhc_coefficients(conn, x):
    """mHC's coefficients (train_c4.ManifoldHyperConnection), as hc_coefficients, and the logits Sinkhorn projected
    (tokens first) for the probe."""
    n, dtype = conn.n, torch.promote_types(x.dtype, torch.float32)
    with autocast_off(x):
        z, x = _RMSScaledProjection.apply(x, conn.phi.weight.to(dtype), conn.eps)
        z_pre, z_post, z_res = z.split([n, n, n * n], dim=-1)
        H_pre = torch.sigmoid(conn.a_pre.to(dtype) * z_pre + conn.b_pre.to(dtype))
        H_post = 2 * torch.sigmoid(conn.a_post.to(dtype) * z_post + conn.b_post.to(dtype))
        res_logits = conn.a_res.to(dtype) * z_res.unflatten(-1, (n, n)) + conn.b_res.to(dtype)
        H_res = sinkhorn(res_logits, conn.iters)
    # sinkhorn's result is a view of a matrix-axes-first tensor: back to that layout, no copy
    return x, H_pre.movedim(-1, 0), H_post.movedim(-1, 0), H_res.movedim((-2, -1), (0, 1)), res_logits


def stream_update(x, H_pre, H_post, H_res, sublayer):
    """x_next = H_res @ x + H_post^T * F(norm(H_pre @ x)) for every token; x is (..., n, C), stored stream-major
    (expand). The coefficients come with their stream (and matrix) axes first, as the connections compute
    them: H_pre and H_post (n, ...), H_res (n, n, ...) with H_res[i, j] the weight of stream j in stream i."""
    # Autocast is off: u and the mixing in the coefficients' dtype (fp32, or fp64 for an fp64 state) whatever the
    # state's, which only the write's result is rounded to. The Functions take x as n slabs of (..., C)
    wide = torch.promote_types(x.dtype, torch.float32)
    with autocast_off(x):
        u, streams = _StreamRead.apply(H_pre.to(wide), x.movedim(-2, 0))
    y = sublayer(u)
    with autocast_off(x):
        return _StreamWrite.apply(H_res.to(wide), streams, H_post.to(wide), y.to(wide))


def _token_dots(a, b):
    """(..., p, q): per token, the dot products over C of a's p slabs (p, ..., C) with b's q slabs (q, ..., C).
    One batched matmul over the tokens, (p x C) @ (C x q) each, read straight from the stream-major slabs."""
    p, q, C = a.shape[0], b.shape[0], a.shape[-1]
    tokens = a.shape[1:-1]
    # a bf16 state or gradient widened (a copy), so that the coefficients' gradients are summed in fp32
    a, b = (t.to(torch.promote_types(t.dtype, torch.float32)) for t in (a, b))
    return torch.bmm(a.reshape(p, -1, C).transpose(0, 1), b.reshape(q, -1, C).permute(1, 2, 0)).view(*tokens, p, q)


def _mixed_slabs(H, slabs):
    """(n, ..., C) with slab i = sum_j H[i, j] * slabs[j], for per-token weights H (n, m, ...) and slabs (m, ..., C):
    m scaled adds of contiguous (..., C) slabs, all n destinations at once: the per-token (n x m) @ (m x C) product
    without one tiny matmul per token, which the CPU runs at ~6 GFLOP/s (benchmarks.md). The result is a new
    stream-major tensor, whatever the layout of the slabs."""
    # H contiguous (a small copy at most) puts the destination axis first in the product's inferred layout, in eager
    # and in torch.compile's functionalised graph alike (an out= argument would hold in eager only)
    weights, sources = H.contiguous().unsqueeze(-1).unbind(1), slabs.unbind(0)    # two ops, not two per source
    out = weights[0] * sources[0]
    for weight, source in zip(weights[1:], sources[1:]):
        out.addcmul_(weight, source)
    return out


class _StreamRead(torch.autograd.Function):
    """u = sum_j H_pre[j] x[j] per token (in H_pre's dtype), for H_pre (n, ...) and the stream slabs x (n, ..., C);
    x is passed through
    as a second output for _StreamWrite to read. The backward is written out so that this term of x's gradient is
    added in place into the one the write created, where autograd would add the two into a new n x C tensor
    per token (benchmarks.md)."""

    @staticmethod
    def forward(ctx, H_pre, streams):
        ctx.save_for_backward(H_pre, streams)
        # passed through as a detached alias (same storage, no copy): returning the input itself makes autograd
        # wrap it as a view, which torch.compile's tracing of the Function rejects
        return _mixed_slabs(H_pre.unsqueeze(0), streams)[0], streams.detach()

    @staticmethod
    def backward(ctx, grad_u, grad_streams):
        H_pre, streams = ctx.saved_tensors
        # grad_streams is _StreamWrite's own new tensor (or autograd's materialised zeros): nothing else holds it
        grad_x = grad_streams.addcmul_(H_pre.unsqueeze(-1), grad_u)
        return _token_dots(grad_u.unsqueeze(0), streams).squeeze(-2).movedim(-1, 0), grad_x


class _StreamWrite(torch.autograd.Function):
    """x_next[i] = sum_j H_res[i, j] x[j] + H_post[i] y per token, for H_res (n, n, ...), the stream slabs
    x (n, ..., C), H_post (n, ...), y (..., C); the result is the state (..., n, C), stored stream-major. The
    backward is written out (scaled adds of slabs for x and y, per-token dot products for the coefficients) and
    guarantees what _StreamRead relies on: x's gradient is a new tensor of its own."""

    @staticmethod
    def forward(ctx, H_res, streams, H_post, y):
        ctx.save_for_backward(H_res, streams, H_post, y)
        # returned as a detached alias of the stream-major slabs, not as a view of them: FSDP2 warns of every view
        # a wrapped module returns (an in-place op on it would skip its all-gather), and nothing else holds them.
        # Mixed in H_res's dtype, rounded once to the state's
        out = _mixed_slabs(H_res, streams).addcmul_(H_post.unsqueeze(-1), y).to(streams.dtype)
        return out.movedim(0, -2).detach()

    @staticmethod
    def backward(ctx, grad):
        H_res, streams, H_post, y = ctx.saved_tensors
        grad = grad.movedim(-2, 0)          # the slabs: stream-major as the next connection's backward made it
        # x's gradient (n slabs) and y's (one more) in one pass over grad; the slabs do not overlap
        grad_x_y = _mixed_slabs(torch.cat([H_res.transpose(0, 1), H_post.unsqueeze(0)]), grad)
        return (_token_dots(grad, streams).movedim((-2, -1), (0, 1)), grad_x_y[:-1].to(streams.dtype),
                _token_dots(grad, y.unsqueeze(0)).squeeze(-1).movedim(-1, 0), grad_x_y[-1])


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Project exp(logits) onto the doubly stochastic matrices with `iters` column-then-row normalisations;
    rows are normalised last, so row sums are exact. Computed in at least fp32 (bf16 input is promoted).

    The first pair runs in the log domain (subtracting logsumexps): the same maths as dividing exp(logits) by
    its sums, but it cannot overflow or divide by zero, and afterwards every row holds an entry >= 1/n and
    every column one >= 1/n^2. So the remaining pairs, plain divisions on the cheaper linear scale, never
    meet a zero sum either, whatever the logits' range (+-1e4, a column that would underflow entirely)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # the work runs with the matrix axes first and the tokens last: each sum over a matrix axis then adds n
    # contiguous rows of tokens, 3-5x faster on the CPU than n-element reductions per token (docs/benchmarks.md)
    balanced = logits.movedim((-2, -1), (0, 1)).contiguous()
    balanced = balanced - balanced.logsumexp(0, keepdim=True)
    balanced = balanced - balanced.logsumexp(1, keepdim=True)
    # returned as a view of that layout: the stream update reads H_res with the matrix axes first as well
    return _SinkhornNormalisations.apply(balanced.exp(), iters - 1).movedim((0, 1), (-2, -1))


class _SinkhornNormalisations(torch.autograd.Function):
    """iters times: P /= column sums, then P /= row sums, for matrices P (n, n, ...) stored with the matrix axes
    first; forward identical to the plain loop. The backward is written out: through Q = P / s (s: sums over one
    axis), dP = (dQ - sum(dQ * Q)) / s over that axis, which is 4 small kernels per half-step where autograd
    runs about 8 (the Sinkhorn is hundreds of tiny ops). Only the sums and the final P are kept: the backward
    walks the iterations in reverse and recovers each earlier P as Q * s, so per token and iteration it keeps the
    2n sums instead of 2n^2 + 2n numbers (benchmarks.md)."""

    @staticmethod
    def forward(ctx, P, iters):
        sums = []
        for _ in range(iters):
            for dim in (0, 1):
                sums.append(P.sum(dim, keepdim=True))
                P = P / sums[-1]
        ctx.save_for_backward(P, *sums)
        return P

    @staticmethod
    def backward(ctx, grad):
        Q, *sums = ctx.saved_tensors
        grad = grad.contiguous()            # it arrives in the caller's tokens-first layout: every op would keep it
        for k in reversed(range(len(sums))):
            s = sums[k]
            grad = (grad - (grad * Q).sum(k % 2, keepdim=True)) / s
            if k:
                Q = Q * s                   # the P this half-step divided: the previous half-step's result
        return grad, None


class _HCCoefficients(torch.autograd.Function):
    """(H_pre, H_post, H_res, x) of HC for the streams x (..., n, C), x passed through (see hc_coefficients).

    Per stream i and token: z = layer_norm(x_i) @ W^T (no affine), d = tanh(z), and the k = n + 2 coefficients
    c = static_i + scale * d: c_0 = A_m[i] (H_pre), c_1..n = A_r[i, :] (column i of H_res = A_r^T), c_n+1 = B[i]
    (H_post); scale is s_a, except s_b for B. All of it is one Function, computed k-major (k, n, tokens), so that
    each coefficient comes out as contiguous slabs with the stream axes first, as the stream update reads them,
    and autograd records one node instead of one per small op.

    The norm is folded into the projection: [W; 1/C] @ x gives the raw products and the mean in one thin matmul,
    a vector norm gives mean(x^2), and z = rstd (W x - mean W 1). So the normalised copy of the state is never
    written. The variance mean(x^2) - mean^2 loses digits when a stream's mean is far above its spread
    (relative error ~ 1e-7 (mean / spread)^2; tests/kernels/test_fused.py checks a mean 30x the spread against the
    formulas).
    The backward is written out: with g = dz rstd, dW = g^T x - (g . mean) 1^T and
    dx = g @ (W - row means) - rstd (g . z) (x - mean) / C, accumulated in place into x's incoming gradient."""

    @staticmethod
    def forward(ctx, x, W, A_m_static, A_r_static, B_static, s_a, s_b, eps):
        n, C = x.shape[-2:]
        tokens = x.shape[:-2]
        stored = x.movedim(-2, 0).reshape(-1, C)            # (n tokens, C), a view in the model, kept as stored
        xs = stored.to(W.dtype)
        raw = torch.cat([W, W.new_full((1, C), 1 / C)]) @ xs.t()               # (k + 1, n tokens)
        mean = raw[-1]
        var = (torch.linalg.vector_norm(xs, dim=-1).square_().div_(C) - mean.square()).clamp_min_(0)
        rstd = var.add_(eps).rsqrt_()
        z = raw[:-1].addcmul_(W.sum(-1, keepdim=True), mean, value=-1).mul_(rstd)
        d = torch.tanh(z)
        scale = torch.cat([s_a.expand(n + 1), s_b.view(1)]).unsqueeze(-1)       # (k, 1)
        statics = torch.cat([A_m_static.view(1, n), A_r_static.t(), B_static.view(1, n)]).unsqueeze(-1)
        coef = torch.addcmul(statics, d.view(n + 2, n, -1), scale.unsqueeze(-1))    # (k, n, tokens)
        ctx.save_for_backward(stored, W, mean, rstd, z, d, scale)
        ctx.x_shape, ctx.scale_shapes = x.shape, (s_a.shape, s_b.shape)     # () or, under FSDP, (1,)
        return (coef[0].view(n, *tokens), coef[n + 1].view(n, *tokens), coef[1:n + 1].view(n, n, *tokens),
                x.detach())

    @staticmethod
    def backward(ctx, grad_pre, grad_post, grad_res, grad_x):
        stored, W, mean, rstd, z, d, scale = ctx.saved_tensors
        n, C, xs = *ctx.x_shape[-2:], stored.to(W.dtype)
        # the gradients arrive in whatever layout their consumers made: cat copies them into one k-major tensor
        grad_coef = torch.cat([grad_pre.unsqueeze(0), grad_res, grad_post.unsqueeze(0)]).view(n + 2, -1)
        grad_statics = grad_coef.view(n + 2, n, -1).sum(-1)                       # (k, n)
        by_scale = (grad_coef * d).sum(-1)
        g = grad_coef.mul_(scale).mul_(1 - d.square()).mul_(rstd)               # dz rstd, (k, n tokens)
        grad_W = (g @ xs).sub_((g @ mean).unsqueeze(-1))
        # the mean's term of dx joins the matmul as one more row: [g; -a mean] @ [W - row means; 1]
        a = (g * z).sum(0).mul_(rstd / -C)
        lhs = torch.cat([g, (a * mean).neg_().unsqueeze(0)])
        rhs = torch.cat([W - W.mean(-1, keepdim=True), W.new_ones(1, C)])
        dtype, gx = grad_x.dtype, grad_x.movedim(-2, 0).to(W.dtype).reshape(-1, C)     # a view when stream-major
        gx.addmm_(lhs.t(), rhs).addcmul_(xs, a.unsqueeze(-1))
        grad_x = gx.view(n, *ctx.x_shape[:-2], C).movedim(0, -2).to(dtype)
        return (grad_x, grad_W, grad_statics[0], grad_statics[1:n + 1].t(), grad_statics[n + 1],
                by_scale[:n + 1].sum().view(ctx.scale_shapes[0]), by_scale[n + 1].view(ctx.scale_shapes[1]), None)


class _RMSScaledProjection(torch.autograd.Function):
    """(z, x) with z = (v @ phi^T) / sqrt(mean(v^2) + eps), v the flattened streams vec(x) of x (..., n, C), in phi's
    dtype; x is passed through (see hc_coefficients). v is never formed: its columns are the n stream-major slabs, so
    v @ phi^T is a sum of n (tokens x C) @ (C x k) products (one batched matmul) and the RMS a sum of per-stream norms.
    The backward is written out: the RMS term's gradient, a per-token multiple of x, and the projection's are added
    in place into x's incoming gradient, where autograd writes five nC-sized tensors per token (the projection's,
    the norm's three, their sum) and a sixth to add them to x's."""

    @staticmethod
    def forward(ctx, x, phi, eps):
        n, C = x.shape[-2:]
        stored = x.movedim(-2, 0)
        xs = stored.to(phi.dtype)               # fp32 in the model (the weight is cast to it): a bf16 state widened
        phis = phi.view(-1, n, C).transpose(0, 1)                               # (n, k, C): stream j's columns
        raw = torch.bmm(xs.reshape(n, -1, C), phis.transpose(1, 2)).sum(0).view(*x.shape[:-2], -1)
        # norms, not vecdot(x, x): that multiplies into an nC-sized temporary first
        inv_rms = torch.rsqrt(torch.linalg.vector_norm(xs, dim=-1).square().sum(0).unsqueeze(-1) / (n * C) + eps)
        ctx.save_for_backward(stored, phi, raw, inv_rms)     # the state as stored: bf16 streams keep bf16
        return raw * inv_rms, x.detach()        # passed through as in _StreamRead

    @staticmethod
    def backward(ctx, grad, grad_x):
        stored, phi, raw, inv_rms = ctx.saved_tensors
        xs, n, C = stored.to(phi.dtype), stored.shape[0], stored.shape[-1]
        grad_raw = (grad * inv_rms).reshape(-1, phi.shape[0])                   # (tokens, k)
        # d inv_rms / dv = -inv_rms^3 v / N
        coef = (grad * raw).sum(-1, keepdim=True) * inv_rms.pow(3) / -(n * C)
        phis = phi.view(-1, n, C).transpose(0, 1)
        # accumulated in place when grad_x is already stream-major; autograd's materialised zeros get a copy
        dtype, gx = grad_x.dtype, grad_x.movedim(-2, 0).to(phi.dtype).contiguous()
        gx.view(n, -1, C).baddbmm_(grad_raw.expand(n, *grad_raw.shape), phis).addcmul_(xs.reshape(n, -1, C),
                                                                                       coef.reshape(1, -1, 1))
        grad_phi = torch.bmm(grad_raw.t().expand(n, *grad_raw.t().shape), xs.reshape(n, -1, C))
        return gx.to(dtype).movedim(0, -2), grad_phi.transpose(0, 1).reshape(phi.shape), None
