"""torchdata's StatefulDataLoader in place of our loader processes (hcstudy/readahead.py's Loader, _StepShares), reading the
same streams in the same worker split: exact resume, resume under another worker count, and tokens/s.

    python benchmarks/bench_stateful_loader.py [--seconds 15] [--workers 2] [--snapshot-every 1 1000]

Needs torchdata (`pip install torchdata==0.11.0` in a throw-away environment: it is not a dependency of the
project). The verdict and the figures are in docs/benchmarks.md ("Data loader").
"""
import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hcstudy.config import parse_config
from hcstudy.data import GPT2Tokenizer, RankBatches, resolve_data_files
from bench_loader import measure  # noqa: E402

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:
    sys.exit("bench_stateful_loader.py: needs torchdata (pip install torchdata==0.11.0)")


class StreamShares(torch.utils.data.IterableDataset):
    """One worker's share of every step (the streams _StepShares would give it), with the state methods that
    StatefulDataLoader calls inside the worker: state_dict every snapshot_every_n_steps items, shipped to the
    training process with the item; load_state_dict before iterating."""

    def __init__(self, batches: RankBatches, workers: int):
        self.recipe, self.state, self.workers, self.batches = batches.recipe, batches.state_dict(), workers, None

    def __iter__(self):
        worker = torch.utils.data.get_worker_info().id
        self.batches = RankBatches(*self.recipe)
        self.batches.load_state_dict([self.state])
        self.mine = sorted(set(self.batches.owners))[worker::self.workers]
        slots = [p for p, v in enumerate(self.batches.owners) if v in self.mine]
        while True:
            yield slots, torch.cat([self.batches.streams[self.batches.owners[p]].take(1) for p in slots])

    def state_dict(self) -> dict:
        if self.batches is None:                           # asked before the first item
            return {"streams": self.state["streams"]}
        return {"streams": {str(v): self.batches.streams[v].state_dict() for v in self.mine}}

    def load_state_dict(self, state: dict) -> None:
        self.state = {"cursor": 0, "streams": {**self.state["streams"], **state["streams"]}}


def build(data: str, streams: int, micro: int, workers: int, snapshot: int) -> StatefulDataLoader:
    files = resolve_data_files(data)
    cfg = parse_config(["--data", data, "--data-streams", str(streams), "--batch-size", str(streams * micro),
                          "--micro-batch-size", str(micro)])
    batches = RankBatches(files.train, GPT2Tokenizer(), cfg, 0, 1, micro, files.held_out_slice)
    return StatefulDataLoader(StreamShares(batches, workers), batch_size=None, num_workers=workers,
                              snapshot_every_n_steps=snapshot, prefetch_factor=2)


def steps(loader: StatefulDataLoader, count: int, workers: int) -> list[torch.Tensor]:
    """`count` whole steps: the workers' shares put back in batch order, as Loader does."""
    shares, out = iter(loader), []
    for _ in range(count):
        parts = [next(shares) for _ in range(workers)]
        windows = torch.empty(sum(len(slots) for slots, _ in parts), parts[0][1].shape[1], dtype=torch.long)
        for slots, part in parts:
            windows[slots] = part
        out.append(windows)
    return out


def resume_is_exact(args, snapshot: int) -> bool:
    make = functools.partial(build, args.data, args.streams, args.micro, args.workers, snapshot)
    reference = steps(make(), 14, args.workers)
    first = make()
    seen = steps(first, 7, args.workers)
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    seen += steps(resumed, 7, args.workers)
    return all(torch.equal(a, b) for a, b in zip(seen, reference))


def resume_with_other_workers(args) -> str:
    first = build(args.data, args.streams, args.micro, args.workers, 1)
    steps(first, 3, args.workers)
    resumed = build(args.data, args.streams, args.micro, 1, 1)
    try:
        resumed.load_state_dict(first.state_dict())
        steps(resumed, 1, 1)
    except Exception as error:
        return f"refused ({type(error).__name__})"
    return "accepted"


def tokens_per_second(args, snapshot: int) -> tuple[float, float]:
    loader = build(args.data, args.streams, args.micro, args.workers, snapshot)
    shares = iter(loader)
    for _ in range(args.workers * 2):                     # warm-up: every stream opened, its buffer filled
        next(shares)
    started, cpu_started, tokens = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - started < args.seconds:
        tokens += next(shares)[1][:, :-1].numel()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return tokens / elapsed, cpu / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="sample")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--snapshot-every", type=int, nargs="+", default=[1, 1000])
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    for snapshot in args.snapshot_every:
        print(f"StatefulDataLoader, snapshot every {snapshot}: resume exact {resume_is_exact(args, snapshot)}")
    print(f"StatefulDataLoader state of {args.workers} workers loaded with 1: {resume_with_other_workers(args)}")
    for snapshot in args.snapshot_every:
        delivered, cpu = tokens_per_second(args, snapshot)
        print(f"StatefulDataLoader, snapshot every {snapshot}: {delivered:,.0f} tokens/s, training process "
              f"{cpu:.3f} CPU s per M tokens")
    delivered, cpu = measure(args.data, args.streams, args.seconds, args.micro, args.workers)
    print(f"Loader ({args.workers} processes): {delivered:,.0f} tokens/s, training process {cpu:.3f} CPU s "
          f"per M tokens")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
