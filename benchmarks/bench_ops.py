"""Where the step time of HC and mHC goes: every aten op of one optimizer step, timed op by op.

    OMP_NUM_THREADS=1 python benchmarks/bench_ops.py --threads 1 --width 256 --steps 5 --top 24

Each variant (bench_step.py's Variant: the trainer's model and optimizer, bench_step's config flags) runs
`--steps` timed steps under a TorchDispatchMode that times every aten op. Per op (by its position in the step,
the same in every step) the minimum over the steps is kept: other processes on a shared machine only ever add
time, so the minimum is the least disturbed measurement of each op. Printed: per variant the number of ops, the
sum of those minima and the fastest step without the timer (their difference is the overhead outside the
kernels: Python, dispatch, autograd); then per HC/mHC the extra over the baseline by op and input shapes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step  # noqa: E402


class OpTimer(TorchDispatchMode):
    """Records (op name, input shapes, seconds) for every aten op run under it."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, str, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        seconds = time.perf_counter() - start
        shapes = str([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])[:70]
        self.records.append((func.overloadpacket.__name__, shapes, seconds))
        return out


def op_minima(variant, steps: int) -> tuple[dict, int, float, float]:
    """(ms per (op, shapes) summed over the step, op count, sum of the minima in ms, fastest untimed step ms)."""
    minima, fastest, records = None, float("inf"), []
    for _ in range(steps):
        fastest = min(fastest, bench_step.timed(variant.step, variant.device)[0])
        timer = OpTimer()
        with timer:
            variant.step()
        records = timer.records
        seconds = [r[2] for r in records]
        minima = seconds if minima is None else [min(a, b) for a, b in zip(minima, seconds)]
    by_op = defaultdict(float)
    for (name, shapes, _), best in zip(records, minima):
        by_op[(name, shapes)] += best * 1e3
    return by_op, len(records), sum(minima) * 1e3, fastest * 1e3


def main(argv=None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--top", type=int, default=24, help="rows of the extra-over-baseline table per variant")
    mine, rest = extra.parse_known_args(argv)
    args = bench_step.parse_args(rest)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    variants = {name: bench_step.Variant(bench_step.config(args, name), device) for name in args.variants}
    for variant in variants.values():
        for _ in range(args.warmup):
            variant.step()
    results = {name: op_minima(v, args.steps) for name, v in variants.items()}
    for name, (_, ops, total, fastest) in results.items():
        print(f"{name}: {ops} ops, sum of op minima {total:.1f} ms, fastest step without the timer {fastest:.1f} ms")
    base = results.get("baseline", ({},))[0]
    for name, (by_op, *_) in results.items():
        if name == "baseline":
            continue
        print(f"== {name} minus baseline, ms per step, by op and input shapes")
        diff = {key: by_op.get(key, 0.0) - base.get(key, 0.0) for key in set(by_op) | set(base)}
        for key, ms in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:mine.top]:
            print(f"  {ms:+8.2f}  {key[0]:<26} {key[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
