"""Tokens per second that one process's data loader delivers (read gzip shards, parse, shuffle,
tokenize with GPT-2 BPE, pack into windows), against what one H100 consumes at depth 32.

    python benchmarks/bench_loader.py [--data sample] [--seconds 20] [--streams 8] [--workers 0]

--workers 0 measures the loader thread of the training process, --workers N N loader processes
(--data-workers); both deliver the same batches.

Results are kept by hand in docs/benchmarks.md ("Data loader"), with the command and the machine.
"""
import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hcstudy.planner import gpus  # noqa: E402
from hcstudy.config import parse_config
from hcstudy.data import GPT2Tokenizer, RankBatches, make_loader, resolve_data_files
from hcstudy.model import count_parameters

H100_BF16_PEAK, REALISTIC_MFU = 989e12, 0.40


def gpu_tokens_per_second(depth: int) -> float:
    """What one H100 consumes at a realistic 40% MFU for the C4 model of this depth."""
    cfg = parse_config(["--depth", str(depth)])
    flops = gpus.flops_per_token(cfg, count_parameters(cfg))
    return H100_BF16_PEAK * REALISTIC_MFU / flops


def measure(data: str, streams: int, seconds: float, micro: int, workers: int) -> tuple[float, float]:
    """(tokens/s delivered, CPU seconds the training process spends per million tokens: with a thread the
    reading and tokenizing, with loader processes only the receiving)."""
    files = resolve_data_files(data)
    cfg = parse_config(["--data", data, "--data-streams", str(streams), "--batch-size", str(streams * micro),
                          "--micro-batch-size", str(micro)])
    loader = RankBatches(files.train, GPT2Tokenizer(), cfg, rank=0, world=1, micro=micro,
                           skip_held_out=files.held_out_slice)
    loader = make_loader(loader, dataclasses.replace(cfg, data_workers=workers), pin_memory=False)
    for _ in range(streams):                       # warm-up: every stream opened and its buffer filled
        loader.next_batch()
    started, cpu_started, batches = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - started < seconds:
        loader.next_batch()
        batches += 1
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    loader.close()
    tokens = batches * micro * cfg.seq_len
    return tokens / elapsed, cpu / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="sample")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--workers", type=int, default=0, help="loader processes (0: a thread)")
    args = parser.parse_args()
    delivered, cpu_per_million = measure(args.data, args.streams, args.seconds, args.micro, args.workers)
    consumed = gpu_tokens_per_second(32)
    how = f"{args.workers} loader process(es)" if args.workers else "loader thread"
    print(f"loader: {delivered:,.0f} tokens/s per training process (GPT-2 BPE, {args.streams} streams, {how}); "
          f"the training process spends {cpu_per_million:.3f} CPU s per million tokens")
    print(f"one H100 at depth 32 and 40% MFU consumes {consumed:,.0f} tokens/s: ratio {delivered / consumed:.1f}x")


if __name__ == "__main__":
    main()
