"""Planned against measured memory of one GPU: the allocated peak that `train_c4.py --estimate` plans, beside
torch.cuda.max_memory_allocated over real optimizer steps of the real model, depth by depth.

    python benchmarks/bench_memory.py --depths 8,16,32 --residual mhc --micro-batch 4     # needs CUDA
    python benchmarks/bench_memory.py --smoke                                             # CPU: the code path only

Each step is bench_step.py's, the trainer's in one process: the model built by train_c4.GPT (activation
checkpointing and --compile as the trainer's defaults), bf16 autocast, forward and backward, gradient
clipping and a fused AdamW step. The plan's overheads (context, fragmentation) are not in its
allocated peak, so the ratio measured/planned checks the measured terms alone. Results are kept by hand in
docs/benchmarks.md with the command and the machine.
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hcstudy.planner import memory as memory_module  # noqa: E402
from hcstudy.run_record import device_name  # noqa: E402
from hcstudy.config import Config, parse_config
from hcstudy.model import GPT
from bench_step import Variant  # noqa: E402
from hcstudy.planner.memory import GiB  # noqa: E402


def measured_peak(cfg: Config, micro: int, device: torch.device, steps: int = 2) -> float | None:
    """Bytes torch.cuda.max_memory_allocated shows over `steps` optimizer steps (None on the CPU)."""
    variant = Variant(dataclasses.replace(cfg, batch_size=micro), device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        variant.step()
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    del variant
    torch.cuda.empty_cache()
    return peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="8,16,32")
    parser.add_argument("--residual", choices=("baseline", "hc", "mhc"), default="mhc")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: the code path, no claims")
    args = parser.parse_args(argv)
    if not (args.smoke or torch.cuda.is_available()):
        parser.error("needs a CUDA device (the real models would not fit in this machine's memory); --smoke on the CPU")
    device = torch.device("cpu" if args.smoke else "cuda")
    rows = []
    for depth in map(int, args.depths.split(",")):
        preset = ["--preset", "tiny"] if args.smoke else []
        cfg = parse_config([*preset, "--depth", str(depth), "--residual", args.residual])
        micro = min(args.micro_batch, cfg.batch_size)
        memory = memory_module.memory_plan(GPT, cfg, micro)
        peak = measured_peak(cfg, micro, device)
        rows.append({"depth": depth, "residual": args.residual, "micro_batch": micro,
                     "planned_allocated_gib": round(memory.allocated / GiB, 2),
                     "planned_total_gib": round(memory.total / GiB, 2), "card_gib": round(memory.card / GiB, 1),
                     "measured_peak_gib": None if peak is None else round(peak / GiB, 2),
                     "measured_over_planned": None if peak is None else round(peak / memory.allocated, 3)})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": device_name(device),
                                         "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
