"""What the finiteness check of a checkpoint's state costs (hcstudy/finite_state.py: every checkpoint before it is
sealed and before it is resumed from): the weights and Adam's two moments, in fp32, of a model shaped as the study's
(per layer the attention's and the MLP's matrices, two norms and a few small connection tensors), timed against the
sha256 of the same bytes, which the checkpoint protocol already takes of every file.

    python benchmarks/bench_finite_check.py                                  # CPU, depth 48, width 256: 38M parameters
    python benchmarks/bench_finite_check.py --device cuda --width 2048       # a GPU: 2.4B parameters, 29 GB checked

Prints the state's size, the check's median time and rate (GB/s), the sha256's rate, and the check's time at the
depth-48 model's 2.5B parameters (30 GB of fp32 weights and moments) at the rate measured.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hcstudy.finite_state import non_finite_problem  # noqa: E402

FULL_SIZE_PARAMETERS = 2.5e9        # the depth-48 model (docs/planning.md)


def layer_shapes(width: int, expansion: int) -> list[tuple[int, ...]]:
    """One block's tensors: attention (qkv, out), MLP (in, out), two norms, and the connections' small ones."""
    return [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width), (width,), (width,),
            (expansion + 2, expansion * width), (expansion, expansion), (expansion,)]


def checkpoint_state(depth: int, width: int, expansion: int, device: torch.device) -> dict:
    """model.pt and optimizer.pt as the trainer saves them (weights, then exp_avg and exp_avg_sq per parameter)."""
    shapes = [shape for _ in range(depth) for shape in layer_shapes(width, expansion)]
    weights = {f"p{i}": torch.randn(shape, device=device) for i, shape in enumerate(shapes)}
    moments = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn_like(w), "exp_avg_sq": torch.rand_like(w)}
               for i, w in enumerate(weights.values())}
    return {"model.pt": weights, "optimizer.pt": {"state": moments, "param_groups": [{"lr": 1e-3}]}}


def median_seconds(work, rounds: int, device: torch.device) -> float:
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        work()          # non_finite_problem ends in its one host sync
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sha256_rate(size: int = 1 << 28) -> float:
    """sha256's bytes per second on this CPU, one thread (as the checkpoint protocol hashes each file)."""
    data = bytes(size)
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=48)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--expansion", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    state = checkpoint_state(args.depth, args.width, args.expansion, device)
    weights = state["model.pt"].values()
    parameters, tensors = sum(w.numel() for w in weights), 3 * len(weights)
    checked = 3 * 4 * parameters
    assert non_finite_problem(state) is None            # warm-up, and the state is finite
    seconds = median_seconds(lambda: non_finite_problem(state), args.rounds, device)
    rate = checked / seconds
    hashing = sha256_rate()
    print(f"{device} ({torch.get_num_threads()} threads): depth {args.depth} width {args.width}, "
          f"{parameters / 1e6:,.1f}M parameters, {tensors} tensors, {checked / 1e9:.2f} GB of fp32 weights and Adam "
          "moments")
    print(f"check: {seconds * 1e3:.1f} ms median of {args.rounds} ({rate / 1e9:.1f} GB/s); sha256 of the same bytes on "
          f"one CPU thread: {checked / hashing:.2f} s ({hashing / 1e9:.2f} GB/s)")
    full = 3 * 4 * FULL_SIZE_PARAMETERS
    print(f"at {FULL_SIZE_PARAMETERS / 1e9:g}B parameters ({full / 1e9:.0f} GB): the check {full / rate:.2f} s at this "
          f"rate, the sha256 {full / hashing:.0f} s")


if __name__ == "__main__":
    main()
