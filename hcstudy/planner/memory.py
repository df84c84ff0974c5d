"""plan.py: the planner beside the trainer. Will a run fit on a GPU, which micro-batch, how long, what it costs.

    python train_c4.py --estimate --depth 48        # the size, the memory plan of one GPU and the time of one run
    bash run_experiments.sh --dry-run               # every job of the matrix planned for the node, wall time, cost

Never imports train_c4 (the trainer imports this file): where a plan needs the model, the caller passes the model
class (train_c4.GPT) as `gpt`, and configs are train_c4.Config objects. docs/planning.md says how each term is
derived, what is measured and what is assumed.
Parts, in file order: the GPUs (peak, memory), FLOPs per token; the memory plan (activations measured on tiny
models on the CPU); the micro-batch (auto's search and its one real trial); --estimate's text; the time of a run
(per method, with evaluation, probes and checkpoint writes, as a range); the launcher's check of every job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hcstudy.contract import EXIT_BAD_CONFIG
from hcstudy.kernels import choice


class PlanError(Exception):
    """A batch split or micro-batch that cannot work: one line, and the trainer's exit code for bad settings."""
    exit_code = EXIT_BAD_CONFIG


# ----------------------------------------------------------------------------------------------
# the GPUs: peak, memory; FLOPs per token

# dense bf16 peak of one GPU (NVIDIA's spec sheets: half the figure "with sparsity"), for MFU, keyed by the
# exact name torch.cuda.get_device_name and nvidia-smi report: the three H100s differ by a third, so a
# GPU not listed gets mfu = null rather than a neighbour's peak
GPU_PEAK_BF16_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,            # H100 SXM
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,                      # H200 SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA L40S": 362e12,
}
# the memory of each card (spec sheet, GB as GiB: PyTorch shows a little less, 79.2 of an H100's 80), planned
# against where the card is named but not visible (the launcher's dry run, nvidia-smi on another node)
GPU_MEMORY_GIB = {
    "NVIDIA H100 80GB HBM3": 80, "NVIDIA H100 PCIe": 80, "NVIDIA H100 NVL": 94, "NVIDIA H200": 141,
    "NVIDIA H200 NVL": 141, "NVIDIA GH200 480GB": 96, "NVIDIA A100-SXM4-40GB": 40, "NVIDIA A100-SXM4-80GB": 80,
    "NVIDIA A100-PCIE-40GB": 40, "NVIDIA A100 80GB PCIe": 80, "NVIDIA B200": 180, "NVIDIA L40S": 48,
}
# the documented node's GPU (README: 8 x H100 SXM), what a plan assumes where no GPU can be asked
ASSUMED_GPU = "NVIDIA H100 80GB HBM3"


def flops_per_token(cfg: Config, non_embedding_params: int) -> float:
    # 6N for the weight matmuls (forward + backward) + 12 * depth * width * seq_len for attention (PaLM)
    return 6 * non_embedding_params + 12 * cfg.depth * cfg.width * cfg.seq_len


def gpu_peak_flops(name: str) -> float | None:
    """The dense bf16 peak of the device named `name` (device_name), None where it is not known."""
    return GPU_PEAK_BF16_FLOPS.get(name)


# ----------------------------------------------------------------------------------------------
# the memory one GPU needs: parameters exactly, activations measured on tiny models, overheads assumed

GiB = 2 ** 30
DEFAULT_GPU_MEMORY_GIB = 80.0   # the card planned for when no CUDA device is visible (an H100 80GB shows 79.2)
# Framework overhead per process, assumed (it cannot be measured without a GPU): the CUDA context with the
# cuBLAS workspaces and the kernels of the first step (0.5-1 GiB on an H100), NCCL's buffers when there are
# peers, and the caching allocator's fragmentation (reserved minus allocated) as a share of the allocated
# peak: a few per cent when every step repeats the same shapes
CUDA_CONTEXT_BYTES, NCCL_BYTES, FRAGMENTATION = 1.0 * GiB, 1.0 * GiB, 0.05
AUTO_MARGIN = 0.05      # auto fills at most 95% of the card by the plan: a model of the memory, not a measurement
CPU_AUTO_MICRO = 8      # auto on the CPU, where there is no device memory to plan against
# grad_fn nodes that only view or cast: followed from a saved tensor, they lead to the parameter that
# autocast copied to bf16 (memory per model, not per token)
_VIEW_OR_CAST = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
                 "UnsqueezeBackward0", "ExpandBackward0", "UnsafeViewBackward0"}


class _CudaAutocastOnCpu(torch.overrides.TorchFunctionMode):
    """CPU autocast with CUDA's casting policy where the two differ for this model: on CUDA, layer_norm and
    sum run in fp32 (a bf16 input and weights are cast, and layer_norm saves the fp32 copy); the CPU keeps bf16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (torch.is_autocast_enabled("cpu") and args and isinstance(args[0], torch.Tensor)
                and args[0].dtype == torch.bfloat16):
            if func is F.layer_norm:                # every floating argument, the weights too, in fp32
                args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.float() if t.is_floating_point() else t,
                                                    (args, kwargs))
            elif func in (torch.sum, torch.Tensor.sum) and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_autocast(enabled: bool = True):
    """bf16 autocast on the CPU with CUDA's policy (_CudaAutocastOnCpu): what a GPU run saves and moves."""
    with _CudaAutocastOnCpu() if enabled else contextlib.nullcontext(), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
        yield


class _SavedTensorCounter:
    """Saved-tensor and module hooks that add up, by the module being run, the bytes autograd keeps."""

    def __init__(self, model: nn.Module):
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.param_storage = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen, self.counts, self.casts, self.where = set(), {}, set(), ["other"]

    def count(self, t: torch.Tensor, label) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() in self.seen or storage.data_ptr() in self.param_storage or storage.nbytes() == 0:
            return
        self.seen.add(storage.data_ptr())
        fn = t.grad_fn
        while fn is not None and type(fn).__name__ in _VIEW_OR_CAST:
            fn = fn.next_functions[0][0]
        if id(getattr(fn, "variable", None)) in self.names:
            self.casts.add(self.names[id(fn.variable)])
        else:
            label = "loss" if type(t.grad_fn).__name__ == "LogSoftmaxBackward0" else label
            self.counts[label] = self.counts.get(label, 0) + storage.nbytes()

    def pack(self, t):
        self.count(t, self.where[-1])
        return t

    def enter(self, label, checkpointed=False):
        def hook(module, args):
            self.where.append(label)
            if checkpointed:
                self.count(args[0], label)       # non-reentrant checkpointing keeps the sublayer's input alive
        return hook

    def leave(self, module, args, output):
        self.where.pop()


def saved_bytes(model: nn.Module, idx: torch.Tensor, bf16: bool) -> dict:
    """The bytes one training forward keeps for the backward pass, by where they were saved: (block, 'attn' or
    'mlp', 'body' or 'streams'), 'loss' (the log-probabilities) or 'other' (embedding, collapse, head); with
    activation checkpointing, the sublayer inputs the checkpoints hold. Measured with saved-tensor hooks on the
    CPU, each storage counted once; parameters are not counted, 'weight_casts' names those autocast copied."""
    counter, handles = _SavedTensorCounter(model), []
    for i, block in enumerate(model.blocks):
        for part in ("attn", "mlp"):
            conn, body = getattr(block, f"{part}_conn"), getattr(block, part)
            handles += [conn.register_forward_pre_hook(counter.enter((i, part, "streams"),
                                                                     block.activation_checkpointing)),
                        body.register_forward_pre_hook(counter.enter((i, part, "body"))),
                        conn.register_forward_hook(counter.leave), body.register_forward_hook(counter.leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), cuda_autocast(bf16):
            model(idx, idx)
    finally:
        for handle in handles:
            handle.remove()
    return {**counter.counts, "weight_casts": counter.casts}


def _saved_per_token(gpt: type, cfg: Config, width: int, depth: int, bf16: bool, micro: int = 2,
                     seq_len: int = 16) -> dict:
    small = dataclasses.replace(cfg, width=width, depth=depth, seq_len=seq_len, compile=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = gpt(small)
        idx = torch.randint(0, model.wte.num_embeddings, (micro, seq_len))
        saved = saved_bytes(model, idx, bf16)
    casts = saved.pop("weight_casts")
    return {"weight_casts": casts, **{k: v / (micro * seq_len) for k, v in saved.items()}}


def profile_key(cfg: Config, checkpointing: bool) -> Config:
    """The settings activation_profile depends on, all others at their defaults: one measurement serves every
    depth, width, batch and seed (type(cfg) is train_c4.Config, so this file needs no import of it)."""
    return type(cfg)(residual=cfg.residual, expansion=cfg.expansion, heads=cfg.heads, tokenizer=cfg.tokenizer,
                     sinkhorn_iters=cfg.sinkhorn_iters, dtype="fp32" if cfg.dtype == "fp32" else "bf16",
                     activation_checkpointing=checkpointing)


@functools.cache
def activation_profile(gpt: type, profiled: Config) -> dict:
    """Activation bytes per token as (a, b) with bytes = a * width + b, measured on the real GPT on the CPU at
    widths 2 and 4 x heads (the real head count: per-head terms like attention's logsumexp are exact) and depths
    2 and 3, with the real vocabulary. Keys: 'block' (the depth difference), its parts 'attention', 'mlp' and
    'streams' (the n-stream states, mixing coefficients and the sublayer outputs written into the streams),
    'sublayer' (the larger sublayer: what checkpointing recomputes at once), 'loss' (log-probabilities),
    'rest' (embedding, expansion, collapse, head); 'weight_casts': the parameters autocast copies to bf16.
    `profiled`: profile_key's config, `gpt`: the model class (train_c4.GPT)."""
    widths, rows, bf16 = (2 * profiled.heads, 4 * profiled.heads), [], profiled.dtype != "fp32"
    for width in widths:
        d2, d3 = (_saved_per_token(gpt, profiled, width, depth, bf16) for depth in (2, 3))
        total = {name: sum(v for k, v in d.items() if k != "weight_casts") for name, d in (("d2", d2), ("d3", d3))}
        part = {(p, s): d2.get((1, p, s), 0.0) for p in ("attn", "mlp") for s in ("body", "streams")}
        row = {"block": total["d3"] - total["d2"], "loss": d2.get("loss", 0.0),
               "attention": part["attn", "body"], "mlp": part["mlp", "body"],
               "sublayer": max(part[p, "body"] + part[p, "streams"] for p in ("attn", "mlp"))}
        row["streams"] = row["block"] - row["attention"] - row["mlp"]
        row["rest"] = total["d2"] - 2 * row["block"] - row["loss"]
        rows.append(row)
    fit = {"weight_casts": frozenset(map(_any_block, d2["weight_casts"] | d3["weight_casts"]))}
    for key in rows[0]:
        a = (rows[1][key] - rows[0][key]) / (widths[1] - widths[0])
        fit[key] = (a, rows[0][key] - a * widths[0])
    return fit


def _any_block(name: str) -> str:
    """'blocks.7.attn.inner.qkv.weight' -> '*.attn.inner.qkv.weight': the same parameter in every block."""
    return ".".join(["*"] + name.split(".")[2:]) if name.startswith("blocks.") else name


def shape_key(cfg: Config) -> Config:
    """The settings the parameters' shapes depend on, all others at their defaults: building the model, even on the
    meta device, takes a second at depth 48 (its initialisation runs), so one build serves every seed and schedule."""
    return type(cfg)(residual=cfg.residual, depth=cfg.depth, width=cfg.width, heads=cfg.heads,
                     expansion=cfg.expansion, seq_len=cfg.seq_len, tokenizer=cfg.tokenizer)


def parameter_numels(gpt: type, cfg: Config) -> dict:
    """numel per parameter name (block parameters summed over the blocks as '*.attn.inner.qkv.weight'...),
    with 'total', 'tensors' and 'block' (one block's), from the model built on the meta device."""
    return _parameter_numels(gpt, shape_key(cfg))


@functools.cache
def _parameter_numels(gpt: type, cfg: Config) -> dict:
    with torch.device("meta"):
        model = gpt(cfg)
    numels = {"total": 0, "tensors": 0, "block": sum(p.numel() for p in model.blocks[0].parameters())}
    for name, p in model.named_parameters():
        numels[_any_block(name)] = numels.get(_any_block(name), 0) + p.numel()
        numels["total"] += p.numel()
        numels["tensors"] += 1
    return numels


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device, term by term (insertion order is print order); `notes` says how each was derived."""
    micro: int
    world: int
    card: float
    terms: dict
    notes: dict

    @property
    def allocated(self) -> float:
        """What torch.cuda.max_memory_allocated should show (mem_peak_gb in metrics.jsonl, in GB)."""
        return sum(v for k, v in self.terms.items() if not k.startswith("overhead"))

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def gpu_memory_bytes(cfg: Config) -> float:
    if cfg.gpu_memory_gb > 0:
        return cfg.gpu_memory_gb * GiB
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return DEFAULT_GPU_MEMORY_GIB * GiB


def memory_plan(gpt: type, cfg: Config, micro: int, world: int = 1, card: float | None = None) -> MemoryPlan:
    """The memory one GPU needs to train `cfg` at this micro-batch (dtype auto plans bf16, as on CUDA).
    Parameter terms are exact; activations are activation_profile scaled to the real width, depth and tokens."""
    bf16 = cfg.dtype != "fp32"
    fit, full = (activation_profile(gpt, profile_key(cfg, checkpointing))
                 for checkpointing in (cfg.activation_checkpointing, False))
    terms, notes = {}, {}

    def term(name: str, value: float, note: str) -> None:
        terms[name], notes[name] = value, note

    numels = parameter_numels(gpt, cfg)
    _parameter_terms(cfg, numels, world, full["weight_casts"], term)
    _activation_terms(cfg, numels["wte.weight"] // cfg.width, micro, fit, full, term)
    allocated = sum(terms.values())
    term("overhead: CUDA context", CUDA_CONTEXT_BYTES + (NCCL_BYTES if world > 1 else 0),
         "assumed: context, cuBLAS workspaces, kernels" + (", NCCL buffers" if world > 1 else ""))
    term("overhead: fragmentation", FRAGMENTATION * allocated, f"assumed: {FRAGMENTATION:.0%} of the allocated peak")
    return MemoryPlan(micro, world, gpu_memory_bytes(cfg) if card is None else card, terms, notes)


def _parameter_terms(cfg: Config, numels: dict, world: int, weight_casts: set, term) -> None:
    """Weights, gradients, AdamW, and the copies DDP, FSDP or autocast add: exact from the parameter counts."""
    P, block, shards = numels["total"], numels["block"], world if world > 1 and cfg.parallel == "fsdp" else 1
    sharded = f" / {shards} ranks" if shards > 1 else ""
    term("weights", 4 * P / shards, f"{P:,} fp32 parameters{sharded}")
    term("gradients", 4 * P / shards, f"fp32{sharded}")
    term("optimizer", 8 * P / shards + 4 * numels["tensors"],
         f"AdamW: 2 fp32 states per parameter{sharded}, a step count per tensor")
    if world > 1 and cfg.parallel == "ddp":
        term("ddp buckets", 4 * P, "DDP's all-reduce buckets: a second fp32 copy of the gradients")
    if shards > 1:
        unsharded = 2 if cfg.dtype != "fp32" else 4
        term("fsdp all-gathered", unsharded * (P - (cfg.depth - 2) * block) + (unsharded + 4) * block,
             "whole parameters of the root and of 2 blocks (running + prefetched), one block's whole gradients")
    elif cfg.dtype != "fp32":
        # autocast caches its bf16 copies until the forward ends (checkpointing or not), and the backward keeps them
        cast = sum(numels[name] for name in weight_casts)
        term("autocast weight cache", 2 * cast, f"bf16 copies of the {cast:,} matmul weights")


def _activation_terms(cfg: Config, vocab: int, micro: int, fit: dict, full: dict, term) -> None:
    """What the forward saves (`fit`: as configured; `full`: without checkpointing) and the backward's own peak."""
    C, L, tokens = cfg.width, cfg.depth, micro * cfg.seq_len
    per_token = {k: fit[k][0] * C + fit[k][1] for k in fit if k != "weight_casts"}
    if cfg.activation_checkpointing:
        term("act: checkpointed inputs", tokens * L * per_token["block"],
             f"{L} blocks x {micro} x {cfg.seq_len} tokens x {per_token['block'] / 1024:.1f} KiB (stream states held)")
    else:
        parts = ", ".join(f"{k} {per_token[k] / 1024:.1f}" for k in ("attention", "mlp", "streams"))
        term("act: blocks", tokens * L * per_token["block"],
             f"{L} blocks x {micro} x {cfg.seq_len} tokens x ({parts} KiB)")
    term("act: embedding, head", tokens * per_token["rest"],
         "embedding, n-stream expansion, collapse, final norm, head input")
    loss = tokens * per_token["loss"]
    term("act: log-probabilities", loss,
         f"fp32 log_softmax over the {vocab:,}-token vocabulary")
    # the backward's own peak on top of what is saved: the loss backward holds two more fp32 buffers of the
    # logits' size (the gradients into and out of log_softmax); with checkpointing, one sublayer is recomputed
    recompute = tokens * (full["sublayer"][0] * C + full["sublayer"][1]) if cfg.activation_checkpointing else 0.0
    term("act: backward peak", max(2 * loss, recompute),
         "one sublayer recomputed" if recompute > 2 * loss else "loss backward: 2 fp32 buffers of the logits' size")


def memory_floor(cfg: Config, vocab: int, micro: int, world: int) -> float:
    """A floor, in closed form (nothing built), of the bytes one process needs: 16 per parameter of the plain GPT
    body (fp32 weights, gradients, AdamW's two states; sharded under FSDP), per token a residual state and a sublayer
    output per block and the fp32 log-probabilities with their two backward buffers, and the validation token ids.
    The real plan (--estimate) is larger; this only has to be cheap enough to run before the first allocation."""
    C = cfg.width
    parameters = (vocab + cfg.seq_len) * C + cfg.depth * 12 * C * C
    shards = world if world > 1 and cfg.parallel == "fsdp" else 1
    activations = micro * cfg.seq_len * 4 * (2 * cfg.depth * C + 3 * vocab)
    return 16 * parameters / shards + activations + 8 * cfg.eval_batches * cfg.batch_size * (cfg.seq_len + 1)


def check_memory(cfg: Config, vocab: int, micro: int, world: int, device: torch.device) -> None:
    """memory_floor against this GPU's memory or this machine's: a run that cannot fit ends before it allocates."""
    if device.type == "cuda":
        available, where = gpu_memory_bytes(cfg), f"this GPU ({torch.cuda.get_device_name(device)})"
    else:
        available, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
    need = memory_floor(cfg, vocab, micro, world)
    if need > available:
        raise PlanError(f"this run needs at least {need / GiB:,.1f} GiB per process at micro-batch {micro}, more than "
                        f"the {available / GiB:,.1f} GiB of {where}; lower --depth, --width, --seq-len, "
                        "--micro-batch-size or --eval-batches (--estimate shows the plan)")


# ----------------------------------------------------------------------------------------------
# the micro-batch: auto's search by the plan, and on CUDA its one real trial

def check_batch_split(cfg: Config, world: int, micro: int | None = None) -> None:
    """--batch-size splits evenly over the processes and, given a micro-batch, into whole micro-batches on each."""
    if cfg.batch_size % (world * (micro or 1)):
        into = f"{world} process(es)" if micro is None else f"--micro-batch-size {micro} x {world} process(es)"
        raise PlanError(f"--batch-size {cfg.batch_size} is not divisible by {into}")


def divisors_descending(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def auto_micro_batch(gpt: type, cfg: Config, world: int, card: float | None = None) -> tuple[int, MemoryPlan]:
    """The largest micro-batch dividing the per-process batch whose plan fills at most 1 - AUTO_MARGIN of the card."""
    for micro in divisors_descending(cfg.batch_size // world):
        plan = memory_plan(gpt, cfg, micro, world, card)
        if plan.total <= (1 - AUTO_MARGIN) * plan.card:
            return micro, plan
    raise PlanError(f"micro-batch 1 already needs {plan.total / GiB:.1f} GiB of this {plan.card / GiB:.1f} GiB GPU "
                      "(see --estimate): use --activation-checkpointing, or --parallel fsdp over more GPUs")


def cpu_auto_micro_batch(cfg: Config, world: int) -> int:
    return next(d for d in divisors_descending(cfg.batch_size // world) if d <= CPU_AUTO_MICRO)


def resolve_micro_batch(gpt: type, cfg: Config, world: int, on_gpu: bool, card: float | None = None) -> tuple[int, str]:
    """The micro-batch a run uses and, for auto, why: on a GPU the largest the memory plan fits; on the CPU, where
    there is no device memory to plan against, the per-process batch capped at CPU_AUTO_MICRO."""
    check_batch_split(cfg, world)
    if cfg.micro_batch_size != "auto":
        micro, why = int(cfg.micro_batch_size), ""
    elif on_gpu:
        micro, plan = auto_micro_batch(gpt, cfg, world, card)
        why = (f"planned {plan.total / GiB:.1f} of {plan.card / GiB:.1f} GiB, at most {1 - AUTO_MARGIN:.0%} "
               "of the card; --estimate shows the plan")
    else:
        micro = cpu_auto_micro_batch(cfg, world)
        why = (f"CPU: the per-process batch {cfg.batch_size // world} capped at {CPU_AUTO_MICRO}, no GPU memory to "
               "plan against")
    check_batch_split(cfg, world, micro)
    return micro, why


def confirm_micro_batch(cfg: Config, dist, local: nn.Module, dtype: torch.dtype, micro: int) -> int:
    """--micro-batch-size auto on CUDA: one real forward and backward of `local` (the unwrapped model: no
    all-reduce in the trial) at the planned micro-batch, with the memory of AdamW's states (allocated at its first
    step) set aside; on out-of-memory, the next divisor at most half as large. Not under FSDP, whose collectives
    would hang the ranks that did not fail: the plan stands there."""
    if cfg.micro_batch_size != "auto" or dist.device.type != "cuda" or (dist.world > 1 and cfg.parallel == "fsdp"):
        return micro
    while not _fits_one_step(cfg, dist.device, local, dtype, micro):
        if micro == 1:
            raise torch.OutOfMemoryError("micro-batch 1 does not fit in one real forward and backward")
        micro = next(d for d in divisors_descending(cfg.batch_size // dist.world) if d <= micro // 2)
    if dist.world > 1:                       # every rank must use the same micro-batch
        agreed = torch.tensor(micro, device=dist.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        micro = int(agreed)
    torch.cuda.reset_peak_memory_stats(dist.device)
    if dist.is_main:
        print(f"micro-batch auto: {micro}, confirmed by one forward and backward on {torch.cuda.get_device_name()}",
              flush=True)
    return micro


def _fits_one_step(cfg: Config, device: torch.device, local: nn.Module, dtype: torch.dtype, micro: int) -> bool:
    states = idx = loss = None
    try:
        # held, not used: the room AdamW's exp_avg and exp_avg_sq take at the first optimizer step
        states = torch.empty(8 * sum(p.numel() for p in local.parameters()), dtype=torch.uint8, device=device)
        idx = torch.zeros(micro, cfg.seq_len, dtype=torch.long, device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            _, loss = local(idx, idx)
        loss.backward()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        states = idx = loss = None      # released before the next, smaller trial allocates its own
        local.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# --estimate's text

def print_memory_plan(plan: MemoryPlan) -> None:
    width = max(map(len, plan.terms)) + 2
    for key, value in plan.terms.items():
        print(f"  {key:<{width}}{value / GiB:7.2f} GiB  {plan.notes[key]}")
    short = plan.total - plan.card
    verdict = f"does NOT fit, {short / GiB:.1f} GiB short" if short > 0 else f"fits, {-short / GiB:.1f} GiB to spare"
    print(f"  {'allocated peak':<{width}}{plan.allocated / GiB:7.2f} GiB  = {plan.allocated / 1e9:.1f} GB: "
          "compare mem_peak_gb in metrics.jsonl")
    print(f"  {'total':<{width}}{plan.total / GiB:7.2f} GiB  of {plan.card / GiB:.1f} GiB: {verdict}")


def parameter_summary(params: dict) -> str:
    """count_parameters' counts in words, as --estimate and a run's log show them."""
    return (f"{params['total']:,} parameters ({params['embedding']:,} embedding, {params['non_embedding']:,} "
            f"non-embedding, {params['streams']:,} in the residual connections)")



def print_estimate(gpt: type, cfg: Config, params: dict) -> None:
    """Model size, work per token, the memory plan of one GPU and the time of the run: the model is built on the
    meta device and the activations are measured on tiny copies on the CPU, so nothing of the real size is
    allocated. `params`: train_c4.count_parameters(cfg)."""
    print(f"{cfg.residual} depth {cfg.depth} width {cfg.width}: {parameter_summary(params)}")
    flops = flops_per_token(cfg, params["non_embedding"])
    print(f"{flops:.4g} training FLOPs per token; {cfg.tokens_per_step:,} tokens per step; "
          f"{cfg.steps * cfg.tokens_per_step:,} tokens in {cfg.steps:,} steps")
    world = cfg.estimate_world_size or int(os.environ.get("WORLD_SIZE", "1"))
    micro, auto_line = _estimate_micro_batch(gpt, cfg, world)
    strategy = f"{world} processes, {cfg.parallel.upper()}" if world > 1 else "1 process"
    print(f"memory of one GPU at micro-batch {micro} ({cfg.batch_size // (micro * world)} accumulation steps), "
          f"{'fp32' if cfg.dtype == 'fp32' else 'bf16 autocast'}, {strategy}, activation checkpointing "
          f"{'on' if cfg.activation_checkpointing else 'off'}:")
    print_memory_plan(memory_plan(gpt, cfg, micro, world))
    if cfg.residual != "baseline":
        fit = activation_profile(gpt, profile_key(cfg, False))["streams"]
        streams = micro * cfg.seq_len * cfg.depth * (fit[0] * cfg.width + fit[1])
        print(f"the {cfg.expansion} streams add {params['streams']:,} parameters and, without checkpointing, "
              f"{streams / GiB:.1f} GiB of activations (stream states, mixing coefficients, written sublayer outputs)")
    print(auto_line)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    print_time(gpt, cfg, params, micro, world, name or ASSUMED_GPU,
               f"{world} x {name or ASSUMED_GPU + ' (assumed: no CUDA device here)'}")
    if name is None:
        print_time(gpt, cfg, params, micro, world, "cpu", "this CPU")


def print_time(gpt: type, cfg: Config, params: dict, micro: int, world: int, gpu: str, where: str) -> None:
    """The step on every kernel path the arm has, counted and priced term by term, and the run on its own path; on
    the CPU, the run's line alone."""
    cfg = device_config(cfg, gpu)
    rates = device_rates(cfg, micro, gpu)
    if rates is None:
        print(f"time on {where}: no estimate, its bf16 peak or bandwidth is not known (GPU_PEAK_BF16_FLOPS, "
              "GPU_BANDWIDTH)")
        return
    check = choice.load_check(cfg.out)
    path = planned_path(cfg, gpu, check)
    if gpu != "cpu":
        print(f"time on {where}: one step of {cfg.tokens_per_step:,} tokens, counted on the model, at "
              f"{rates_text(rates)}")
        print(f"  {'path':<10}{'kernels':>9}{'MB/token':>10}  " + "".join(f"{t:<14}" for t in TERMS) + "step")
        print(f"  {'':<10}{'a block':>9}{'a block':>10}")
        for other in (p for p in ("reference", "fused", "triton") if choice.supports(cfg, p)):
            cost = step_cost(gpt, cfg, params, other, micro, world, rates)
            work = step_work(gpt, work_key(cfg), other)
            print(f"  {other:<10}{work.launches[0]:>9,}{work.block_bytes_per_token(cfg.width) / 1e6:>10.2f}  "
                  + "".join(f"{range_text(cost.terms[t]):<14}" for t in TERMS) + f"{range_text(cost.seconds)}, "
                  f"{cost.dominant}-bound" + ("  <- this run's path" if other == path else ""))
    estimate = run_time(gpt, cfg, params, micro, world, gpu, path, measured_rate(check, cfg, path, gpu))
    print(f"  the run on {where if gpu == 'cpu' else 'it'}, {path} path ({estimate.basis}): "
          f"{range_text(estimate.step)} a step, {range_text(estimate.total)} for {cfg.steps:,} steps with "
          "evaluation, probes, checkpoints and start-up")


def _estimate_micro_batch(gpt: type, cfg: Config, world: int) -> tuple[int, str]:
    """The micro-batch the plan is printed for (the given one, else auto's) and what auto would choose."""
    check_batch_split(cfg, world)
    try:
        auto, _ = auto_micro_batch(gpt, cfg, world)
        auto_line = (f"--micro-batch-size auto: {auto} (the largest whose plan fills at most {1 - AUTO_MARGIN:.0%} "
                     "of the card)")
    except PlanError as error:
        auto, auto_line = None, f"--micro-batch-size auto: none fits; {error}"
    micro = int(cfg.micro_batch_size) if cfg.micro_batch_size != "auto" else auto or 1
    check_batch_split(cfg, world, micro)
    return micro, auto_line


# ----------------------------------------------------------------------------------------------
# the work of a training step, counted on the real model: what each kernel moves, how many are launched

# the memory bandwidth of each card (spec sheet, bytes/s), for the kernels that only move data
GPU_BANDWIDTH = {
    "NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H100 PCIe": 2.0e12, "NVIDIA H100 NVL": 3.9e12, "NVIDIA H200": 4.8e12,
    "NVIDIA H200 NVL": 4.8e12, "NVIDIA GH200 480GB": 4.0e12, "NVIDIA A100-SXM4-40GB": 1.555e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12, "NVIDIA A100-PCIE-40GB": 1.555e12, "NVIDIA A100 80GB PCIe": 1.935e12,
    "NVIDIA B200": 8.0e12, "NVIDIA L40S": 0.864e12,
}
# aten ops that launch no kernel: allocations, metadata, dtype promotion (views: OpOverload.is_view)
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "_unsafe_view", "promote_types", "_local_scalar_dense", "set_"}
_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}
COUNT_SEQ = 8                   # the counted models' sequence length, and their micro-batches of 1 and 2 sequences
OPTIMIZER_BYTES = 28            # fused AdamW per parameter and step: weight, gradient, 2 states read; 3 written


def _extent(t: torch.Tensor) -> int:
    """The bytes a kernel touches in t: the span of its strides, so that a broadcast (stride 0) counts once."""
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return min(t.numel(), span) * t.element_size()


def _tensors(*values):
    """The tensors among aten's arguments and results: tensors, or lists and tuples of them (faster than pytree's)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(*value)
        elif isinstance(value, dict):
            yield from _tensors(*value.values())


class KernelCounter(TorchDispatchMode):
    """Every aten op a forward and backward runs, as the GPU would run it eagerly: one kernel launch each, and the
    bytes of its tensors (inputs and outputs) unless it is a matmul of the model's width or attention, which the
    FLOP count prices instead. A matmul is of the width when two of its three sizes reach it (the counted models keep
    fewer tokens than the width): the mixing's projections and n x n products are bandwidth-bound and counted as
    bytes. Triton kernels, replaced by stubs (counting), report their own bytes through launch()."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.launches, self.bytes = width, 0, 0

    def launch(self, nbytes: float) -> None:
        self.launches += 1
        self.bytes += nbytes

    def _priced_by_flops(self, name: str, args) -> bool:
        if "attention" in name:
            return True
        if name not in _MATMULS:
            return False
        a, b = args[-2].shape[-2:], args[-1].shape[-2:]
        return sum(size >= self.width for size in (a[0], a[1], b[1])) >= 2

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not (func.is_view or name in _NO_KERNEL):
            self.launch(0 if self._priced_by_flops(name, args) else sum(map(_extent, _tensors(args, kwargs, out))))
        return out


@contextlib.contextmanager
def counting(width: int, triton: tuple[str, int, int] | None = None):
    """A KernelCounter over the code run inside. triton (arm, n, tokens): triton_kernels' kernels replaced by launches
    of the bytes they move (their own count, triton_kernels.traffic), so that the triton path runs on the CPU for
    counting: its cuBLAS and torch calls are counted as they run."""
    counter = KernelCounter(width)
    module = importlib.import_module("hcstudy.kernels.triton_ops") if triton else None
    per_token = module.traffic(triton[0], triton[1], width) if triton else {}
    saved = {name: getattr(module, name) for name in per_token if name.startswith("_")}

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: counter.launch(per_token[self.name] * triton[2])
    try:
        for name in saved:
            setattr(module, name, Stub(name))
        with counter:
            yield counter
    finally:
        for name, kernel in saved.items():
            setattr(module, name, kernel)


def _zeroed_model(gpt: type, cfg: Config, path: str) -> nn.Module:
    """The model with every parameter and buffer 0: the counts do not depend on the values, and building it on the
    meta device skips the initialisation, most of a count's time. Swapping keeps the tied weights tied."""
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    with torch.device("meta"):
        model = gpt(cfg, kernels=path)
    try:
        torch.__future__.set_swap_module_params_on_conversion(True)
        model.to_empty(device="cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.zero_()
    return model


def count_steps(gpt: type, cfg: Config, path: str, width: int, depth: int) -> dict[int, tuple[int, int]]:
    """{sequences: (kernel launches, bytes)} of one forward and backward of the real GPT at this width and depth, for
    micro-batches of 1 and 2 COUNT_SEQ-token sequences, on the CPU, under CUDA's autocast policy where it uses bf16."""
    small = dataclasses.replace(cfg, width=width, depth=depth, seq_len=COUNT_SEQ, compile=False, kernels=path)
    bf16, counts, model = cfg.dtype != "fp32", {}, _zeroed_model(gpt, small, path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for sequences in (1, 2):
            idx = torch.randint(0, model.wte.num_embeddings, (sequences, COUNT_SEQ))
            with counting(width, (cfg.residual, cfg.expansion, idx.numel()) if path == "triton" else None) as counter:
                with cuda_autocast(bf16):
                    _, loss = model(idx, idx)
                loss.backward()
            model.zero_grad(set_to_none=True)        # each micro-batch counted as the first: no accumulation
            counts[sequences] = counter.launches, counter.bytes
    return counts


@dataclasses.dataclass(frozen=True)
class StepWork:
    """What one micro-batch's forward and backward does besides its FLOPs, counted on the model (count_step at two
    widths, two depths and two micro-batches: bytes per token are linear in the width, the launches fixed)."""
    path: str
    launches: tuple[int, int]           # per block, and the rest (embedding, expansion, collapse, head, loss)
    block_bytes: tuple[float, float]    # per token per block: a * width + b
    rest_bytes: tuple[float, float]     # per token, the rest
    per_parameter: tuple[float, float]  # bytes per micro-batch per parameter of a block, of the rest: autocast's
                                        # weight copies and their gradients' casts, the embedding's gradient

    def micro_launches(self, depth: int) -> int:
        return depth * self.launches[0] + self.launches[1]

    def block_bytes_per_token(self, width: int) -> float:
        return self.block_bytes[0] * width + self.block_bytes[1]

    def bytes_per_token(self, width: int, depth: int) -> float:
        return depth * self.block_bytes_per_token(width) + self.rest_bytes[0] * width + self.rest_bytes[1]


def work_key(cfg: Config) -> Config:
    """The settings the counted work depends on: the model's kind, not its size, schedule or seed."""
    return dataclasses.replace(cfg, width=type(cfg).width, depth=type(cfg).depth, seq_len=type(cfg).seq_len,
                               batch_size=type(cfg).batch_size, micro_batch_size="auto", steps=1, seed=0,
                               dtype="fp32" if cfg.dtype == "fp32" else "bf16", run_name="", out="")


def _counted_width(cfg: Config) -> int:
    """The smaller counted width: a multiple of the heads, twice what the mixing's matmuls have in place of the width
    (the coefficients per token, the counted tokens times the streams), so that KernelCounter tells them apart."""
    n = cfg.expansion
    coefficients = 2 * n + (math.factorial(n) if cfg.residual == "mhc-lite" else n * n)
    return cfg.heads * -(-2 * max(coefficients, 2 * COUNT_SEQ * n) // cfg.heads)


@functools.cache
def step_work(gpt: type, key: Config, path: str) -> StepWork:
    """count_steps at two widths and depths, fitted: key from work_key, path one that choice.supports."""
    w1 = _counted_width(key)
    counts = {(w, d): count_steps(gpt, key, path, w, d) for w in (w1, 2 * w1) for d in (1, 2)}
    launches = counts[w1, 2][1][0] - counts[w1, 1][1][0]
    per_token = {wd: (c[2][1] - c[1][1]) / COUNT_SEQ for wd, c in counts.items()}
    fixed = {wd: c[1][1] - COUNT_SEQ * per_token[wd] for wd, c in counts.items()}      # per micro-batch
    numels = _parameter_numels(gpt, dataclasses.replace(key, width=2 * w1, depth=2, seq_len=COUNT_SEQ))
    fixed_block = fixed[2 * w1, 2] - fixed[2 * w1, 1]

    def line(part):                                 # a * width + b through the two widths
        low, high = part(w1), part(2 * w1)
        return (high - low) / w1, 2 * low - high
    return StepWork(path, (launches, counts[w1, 1][1][0] - launches),
                    line(lambda w: per_token[w, 2] - per_token[w, 1]),
                    line(lambda w: 2 * per_token[w, 1] - per_token[w, 2]),
                    (fixed_block / numels["block"], (fixed[2 * w1, 1] - fixed_block) / (numels["total"] - 2 * numels["block"])))


# ----------------------------------------------------------------------------------------------
# the time of a run, as a range (low, high): training steps, evaluation, probes, checkpoint writes, start-up

# The rates a step is priced at, (fast, slow). A GPU: its GEMMs (cuBLAS bf16 at a 1-3B model's shapes, FlashAttention
# forward and backward) at a share of the dense bf16 peak; every other kernel's bytes at a share of the memory
# bandwidth (large elementwise kernels reach about 90% of it, small and strided ones less); the idle gap between two
# queued kernels; and eager PyTorch's host time to issue one op (Python, the dispatcher, the launch), which runs
# beside the device: the step waits for the host when the kernels are shorter than that. Public figures for these
# cards, not measurements of this trainer: --check's timings replace them (docs/planning.md).
GEMM_SHARE = (0.65, 0.45)
BANDWIDTH_SHARE = (0.85, 0.40)
LAUNCH_GAP_S = (1e-6, 3e-6)
HOST_OP_S = (5e-6, 12e-6)
CPU_SLOW_SHARE = 2 / 3          # slow end: one thread at two thirds of its rates (plan.cpu_rates_at)
CPU_TIMED_WIDTH, CPU_TIMED_TOKENS = 512, 2048     # the largest shape the CPU's rates are timed on (16 MiB at n = 4)
MEASURED_SPREAD = (0.9, 1.2)     # around a measured step time: another depth or micro-batch moves it
CHECKPOINT_GBPS = (2.0, 0.5)     # a checkpoint's files written at local NVMe speed, down to a network disk's
# imports, model build, the data streams' first batches, the first step's kernels: minutes for a 2.5B model on a
# GPU node (assumed), seconds for the CPU's small presets
STARTUP_S = {"gpu": (60.0, 300.0), "cpu": (5.0, 30.0)}
# an evaluation or probe sequence costs a forward: about a third of a training step's forward and backward
FORWARD_SHARE = 1 / 3


@dataclasses.dataclass(frozen=True)
class Rates:
    """What one device does per second, (fast, slow): its GEMMs' FLOPs and its other kernels' bytes; the seconds of
    a launch gap on the device and of one op on the host; whether host and device overlap (a GPU) or not (a CPU)."""
    name: str
    flops: tuple[float, float]
    bandwidth: tuple[float, float]
    gap: tuple[float, float]
    host: tuple[float, float]
    overlapped: bool


def gpu_rates(gpu: str) -> Rates | None:
    peak, bandwidth = GPU_PEAK_BF16_FLOPS.get(gpu), GPU_BANDWIDTH.get(gpu)
    if not (peak and bandwidth):
        return None
    return Rates(gpu, tuple(share * peak for share in GEMM_SHARE),
                 tuple(share * bandwidth for share in BANDWIDTH_SHARE), LAUNCH_GAP_S, HOST_OP_S, True)


TERMS = ("matmuls", "memory", "launch gaps", "host")


def rates_text(rates: Rates) -> str:
    if not rates.overlapped:
        return (f"this CPU timed at {rates.flops[1] / 1e9:.0f}-{rates.flops[0] / 1e9:.0f} GFLOP/s, "
                f"{rates.bandwidth[1] / 1e9:.0f}-{rates.bandwidth[0] / 1e9:.0f} GB/s, {rates.host[0] * 1e6:.1f}-"
                f"{rates.host[1] * 1e6:.1f} us an op (plan.cpu_rates_at)")
    peak, bandwidth = GPU_PEAK_BF16_FLOPS[rates.name], GPU_BANDWIDTH[rates.name]
    return (f"matmuls at {GEMM_SHARE[1]:.0%}-{GEMM_SHARE[0]:.0%} of {peak / 1e12:.0f} TFLOP/s, other kernels' bytes "
            f"at {BANDWIDTH_SHARE[1]:.0%}-{BANDWIDTH_SHARE[0]:.0%} of {bandwidth / 1e12:.2f} TB/s, "
            f"{LAUNCH_GAP_S[0] * 1e6:.0f}-{LAUNCH_GAP_S[1] * 1e6:.0f} us between kernels, {HOST_OP_S[0] * 1e6:.0f}-"
            f"{HOST_OP_S[1] * 1e6:.0f} us of host time an op, host and device side by side (docs/planning.md)")


def device_config(cfg: Config, gpu: str) -> Config:
    """dtype auto is bf16 on a GPU, fp32 on the CPU (train_c4.compute_dtype): the counts differ."""
    return dataclasses.replace(cfg, dtype="fp32") if gpu == "cpu" and cfg.dtype == "auto" else cfg


def device_rates(cfg: Config, micro: int, gpu: str) -> Rates | None:
    """The rates of one device: the GPU table's, or this CPU's timed on the run's shapes."""
    streams = 1 if cfg.residual == "baseline" else cfg.expansion
    return cpu_rates(micro * cfg.seq_len, cfg.width, streams) if gpu == "cpu" else gpu_rates(gpu)


def _best_seconds(run, repeats: int = 5, at_least_s: float = 0.1) -> float:
    """The fastest of `repeats` or more runs after a warm-up, repeated for at_least_s: a short kernel gets enough
    tries that one of them runs undisturbed on a shared CPU."""
    run()
    times, began = [], time.perf_counter()
    while len(times) < repeats or time.perf_counter() - began < at_least_s:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


@contextlib.contextmanager
def _one_thread():
    """torch on one thread inside, the caller's thread count yielded and restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)


@functools.cache
def cpu_rates(tokens: int, width: int, streams: int) -> Rates:
    """This CPU's rates on a run's own shapes (a micro-batch's tokens; a slice of at most CPU_TIMED_TOKENS x
    CPU_TIMED_WIDTH where the run's is larger: the rates are per FLOP and per byte), timed once in under a second:
    the MLP's first matmul in fp32; an add of two n-stream states (a small model's fit in the caches, and that is the
    bandwidth its kernels get); a forward and backward of 100 multiplications of 8 numbers, per op. Timed on one
    thread, where the fastest of many runs is this core's own speed: two threads on a shared CPU wait on each other
    at every kernel, and timed that way the rates moved 10x from one run to the next (docs/benchmarks.md). The share of
    a core that thread got meanwhile (its CPU time over the wall time) is the load of the other work; cpu_rates_at
    turns the three into the trainer's rates."""
    tokens, width = min(tokens, CPU_TIMED_TOKENS), min(width, CPU_TIMED_WIDTH)
    with _one_thread() as threads:
        wall, cpu = time.perf_counter(), time.process_time()
        a, w = torch.randn(tokens, width), torch.randn(width, 4 * width)
        flops = 2 * a.numel() * w.shape[1] / _best_seconds(lambda: a @ w)
        x = torch.randn(tokens, streams, width)
        bandwidth = 3 * x.nbytes / _best_seconds(lambda: x + x)
        v = torch.ones(8, requires_grad=True)

        def chain():
            y = v
            for _ in range(100):
                y = y * 1.0
            y.sum().backward()
        op = _best_seconds(chain) / 202                  # 100 multiplications and the sum, forward and backward
        share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    return cpu_rates_at(flops, bandwidth, op, min(threads, os.cpu_count() or 1), share)


def cpu_rates_at(flops: float, bandwidth: float, op_s: float, cores: int, share: float) -> Rates:
    """The trainer's CPU rates from one thread's (FLOP/s, bytes/s, seconds an op) and the share of a core a thread
    gets beside the other work: fast, its threads (one a core) in parallel, each at that share; slow, one thread's
    share at CPU_SLOW_SHARE (under load the threads wait on each other, and two have run slower than one). The host's
    ops run on one thread at that share either way."""
    share = min(1.0, max(share, 0.05))              # a thread that got less than 5% could not have timed anything
    fast, slow = cores * share, share * CPU_SLOW_SHARE
    return Rates("cpu", (flops * fast, flops * slow), (bandwidth * fast, bandwidth * slow), (0.0, 0.0),
                 (op_s / share, op_s / slow), False)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Work on one device (a step's, or any code's counted by `counting`) and its seconds at `rates`, (fast, slow)."""
    path: str
    flops: float            # of the matmuls of the width and attention
    bytes: float            # every other kernel's
    launches: float
    rates: Rates

    @property
    def terms(self) -> dict:
        r = self.rates
        return {"matmuls": tuple(self.flops / f for f in r.flops), "memory": tuple(self.bytes / b for b in r.bandwidth),
                "launch gaps": tuple(self.launches * g for g in r.gap), "host": tuple(self.launches * h for h in r.host)}

    @property
    def seconds(self) -> tuple[float, float]:
        terms = self.terms
        device = [sum(terms[k][i] for k in ("matmuls", "memory", "launch gaps")) for i in (0, 1)]
        return tuple(max(d, h) if self.rates.overlapped else d + h for d, h in zip(device, terms["host"]))

    @property
    def dominant(self) -> str:
        terms = self.terms
        return max(terms, key=lambda k: terms[k][1])


def step_cost(gpt: type, cfg: Config, params: dict, path: str, micro: int, world: int, rates: Rates) -> StepCost:
    """One step of `cfg` on one of `world` devices, counted on the model (step_work) and priced at `rates`."""
    work, numels = step_work(gpt, work_key(cfg), path), parameter_numels(gpt, cfg)
    tokens, micro_steps = cfg.tokens_per_step / world, cfg.batch_size / (micro * world)
    blocks, shards = cfg.depth * numels["block"], world if world > 1 and cfg.parallel == "fsdp" else 1
    flops = tokens * flops_per_token(cfg, params["non_embedding"])
    nbytes = (tokens * work.bytes_per_token(cfg.width, cfg.depth) + OPTIMIZER_BYTES * numels["total"] / shards
              + micro_steps * (work.per_parameter[0] * blocks + work.per_parameter[1] * (numels["total"] - blocks)))
    return StepCost(path, flops, nbytes, micro_steps * work.micro_launches(cfg.depth), rates)


@dataclasses.dataclass(frozen=True)
class RunTime:
    step: tuple[float, float]       # seconds per optimizer step
    total: tuple[float, float]      # seconds of the run's remaining steps with everything else it does
    basis: str                      # where the step time comes from
    path: str                       # the streams' kernel path it was priced for


def range_text(values: tuple[float, float]) -> str:
    """Seconds (low, high) in the unit that suits the high end: 0.12-0.19 s, 3.1-4.6 min, 2.6-5.1 h."""
    high = max(values)
    scale, unit = next((s, u) for limit, s, u in ((1e-3, 1e-6, "us"), (1, 1e-3, "ms"), (120, 1, "s"),
                                                   (7200, 60, "min"), (float("inf"), 3600, "h")) if high < limit)
    return "-".join(f"{v / scale:.2g}" if v / scale < 100 else f"{v / scale:.0f}" for v in values) + " " + unit


def planned_path(cfg: Config, gpu: str, check: dict | None) -> str:
    """The streams' path a run of `cfg` will take on this device (choice.kernel_path's choice, but for its
    self-check, which only the device can run): --check's fastest timing where auto has one, else what is asked."""
    timed = choice.fastest_timed(cfg, check or {}, gpu) if cfg.kernels == "auto" and gpu != "cpu" else None
    wanted = timed[0] if timed else choice.asked_path(cfg, on_gpu=gpu != "cpu")
    return wanted if choice.supports(cfg, wanted) else "reference"


def step_seconds(gpt: type, cfg: Config, params: dict, micro: int, world: int, gpu: str, path: str,
                 measured: dict | None = None) -> tuple[tuple[float, float], str] | None:
    """(low, high) seconds of one optimizer step and their basis: `measured` (the launcher's calibration, or the
    GPU check's timing of this arm and path on this GPU, docs/planning.md) if given, else the step counted on the
    model and priced at the device's rates. None on a GPU whose peak or bandwidth is not known."""
    if measured and measured.get("flops_per_s"):
        seconds = cfg.tokens_per_step * flops_per_token(cfg, params["non_embedding"]) / (
            measured["flops_per_s"] * world / measured.get("gpus", 1))
        return (seconds * MEASURED_SPREAD[0], seconds * MEASURED_SPREAD[1]), measured["basis"]
    cfg = device_config(cfg, gpu)
    rates = device_rates(cfg, micro, gpu)
    if rates is None:
        return None
    cost = step_cost(gpt, cfg, params, path, micro, world, rates)
    # Inductor fuses the small ops into kernels that cannot be counted without compiling: priced as eager, which
    # the compiled step should not exceed, until --check times it
    return cost.seconds, f"modelled, {cost.dominant}-bound" + (", as eager (compile not modelled)" if cfg.compile else "")


def run_time(gpt: type, cfg: Config, params: dict, micro: int, world: int, gpu: str, path: str,
             measured: dict | None = None, done_steps: int = 0) -> RunTime | None:
    """The remaining steps of a run and what else it does on the way, in seconds, as (low, high)."""
    step = step_seconds(gpt, cfg, params, micro, world, gpu, path, measured)
    if step is None:
        return None
    (low, high), basis = step
    steps = max(0, cfg.steps - done_steps)
    # forward-only work, in optimizer steps: the validation set at every evaluation, the probe batch at every probe
    forward_steps = FORWARD_SHARE * (steps // cfg.eval_every * cfg.eval_batches
                                     + steps // cfg.metrics_every * cfg.probe_sequences / cfg.batch_size)
    checkpoint_bytes = steps // cfg.ckpt_every * 12 * params["total"]      # fp32 weights and AdamW's two states
    startup = STARTUP_S["cpu" if gpu == "cpu" else "gpu"]
    total = tuple((steps + forward_steps) * s + checkpoint_bytes / (gbps * 1e9) + start
                  for s, gbps, start in zip((low, high), CHECKPOINT_GBPS, startup))
    return RunTime((low, high), total, basis, path)


def measured_rate(check: dict, cfg: Config, path: str, gpu: str) -> dict | None:
    """The GPU check's timing of this arm on this path and mode ({out}/gpu_check/result.json, format in
    docs/planning.md) as work per second, if it was measured on this GPU."""
    method, mode = cfg.residual, "compile" if cfg.compile else "eager"
    timing = (check.get("methods") or {}).get(method) or {}
    try:
        seconds = check["timings"][method][f"{path}/{mode}"]["step_s"]
        rate = timing["tokens_per_step"] * timing["flops_per_token"] / seconds
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    if check.get("gpu") != gpu or not rate > 0:
        return None
    return {"flops_per_s": rate, "gpus": timing.get("gpus", 1),
            "basis": f"{method} on the {path} path ({mode}): measured, timed by the GPU check"}


# ----------------------------------------------------------------------------------------------
# the launcher's check of every job before its first launch (train_c4.py --plan-jobs answers with this)

def card_bytes(cfg: Config, gpu: str, card_gib: float | None = None) -> float:
    """The memory of one GPU of the launcher's node: --gpu-memory-gb, else what nvidia-smi said (card_gib), else
    the named card's (a card the table lacks is refused), else, for a CPU plan, DEFAULT_GPU_MEMORY_GIB."""
    if cfg.gpu_memory_gb > 0:
        return cfg.gpu_memory_gb * GiB
    if not card_gib and gpu not in (*GPU_MEMORY_GIB, "cpu"):    # a plan for a card of unknown size is a guess
        raise PlanError(f"GPU type {gpu!r} is not in the planner's table ({', '.join(GPU_MEMORY_GIB)}): give its "
                        "memory with -- --gpu-memory-gb N")
    return (card_gib or GPU_MEMORY_GIB.get(gpu, DEFAULT_GPU_MEMORY_GIB)) * GiB


def job_plan(gpt: type, cfg: Config, params: dict, micro: int, world: int, gpu: str, card: float, job: dict) -> dict:
    """One job as the launcher plans it: micro-batch, memory (on a GPU: the plan must fit the card, else PlanError),
    time (None where unknown). `job`: done_steps, and the launcher's calibration (tokens_per_s) or the GPU check's
    timing (check) if any."""
    answer = {"micro": micro, "auto": cfg.micro_batch_size == "auto", "batch": cfg.batch_size, "memory": None,
              "seconds": None, "step_seconds": None, "basis": None, "path": None}
    if gpu != "cpu":
        plan = memory_plan(gpt, cfg, micro, world, card)
        if plan.total > plan.card:
            raise PlanError(f"{cfg.run_name} at micro-batch {micro} plans {plan.total / GiB:.1f} GiB per GPU, more "
                            f"than the {plan.card / GiB:.0f} GiB of one {gpu}: pass a smaller -- --micro-batch-size, "
                            "-- --activation-checkpointing, or --gpus-per-run 2 or more (python train_c4.py "
                            "--estimate shows the plan)")
        answer["memory"] = f"{plan.total / GiB:.1f} of {plan.card / GiB:.0f} GiB"
    check, flops = job.get("check") or {}, flops_per_token(cfg, params["non_embedding"])
    path = planned_path(cfg, gpu, check)
    if job.get("tokens_per_s"):
        measured = {"flops_per_s": job["tokens_per_s"] * flops, "gpus": world, "basis": "calibrated just now"}
    else:
        measured = measured_rate(check, cfg, path, gpu)
    estimate = run_time(gpt, cfg, params, micro, world, gpu, path, measured, job.get("done_steps") or 0)
    answer["path"] = path
    if estimate is not None:
        answer.update(seconds=list(estimate.total), step_seconds=list(estimate.step), basis=estimate.basis)
    return answer


def node_answer(gpu: str, jobs: list[dict]) -> dict:
    """--plan-jobs' answer: the GPU planned for, the assumptions behind every time (printed by the dry run), and
    the jobs' answers."""
    measured = sorted({job["basis"] for job in jobs if job.get("basis") and not job["basis"].startswith("modelled")})
    rates = gpu_rates(gpu)
    modelled = ("this CPU's rates, timed on one thread on each run's shapes and scaled to the trainer's threads at "
                "the share of a core the other work leaves" if gpu == "cpu" else rates_text(rates) if rates
                else f"none: the bf16 peak or bandwidth of {gpu or 'this GPU'} is not known")
    startup = STARTUP_S["cpu" if gpu == "cpu" else "gpu"]
    return {"gpu": gpu, "jobs": jobs, "assumptions": [
        "Step times, modelled: each job's kernels counted on its model (every launch, the bytes each moves, the "
        f"matmuls' FLOPs) on its kernel path, at {modelled}",
        *(["Step times, measured: " + "; ".join(measured)] if measured else []),
        f"Each time includes evaluation and probes (forward passes at {FORWARD_SHARE:.2f} of a step per sequence), "
        f"checkpoint writes (fp32 weights and AdamW states at {CHECKPOINT_GBPS[1]:g}-{CHECKPOINT_GBPS[0]:g} GB/s) and "
        f"start-up ({startup[0]:.0f}-{startup[1]:.0f} s); low end: the fast assumptions together, "
        "high end: the slow ones (docs/planning.md)"]}
