"""One connection, forward and backward, on every kernel path: what the streams cost on a GPU, beside the public
figures for the same work (one eager mHC connection at batch 16, sequence 2048, width 4096 on an H100: 85.0 ms,
4.01 ms for the plain residual, 13.66 ms fused in Triton).

    python benchmarks/bench_connection.py                          # CUDA: that public config, n 4, every arm
    python benchmarks/bench_connection.py --tokens 8192 --width 2048 --json out.json
    python benchmarks/bench_connection.py --device cpu --tokens 64 --width 64 --arms mhc   # a smoke run
    python benchmarks/bench_connection.py --stream-dtype bf16      # the state stored in bf16 (--stream-dtype)

A connection is timed around a sublayer that only casts (y = u in bf16), under bf16 autocast, so the time is the
streams' alone: coefficients, read, write and their backwards. The residual row is x + y with the same sublayer.
Timing: CUDA events around each call after warm-up (triton.testing.do_bench's median), or the host clock on a CPU.
Also times mHC's two Sinkhorn backwards (stored sums against recomputation) on the triton path.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hcstudy import arms
from hcstudy.kernels import choice
from hcstudy.kernels import fused as fused_module  # noqa: E402
from hcstudy.config import parse_config
from hcstudy.model import STREAM_DTYPES

ARMS = ("hc", "mhc", "mhc-lite", "identity-hc")


def timed_ms(step, device: torch.device, repeats: int) -> float:
    """Median milliseconds of step() over `repeats` calls after three warm-up calls."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(step, warmup=25, rep=max(100, repeats * 10), return_mode="median")
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def connection_step(arm: str, path: str, cfg, device, tokens: int):
    """A closure running one forward and backward of one connection (or the plain residual)."""
    n = 1 if arm == "baseline" else cfg.expansion
    conn = arms.connection(arm)(dataclasses.replace(cfg, residual=arm), 1, path).to(device)
    x = torch.randn(max(1, tokens // 1024), min(tokens, 1024), n, cfg.width, device=device,
                    dtype=STREAM_DTYPES[cfg.stream_dtype])                # the state as the trainer stores it
    if path == "fused":
        x = fused_module.expand(x[..., 0, :], n)                            # the layout the fused path keeps
    x.requires_grad_()
    grad = torch.randn_like(x)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step():
        with autocast:
            out, _ = conn(x, lambda u: u.to(torch.bfloat16))
        out.backward(grad)
        x.grad = None
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=16 * 2048, help="tokens per call, in sequences of 1024")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--expansion", type=int, default=4)
    p.add_argument("--stream-dtype", choices=("fp32", "bf16"), default="fp32", help="the residual state's dtype")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--paths", default="reference,fused,triton")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", help="write the table here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = parse_config(["--width", str(args.width), "--expansion", str(args.expansion), "--heads", "1",
                          "--stream-dtype", args.stream_dtype])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"one connection, forward + backward, {args.tokens:,} tokens, width {args.width}, n {args.expansion}, "
          f"{args.stream_dtype} streams, bf16 autocast, on {name}, torch {torch.__version__}", flush=True)
    rows = [{"arm": "baseline", "path": "residual", "ms": timed_ms(connection_step("baseline", "reference", cfg,
                                                                                    device, args.tokens),
                                                                    device, args.repeats)}]
    print(f"  {'residual x + y':<24} {rows[0]['ms']:9.2f} ms", flush=True)
    for arm in args.arms.split(","):
        for path in args.paths.split(","):
            if not choice.supports(dataclasses.replace(cfg, residual=arm), path):
                continue
            variants = ("stored", "recompute") if arm == "mhc" and path == "triton" else (None,)
            for variant in variants:
                if variant:
                    choice.triton_kernels().SINKHORN_BACKWARD = variant
                try:
                    ms = timed_ms(connection_step(arm, path, cfg, device, args.tokens), device, args.repeats)
                except torch.OutOfMemoryError:
                    ms = None
                label = f"{arm} {path}" + (f" ({variant} Sinkhorn backward)" if variant else "")
                rows.append({"arm": arm, "path": path, "sinkhorn_backward": variant, "ms": ms})
                shown = "out of memory" if ms is None else f"{ms:9.2f} ms  x{ms / rows[0]['ms']:.1f} of the residual"
                print(f"  {label:<24} {shown}", flush=True)
    if "triton" in args.paths:
        choice.triton_kernels().SINKHORN_BACKWARD = "stored"
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "torch": torch.__version__, "tokens": args.tokens,
                                               "width": args.width, "n": args.expansion,
                                               "stream_dtype": args.stream_dtype, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
