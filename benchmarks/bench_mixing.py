"""How far the stream mixing of HC and mHC is from this machine's floor, and what the alternatives to it measure.

    OMP_NUM_THREADS=1 python benchmarks/bench_mixing.py --threads 1     # 2048 tokens (8 x 256), n = 4, C = 256
    python benchmarks/bench_mixing.py --smoke                          # CI: tiny shapes, no compile, no claims

Per connection, HC and mHC read the state x (n streams of tokens x C) into the sublayer's input
u = sum_j H_pre[j] x[j], and write x_next[i] = sum_j H_res[i, j] x[j] + H_post[i] y. Their backward forms the
gradients of x and y and, per token, the dot products that are H's gradients. This script times that work,
forward and backward, without the coefficients. Each time is the minimum over --reps, and the caches are flushed
before every rep: in the step, the layers between two connections evict the state. The implementations:

  eager            fused_module.stream_update (the trainer's written-out Functions), with an identity sublayer
  compiled         the same maths as pointwise formulas (read, write, their backwards), torch.compile'd
  bmm, bmm^T       the forward write alone as one batched matmul over the tokens, H_t @ x_t or x_t^T @ H_t^T

and two references: one copy of the state (this machine's bandwidth for it), and the floor: the bytes the four
passes (read, write, and their backwards) must move at the least, one read of every input and one write of every
output, at that bandwidth. The step at a tiny size (width 64, 8 tokens), where the kernels cost next to nothing,
gives the rest: the extra per connection there is the dispatch and autograd overhead of the stream code.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402
from hcstudy.kernels import fused as fused_module  # noqa: E402  (bench_step puts the repository on the path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (micro-batch x sequence)")
    p.add_argument("--width", type=int, default=256, help="C")
    p.add_argument("--n", type=int, default=4, help="streams")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions; the minimum is reported")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd formulas")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 reps, no compile (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.width, args.reps, args.no_compile = 16, 8, 2, True
    return args


def best_ms(fn, reps: int, flush: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(reps):
        flush.add_(1)                       # 64 MB touched: the state is no longer in the caches
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def read(H_pre, x):
    return sum(H_pre[j].unsqueeze(-1) * x[j] for j in range(x.shape[0]))


def write(H_res, x, H_post, y):
    return H_post.unsqueeze(-1) * y + sum(H_res[:, j].unsqueeze(-1) * x[j] for j in range(x.shape[0]))


def write_backward(grad, H_res, x, H_post, y):
    grad_x = sum(H_res[i].unsqueeze(-1) * grad[i] for i in range(x.shape[0]))
    grad_y = (H_post.unsqueeze(-1) * grad).sum(0)
    grad_H_res = (grad.unsqueeze(1) * x.unsqueeze(0)).sum(-1)
    return grad_x, grad_y, grad_H_res, (grad * y).sum(-1)


def read_backward(grad_u, H_pre, x, grad_x):
    return grad_x + H_pre.unsqueeze(-1) * grad_u, (x * grad_u).sum(-1)


def floor_bytes(n: int, tokens: int, width: int) -> int:
    """Bytes per connection, forward and backward: read x, write u; read x and y, write x_next; read grad, x and y,
    write grad_x and grad_y; read grad_u and x, read and write grad_x. The coefficients are ~n^2 numbers per token."""
    slabs = (n + 1) + (2 * n + 1) + (3 * n + 2) + (3 * n + 1)
    return slabs * tokens * width * 4


def mixing_times(args, flush) -> dict:
    n, tokens, C = args.n, args.tokens, args.width
    x = torch.randn(n, tokens, C, requires_grad=True)
    H_pre, H_post = torch.rand(n, tokens, requires_grad=True), torch.rand(n, tokens, requires_grad=True)
    H_res = torch.rand(n, n, tokens, requires_grad=True)
    grad = torch.randn(n, tokens, C)        # stream-major, as the next connection's backward gives it

    def eager():
        out = fused_module.stream_update(x.movedim(0, -2), H_pre, H_post, H_res, lambda u: u)
        torch.autograd.grad(out, (x, H_pre, H_post, H_res), grad.movedim(0, -2))

    times = {"copy of the state": best_ms(x.detach().clone, args.reps, flush),
             "eager": best_ms(eager, args.reps, flush)}
    with torch.no_grad():
        H_tokens, x_tokens = H_res.permute(2, 0, 1).contiguous(), x.detach().transpose(0, 1)
        times["bmm (forward write only)"] = best_ms(lambda: torch.bmm(H_tokens, x_tokens), args.reps, flush)
        times["bmm^T (forward write only)"] = best_ms(
            lambda: torch.bmm(x.detach().permute(1, 2, 0), H_tokens.transpose(1, 2)), args.reps, flush)
        if not args.no_compile:
            times["compiled"] = compiled_time(args, flush, x.detach(), H_pre.detach(), H_post.detach(),
                                              H_res.detach(), grad)
    return times


def compiled_time(args, flush, x, H_pre, H_post, H_res, grad) -> float:
    compiled_read, compiled_write, compiled_write_backward, compiled_read_backward = (
        torch.compile(f, dynamic=True) for f in (read, write, write_backward, read_backward))

    def run():
        u = compiled_read(H_pre, x)
        compiled_write(H_res, x, H_post, u)
        grad_x, grad_y, *_ = compiled_write_backward(grad, H_res, x, H_post, u)
        compiled_read_backward(grad_y, H_pre, x, grad_x)

    run()                                   # compilation, not timed
    return best_ms(run, args.reps, flush)


def overhead_per_connection(args) -> dict:
    """ms per connection that HC and mHC add to a step at width 64, 8 tokens: dispatch and autograd, not kernels."""
    # bench_step's own flags, so that the config is built as every step benchmark builds it
    setup = bench_step.parse_args(["--depth", "4", "--seq", "8", "--micro-batch", "1", "--n", str(args.n),
                                   "--probe-sequences", "1"])
    bench_step.at_width(setup, 64)
    variants = {name: bench_step.Variant(bench_step.config(setup, name), torch.device("cpu"))
                for name in bench_step.VARIANTS}
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(max(3, args.reps)):
        for name, variant in variants.items():
            best[name] = min(best[name], bench_step.timed(variant.step, variant.device)[0] * 1e3)
    return {name: (best[name] - best["baseline"]) / (2 * setup.depth) for name in ("hc", "mhc")}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    flush = torch.zeros(16 * 1024 * 1024)
    times = mixing_times(args, flush)
    state_bytes = args.n * args.tokens * args.width * 4
    bandwidth = 2 * state_bytes / times["copy of the state"] / 1e6          # GB/s: the copy reads and writes
    times["floor (bytes / copy bandwidth)"] = floor_bytes(args.n, args.tokens, args.width) / bandwidth / 1e6
    print(f"n {args.n}, {args.tokens} tokens, C {args.width}, {torch.get_num_threads()} thread(s); state "
          f"{state_bytes / 2**20:.1f} MiB, copied at {bandwidth:.1f} GB/s")
    print("ms per connection, forward + backward of the read and the write (minimum of "
          f"{args.reps}, caches flushed):")
    for name, ms in times.items():
        print(f"  {name:<32} {ms:8.3f}")
    overhead = overhead_per_connection(args)
    print("overhead per connection at width 64, 8 tokens (ms): "
          + ", ".join(f"{name} {ms:.3f}" for name, ms in overhead.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
