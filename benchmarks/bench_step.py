"""Step time of the baseline, HC and mHC at one config: what the n residual streams cost.

    python benchmarks/bench_step.py                          # CPU fp32, widths 256 and 512, depth 4, seq 256, B 8, n 4
    python benchmarks/bench_step.py --compile                # the same with torch.compile per block
    python benchmarks/bench_step.py --kernels reference,fused   # HC and mHC on both paths, each against its baseline
    python benchmarks/bench_step.py --device cuda --dtype bf16 --width 2048 --depth 8 --seq 1024 --record notes.md
    python benchmarks/bench_step.py --memory                 # saved-activation bytes, with and without checkpointing
    python benchmarks/bench_step.py --smoke                  # CI: a tiny model, two steps, no timing claims

One step is what the trainer does per optimizer step with one micro-batch: forward under the run's autocast,
backward, pre-clip gradient norm, AdamW step. The models are built with train_c4.parse_config + train_c4.GPT,
so the real code is measured. Variants are timed in interleaved rounds (baseline, hc, mhc, baseline, ...), so
that load from other processes hits all of them alike; warm-up (and compilation) is excluded, every timed step
is bracketed by a device synchronize, and the median step is reported with its spread. Each width is a run of its
own; with the step times it reports what one forward saves for the backward (activation memory) per variant.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hcstudy.planner import gpus  # noqa: E402
from hcstudy.run_record import device_name  # noqa: E402
from hcstudy import config, metrics, model, optim  # noqa: E402
from hcstudy.distributed import compute_dtype  # noqa: E402
from hcstudy.kernels import choice  # noqa: E402

# the trainer under test, read by name as --against reads an older train_c4.py
T = types.SimpleNamespace(Config=config.Config, parse_config=config.parse_config, GPT=model.GPT, choice=choice,
                          compute_dtype=compute_dtype, count_parameters=model.count_parameters,
                          decay_groups=optim.decay_groups, instability_probe=metrics.instability_probe,
                          kernel_path=model.kernel_path, make_optimizer=optim.make_optimizer,
                          padded_vocab_size=model.padded_vocab_size)

VARIANTS = ("baseline", "hc", "mhc")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="autocast dtype, as the trainer's --dtype")
    p.add_argument("--width", default="256,512", help="model width, or a comma-separated list: one run per width")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=0, help="attention heads (0: width / 64, per width)")
    p.add_argument("--seq", type=int, default=256, help="sequence length")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per step")
    p.add_argument("--n", type=int, default=4, help="streams of HC and mHC (--expansion)")
    p.add_argument("--tokenizer", choices=("gpt2", "byte"), default="byte",
                   help="vocabulary: byte (256: the body dominates the step, as in the large models) or gpt2 "
                   "(50304: at width 512 its head is 2/3 of the FLOPs and dilutes the stream cost)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of baseline,hc,mhc")
    p.add_argument("--compile", action="store_true", help="torch.compile each block, as the trainer's --compile")
    p.add_argument("--kernels", default="auto",
                   help="the trainer's --kernels (auto, reference, fused), or a comma-separated list: every variant "
                   "once per path, labelled @path, timed interleaved (the baseline too: its two runs show the noise)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant (compile happens here)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the variants")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    p.add_argument("--metrics-every", type=int, default=50, help="probe interval whose share of a step is reported")
    p.add_argument("--probe-sequences", type=int, default=8, help="sequences in the probe batch (trainer default 8)")
    p.add_argument("--no-probe", action="store_true", help="skip the instability-probe timing")
    p.add_argument("--memory", action="store_true",
                   help="measure saved-activation bytes with and without activation checkpointing (no timing)")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="print a torch.profiler table (top ROWS ops by self time) of one step per variant, no timing")
    p.add_argument("--explain", action="store_true",
                   help="torch._dynamo.explain on one block per variant (training and probe call): graphs, breaks")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--smoke", action="store_true", help="tiny model, a couple of steps, no timing claims (CI)")
    p.add_argument("--against", metavar="LABEL=PATH", action="append", default=[],
                   help="also time the variants built by another train_c4.py (e.g. before=/tmp/old.py, from "
                   "`git show REV:train_c4.py`), interleaved with the current ones; repeatable")
    p.add_argument("--record", type=Path, metavar="FILE", help="append the result as a markdown table row (date, "
                   "machine, command, numbers, load) to FILE: a notebook of runs; docs/benchmarks.md keeps the "
                   "figures that hold now, each with its command")
    p.add_argument("--note", default="", help="a word on the code state, written into the recorded row")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line as well")
    args = p.parse_args(argv)
    args.widths = [int(w) for w in args.width.split(",")]
    if args.smoke:
        args.widths, args.depth, args.heads, args.seq, args.micro_batch = [32], 2, 2, 16, 2
        args.tokenizer, args.warmup, args.rounds, args.steps, args.probe_sequences = "byte", 1, 1, 1, 2
    args.heads_given = args.heads
    at_width(args, args.widths[0])
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not args.kernels or not set(args.kernels) <= {"auto", "reference", "fused"} \
            or len(set(args.kernels)) < len(args.kernels):
        p.error("--kernels must be distinct values of auto,reference,fused")
    if not set(args.variants) <= set(VARIANTS) or not args.variants:
        p.error(f"--variants must be a subset of {','.join(VARIANTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device")
    return args


def at_width(args, width: int) -> None:
    args.width, args.heads = width, args.heads_given or max(1, width // 64)


def config(args, residual: str, checkpointing: bool | None = None, module=T, kernels: str | None = None) -> T.Config:
    argv = ["--residual", residual, "--depth", str(args.depth), "--width", str(args.width), "--heads", str(args.heads),
            "--seq-len", str(args.seq), "--tokenizer", args.tokenizer,
            "--micro-batch-size", str(args.micro_batch), "--batch-size", str(args.micro_batch),
            "--dtype", args.dtype, "--probe-sequences", str(args.probe_sequences)]
    if args.activation_checkpointing if checkpointing is None else checkpointing:
        argv.append("--activation-checkpointing")
    if args.compile:
        argv.append("--compile")
    if residual != "baseline":      # the streams' settings: the trainer refuses them for the baseline, which has none
        argv += ["--expansion", str(args.n)]
    if (kernels or args.kernels[0]) != "auto" and residual != "baseline":   # older trainers: only their one path
        argv += ["--kernels", kernels or args.kernels[0]]
    return module.parse_config(argv)


def build_model(cfg: T.Config, device: torch.device, module=T, use_flash: bool = False):
    """The trainer's GPT on the kernel path a run of it would take on this device."""
    if module is T:
        return T.GPT(cfg, use_flash, T.kernel_path(cfg, device)[0])
    if hasattr(module, "use_fused_kernels"):                # a revision that chose the path in the trainer
        return module.GPT(cfg, use_flash, module.use_fused_kernels(cfg, device))
    return module.GPT(cfg, use_flash)


def trainers(args) -> list[tuple[str, object, str]]:
    """(label, trainer module, --kernels) for each set of variants: this trainer once per --kernels path (labelled by
    it when there are several), then each --against trainer on its own default path."""
    current = [("", T, args.kernels[0])] if len(args.kernels) == 1 else [(k, T, k) for k in args.kernels]
    return current + [(*load_trainer(a), "auto") for a in args.against]


def load_trainer(label_path: str):
    label, _, path = label_path.partition("=")
    spec = importlib.util.spec_from_file_location(f"train_c4_{label}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                                  # dataclasses look their module up
    spec.loader.exec_module(module)
    return label, module


class Variant:
    """One model with its optimizer and a fixed batch, stepped exactly like the trainer's optimizer step."""

    def __init__(self, cfg: T.Config, device: torch.device, module=T, label: str = ""):
        T = module                                                      # noqa: N806 (the trainer under test)
        self.residual, self.label, self.device, self.T = cfg.residual, label, device, module
        self.name = cfg.residual + (f"@{label}" if label else "")
        self.cfg, self.dtype = cfg, T.compute_dtype(cfg, device)
        torch.manual_seed(0)
        # the trainer's attention kernel: flash-attn on CUDA in bf16 when installed, SDPA otherwise. Built where
        # it runs: a 2.5B-parameter model initialised on the host first would take minutes
        with torch.device(device):
            self.model = build_model(cfg, device, T, T.choice.use_flash_attention(cfg, device, self.dtype))
        if cfg.compile:
            # every block of every variant here shares Block.forward's code object, and dynamo allows 8 graphs
            # per code object: 3 variants x (training, probe) x trainers would fall back to eager silently.
            # A run of the trainer holds one model (training, evaluation and probe graphs: 3).
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            for block in self.model.blocks:
                block.compile()
        if hasattr(T, "make_optimizer"):
            self.optimizer = T.make_optimizer(self.model, cfg)
        else:                                                           # a trainer from before make_optimizer
            self.optimizer = torch.optim.AdamW(T.decay_groups(self.model, cfg.weight_decay), lr=cfg.lr,
                                               betas=(0.9, 0.95), fused=device.type == "cuda")
        vocab = T.padded_vocab_size(cfg.tokenizer)
        generator = torch.Generator().manual_seed(1)
        self.idx = torch.randint(0, vocab, (cfg.batch_size, cfg.seq_len), generator=generator).to(device)
        self.probe_idx = torch.randint(0, vocab, (cfg.probe_sequences, cfg.seq_len), generator=generator).to(device)
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.params = T.count_parameters(cfg)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16)

    def step(self) -> None:
        with self.autocast():
            _, loss = self.model(self.idx, self.idx)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def probe(self) -> None:
        self.T.instability_probe(self.model, self.probe_idx, self.autocast, with_layers=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process). On a shared CPU the CPU time is the steadier measure at one
    thread: it does not count the time other processes hold the core (with more threads it counts spin-waits)."""
    sync(device)
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    return time.perf_counter() - start, time.process_time() - start_cpu


def spread(values: list[float]) -> float:
    """Half the inter-quartile range relative to the median: the +- noise of one timed step."""
    if len(values) < 4:
        return (max(values) - min(values)) / 2 / statistics.median(values)
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / 2 / statistics.median(values)


def run_timing(args, device: torch.device) -> dict:
    labelled = trainers(args)
    variants = [Variant(config(args, name, module=module, kernels=kernels), device, module, label)
                for label, module, kernels in labelled for name in args.variants]
    compile_s = {}
    for v in variants:
        compile_s[v.name] = round(sum(timed(v.step, device)[0] for _ in range(args.warmup)), 2)
    per_round = []
    for _ in range(args.rounds):
        round_median = {}
        for v in variants:
            times = [timed(v.step, device) for _ in range(args.steps)]
            v.times += [wall for wall, _ in times]
            v.cpu_times += [cpu for _, cpu in times]
            round_median[v.name] = statistics.median(wall for wall, _ in times)
        per_round.append(round_median)
    tokens = args.micro_batch * args.seq
    peak = gpus.gpu_peak_flops(device_name(device))      # None on CPU and unknown GPUs: mfu null
    out = {"variants": {}, "warmup_s": compile_s}
    for v in variants:
        ms = statistics.median(v.times) * 1e3
        tok_s = tokens / (ms / 1e3)
        out["variants"][v.name] = {
            "ms_per_step": round(ms, 2), "tokens_per_s": round(tok_s, 1), "noise": round(spread(v.times), 3),
            "cpu_ms_per_step": round(statistics.median(v.cpu_times) * 1e3, 2),
            "cpu_noise": round(spread(v.cpu_times), 3), "fastest_ms": round(min(v.times) * 1e3, 2),
            "mfu": round(tok_s * gpus.flops_per_token(v.cfg, v.params) / peak, 4) if peak else None}
    for label, _, _ in labelled if "baseline" in args.variants else []:
        at = f"@{label}" if label else ""
        base = out["variants"]["baseline" + at]["ms_per_step"]
        for name in ("hc", "mhc"):
            if name in args.variants:
                ratios = [r[name + at] / r["baseline" + at] for r in per_round]
                out[f"{name}/baseline{at}"] = round(out["variants"][name + at]["ms_per_step"] / base, 3)
                out[f"{name}/baseline{at}_rounds"] = [round(min(ratios), 3), round(max(ratios), 3)]
                # other processes only ever slow a step down: the fastest steps are the least disturbed ones
                out[f"{name}/baseline{at}_fastest"] = round(out["variants"][name + at]["fastest_ms"]
                                                            / out["variants"]["baseline" + at]["fastest_ms"], 3)
                out[f"{name}/baseline{at}_cpu"] = round(out["variants"][name + at]["cpu_ms_per_step"]
                                                       / out["variants"]["baseline" + at]["cpu_ms_per_step"], 3)
    saved = {name: saved_activation_bytes(args, name, False, device) for name in args.variants}
    out["saved_mb"] = {name: round(b / 2**20, 1) for name, b in saved.items()}
    if not args.no_probe:
        for v in variants:
            v.probe()                                    # warm (and, compiled, recompile for eval/no-grad)
            probe_ms = statistics.median(timed(v.probe, device)[0] for _ in range(max(3, args.rounds))) * 1e3
            share = probe_ms / (args.metrics_every * out["variants"][v.name]["ms_per_step"])
            out["variants"][v.name] |= {"probe_ms": round(probe_ms, 2), "probe_share": round(share, 5)}
    return out


def saved_activation_bytes(args, residual: str, checkpointing: bool, device: torch.device) -> int:
    """Bytes that one forward keeps for the backward: every tensor saved by autograd (pack hook) plus the
    inputs that activation checkpointing holds to recompute from, deduplicated by storage; parameters excluded."""
    cfg = config(args, residual, checkpointing)
    torch.manual_seed(0)
    model = build_model(cfg, device).to(device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, torch.UntypedStorage] = {}

    def keep(t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.nbytes():
            storages[s.data_ptr()] = s                    # holding the storage stops its address being reused

    def pack(t):
        keep(t)
        return t

    # the checkpoints hold the connections' inputs (the formulas) or the sublayers' (the kernels' paths: Block)
    held = [m for b in model.blocks for m in (b.attn_conn, b.mlp_conn) + ((b.attn, b.mlp) if b.checkpointed ==
                                                                            "sublayer" else ())]
    hooks = [m.register_forward_pre_hook(lambda mod, inp: keep(inp[0])) for m in held]
    idx = torch.randint(0, T.padded_vocab_size(cfg.tokenizer), (args.micro_batch, cfg.seq_len), device=device)
    dtype = T.compute_dtype(cfg, device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = model(idx, idx)
    for h in hooks:
        h.remove()
    loss.backward()                                       # checks the graph is whole
    return sum(s.nbytes() for s in storages.values())


def run_memory(args, device: torch.device) -> dict:
    out = {}
    for name in args.variants:
        plain = saved_activation_bytes(args, name, False, device)
        ckpt = saved_activation_bytes(args, name, True, device)
        out[name] = {"saved_mb": round(plain / 2**20, 1), "saved_mb_checkpointed": round(ckpt / 2**20, 1),
                     "saving": round(1 - ckpt / plain, 3)}
    return out


def run_profile(args, device: torch.device) -> int:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name in args.variants:
        v = Variant(config(args, name), device)
        for _ in range(args.warmup):
            v.step()
        sync(device)
        with profile(activities=activities) as prof:
            v.step()
            sync(device)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(f"== {name}: one step ==")
        print(prof.key_averages().table(sort_by=sort, row_limit=args.profile, max_name_column_width=40))
    return 0


def run_explain(args, device: torch.device) -> int:
    """What --compile's block.compile() gets: the graphs and graph breaks of one block, for a training call
    (grad on) and for the instability probe's call (no grad, eval, return_mixing with the states)."""
    for name in args.variants:
        cfg = config(args, name)
        model = build_model(cfg, device).to(device)
        x = torch.randn(args.micro_batch, cfg.seq_len, model.streams, cfg.width, device=device, requires_grad=True)
        for call, kwargs in (("training", {}), ("probe", {"return_mixing": True, "with_states": True})):
            torch._dynamo.reset()
            block = model.blocks[0].train(call == "training")
            with torch.set_grad_enabled(call == "training"):
                e = torch._dynamo.explain(block)(x, **kwargs)
            reasons = "; ".join(r.reason for r in e.break_reasons) or "none"
            print(f"{name:>8} {call:>8}: graphs {e.graph_count}, graph breaks {e.graph_break_count}, "
                  f"ops {e.op_count}, break reasons: {reasons}")
    return 0


def machine(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
        cpu = model
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{cpu} ({os.cpu_count()} cores), {threads} thread{'s' * (threads > 1)}"
    return f"{where}; {platform.system()}, Python {platform.python_version()}, torch {torch.__version__}"


def record_row(args, result: dict, device: torch.device, command: str) -> str:
    v = result.get("variants", {})

    def cell(name, key, fmt="{:.1f}"):
        value = v.get(name, {}).get(key)
        return "-" if value is None else fmt.format(value)

    mode = "compile" if args.compile else "eager"
    config_text = (f"{args.dtype} w{args.width} d{args.depth} T{args.seq} B{args.micro_batch} n{args.n} "
                   f"{args.tokenizer} {mode}{' ckpt' if args.activation_checkpointing else ''}"
                   f"{'; ' + args.note if args.note else ''}")
    if "memory" in result:
        numbers = "; ".join(f"{k} {m['saved_mb']} -> {m['saved_mb_checkpointed']} MB ({m['saving']:.0%} saved)"
                            for k, m in result["memory"].items())
    else:
        numbers = " / ".join(f"{name} {cell(name, 'ms_per_step')} ms ±{100 * v[name]['noise']:.0f}% "
                             f"(cpu {cell(name, 'cpu_ms_per_step')} ms ±{100 * v[name]['cpu_noise']:.0f}%, "
                             f"{cell(name, 'tokens_per_s', '{:.0f}')} tok/s)" for name in v)
        ratios = ", ".join(f"**{k} {result[k]}** (rounds {result[k + '_rounds'][0]}-{result[k + '_rounds'][1]}; "
                           f"cpu {result[k + '_cpu']}; fastest {result[k + '_fastest']})" for k in ratio_keys(result))
        probe = ", ".join(f"{name} {100 * v[name]['probe_share']:.2f}%" for name in v if "probe_share" in v[name])
        mfu = ", ".join(f"{name} {v[name]['mfu']:.1%}" for name in v if v[name]["mfu"] is not None)
        numbers += (f"; ratios: {ratios or '-'}; probe share @{args.metrics_every}: {probe or '-'}; "
                    f"MFU: {mfu or 'null'}; saved activations: {memory_text(result['saved_mb'])}")
    load = result.get("load", "")
    return (f"| {datetime.date.today().isoformat()} | {machine(device)} | `{command}` | {config_text} | {numbers} "
            f"| {load} |\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    argv = argv if argv is not None else sys.argv[1:]
    shown = [a for i, a in enumerate(argv)
             if a not in ("--record", "--note") and (i == 0 or argv[i - 1] not in ("--record", "--note"))]
    command = "python benchmarks/bench_step.py " + " ".join(shown)
    for width in args.widths:
        at_width(args, width)
        if args.profile:
            run_profile(args, device)
        elif args.explain:
            run_explain(args, device)
        else:
            run_width(args, device, command)
    return 0


def run_width(args, device: torch.device, command: str) -> None:
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = {"config": {k: getattr(args, k) for k in ("device", "dtype", "width", "depth", "heads", "seq",
                                                        "micro_batch", "n", "tokenizer", "compile",
                                                        "activation_checkpointing")}}
    if args.memory:
        result["memory"] = run_memory(args, device)
    else:
        result |= run_timing(args, device)
    if load_before is not None:
        result["load"] = f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    print(render(args, result))
    if args.json:
        print(json.dumps(result))
    if args.record and not args.smoke:
        with open(args.record, "a") as f:
            f.write(record_row(args, result, device, command.strip()))
        print(f"recorded in {args.record}")


def memory_text(saved_mb: dict) -> str:
    base = saved_mb.get("baseline")
    return ", ".join(f"{name} {mb} MB" + (f" ({mb / base:.2f}x baseline)" if base and name != "baseline" else "")
                     for name, mb in saved_mb.items())


def ratio_keys(result: dict) -> list[str]:
    return [k for k in result if "/baseline" in k and not k.endswith(("_rounds", "_cpu", "_fastest"))]


def render(args, result: dict) -> str:
    lines = [f"config: {result['config']}" + ("  (smoke: no timing claims)" if args.smoke else "")]
    if "memory" in result:
        for name, m in result["memory"].items():
            lines.append(f"{name:>8}: saved activations {m['saved_mb']:8.1f} MB, with checkpointing "
                         f"{m['saved_mb_checkpointed']:8.1f} MB ({m['saving']:.1%} saved)")
    else:
        for name, v in result["variants"].items():
            probe = f", probe {v['probe_ms']:.1f} ms = {100 * v['probe_share']:.2f}% of {args.metrics_every} steps" \
                if "probe_ms" in v else ""
            mfu = "null" if v["mfu"] is None else f"{v['mfu']:.1%}"
            lines.append(f"{name:>15}: {v['ms_per_step']:9.2f} ms/step ±{100 * v['noise']:.0f}% "
                         f"(cpu {v['cpu_ms_per_step']:9.2f} ms ±{100 * v['cpu_noise']:.0f}%) "
                         f"{v['tokens_per_s']:10.0f} tokens/s  MFU {mfu}  (warm-up {result['warmup_s'][name]} s)"
                         f"{probe}")
        for k in ratio_keys(result):
            lo, hi = result[k + "_rounds"]
            lines.append(f"{k}: {result[k]:.3f} wall (per-round ratios {lo:.3f} .. {hi:.3f}), "
                         f"{result[k + '_cpu']:.3f} cpu time, {result[k + '_fastest']:.3f} fastest steps")
        lines.append(f"saved activations: {memory_text(result['saved_mb'])}")
    if "load" in result:
        lines.append(result["load"])
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
