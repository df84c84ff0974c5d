"""The memory one GPU needs for a run (parameters exactly, activations measured on tiny models on the CPU, overheads
assumed) and the micro-batch: auto's search by that plan, and on CUDA its one real trial. docs/planning.md says how
each term is derived, what is measured and what is assumed."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from hcstudy.contract import EXIT_BAD_CONFIG, ConfigError, load_check
from hcstudy.kernels import choice, cross_entropy, triton_library
from hcstudy.model import GPT
from hcstudy.planner import rehearsed
from hcstudy.planner.gpus import ASSUMED_GPU


class PlanError(Exception):
    """A batch split or micro-batch that cannot work: one line, and the trainer's exit code for bad settings."""
    exit_code = EXIT_BAD_CONFIG


GiB = 2 ** 30
DEFAULT_GPU_MEMORY_GIB = 80.0   # the card planned for when no CUDA device is visible (an H100 80GB shows 79.2)
# Framework overhead per process, assumed (it cannot be measured without a GPU): the CUDA context with the
# cuBLAS workspaces and the kernels of the first step (0.5-1 GiB on an H100), NCCL's buffers when there are
# peers, and the caching allocator's fragmentation (reserved minus allocated) as a share of the allocated
# peak: a few per cent when every step repeats the same shapes
CUDA_CONTEXT_BYTES, NCCL_BYTES, FRAGMENTATION = 1.0 * GiB, 1.0 * GiB, 0.05
AUTO_MARGIN = 0.05      # auto fills at most 95% of the card by the plan: a model of the memory, not a measurement
STATE_BYTES = {"fp32": 4, "bf16": 2}    # a residual state value at --stream-dtype
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
                self.count(args[0], label)       # non-reentrant checkpointing keeps its function's input alive
        return hook

    def leave(self, module, args, output):
        self.where.pop()


def saved_bytes(model: nn.Module, idx: torch.Tensor, bf16: bool) -> dict:
    """The bytes one training forward keeps for the backward pass, by where they were saved: (block, 'attn' or
    'mlp', 'body' or 'streams'), 'loss' (the log-probabilities) or 'other' (embedding, collapse, head); with
    activation checkpointing, the inputs the checkpoints hold (each connection's on the formulas, each sublayer's on
    the kernels' paths: Block.checkpointed). Measured with saved-tensor hooks on the CPU, each storage counted once
    (the triton path's operators allocate their outputs and run no kernel); parameters are not counted,
    'weight_casts' names those autocast copied."""
    counter, handles = _SavedTensorCounter(model), []
    for i, block in enumerate(model.blocks):
        for part in ("attn", "mlp"):
            conn, body = getattr(block, f"{part}_conn"), getattr(block, part)
            handles += [conn.register_forward_pre_hook(counter.enter((i, part, "streams"),
                                                                     block.checkpointed == "connection")),
                        body.register_forward_pre_hook(counter.enter((i, part, "body"),
                                                                     block.checkpointed == "sublayer")),
                        conn.register_forward_hook(counter.leave), body.register_forward_hook(counter.leave)]
    triton = getattr(model.blocks[0].attn_conn, "kernels", None) == "triton"
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), cuda_autocast(bf16), \
                triton_library.without_kernels() if triton else contextlib.nullcontext():
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
        model = gpt(small, kernels=small.kernels)
        idx = torch.randint(0, model.wte.num_embeddings, (micro, seq_len))
        saved = saved_bytes(model, idx, bf16)
    casts = saved.pop("weight_casts")
    return {"weight_casts": casts, **{k: v / (micro * seq_len) for k, v in saved.items()}}


def profile_key(cfg: Config, checkpointing: bool) -> Config:
    """The settings activation_profile depends on, all others at their defaults: one measurement serves every
    depth, width, batch and seed (type(cfg) is hcstudy.config.Config). The streams'
    path: the one a GPU run asks for (profiled_path; the triton path's operators allocate their outputs on the CPU
    and launch nothing there)."""
    return type(cfg)(residual=cfg.residual, expansion=cfg.expansion, heads=cfg.heads, tokenizer=cfg.tokenizer,
                     sinkhorn_iters=cfg.sinkhorn_iters, dtype="fp32" if cfg.dtype == "fp32" else "bf16",
                     activation_checkpointing=checkpointing, stream_dtype=cfg.stream_dtype,
                     kernels=profiled_path(cfg))


def profiled_path(cfg: Config) -> str:
    """The streams' path a GPU run of cfg asks for (auto: triton), where it has the arm: the path whose saved tensors
    the memory plan measures. The formulas' autograd keeps n x C copies the kernels do not, and under checkpointing
    the formulas recompute each connection while the kernels' paths keep theirs (train_c4.Block). A path chosen by
    --check's timing (fused) keeps what triton keeps, up to per-token coefficients."""
    path = choice.asked_path(cfg, on_gpu=True)
    return path if choice.supports(cfg, path) else "reference"



@functools.cache
def activation_profile(gpt: type, profiled: Config) -> dict:
    """Activation bytes per token as (a, b) with bytes = a * width + b, measured on the real GPT on the CPU at
    widths 2 and 4 x heads (the real head count: per-head terms like attention's logsumexp are exact) and depths
    2 and 3, with the real vocabulary. Keys: 'block' (the depth difference), its parts 'attention', 'mlp' and
    'streams' (the n-stream states, mixing coefficients and the sublayer outputs written into the streams),
    'sublayer' (the larger sublayer with its connection: what checkpointing on the formulas recomputes at once),
    'loss' (log-probabilities), 'rest' (embedding, expansion, collapse, head); 'weight_casts': the parameters
    autocast copies to bf16.
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
    return count_parameter_numels(gpt, shape_key(cfg))


@functools.cache
def count_parameter_numels(gpt: type, cfg: Config) -> dict:
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


def planned_loss(cfg: Config, gpu: str | None = None) -> tuple[str, str]:
    """The cross-entropy a run of `cfg` takes on `gpu` (default: this CUDA device, else the assumed card) and why:
    cross_entropy.choose, auto's pick from --check's result.json in --out."""
    gpu = gpu or (torch.cuda.get_device_name() if torch.cuda.is_available() else ASSUMED_GPU)
    return cross_entropy.choose(cfg, gpu, load_check(cfg.out) if cfg.cross_entropy == "auto" else None)


def memory_plan(gpt: type, cfg: Config, micro: int, world: int = 1, card: float | None = None) -> MemoryPlan:
    """The memory one GPU needs to train `cfg` at this micro-batch (dtype auto plans bf16, as on CUDA), with the
    cross-entropy planned_loss picks. Parameter terms are exact; activations are activation_profile scaled to the real
    width, depth and tokens (measured with the plain loss; the fused loss's own terms are counted from torch's code)."""
    bf16 = cfg.dtype != "fp32"
    fit, full = (activation_profile(gpt, profile_key(cfg, checkpointing))
                 for checkpointing in (cfg.activation_checkpointing, False))
    terms, notes = {}, {}

    def term(name: str, value: float, note: str) -> None:
        terms[name], notes[name] = value, note

    numels = parameter_numels(gpt, cfg)
    _parameter_terms(cfg, numels, world, full["weight_casts"], term)
    _activation_terms(cfg, numels["wte.weight"] // cfg.width, micro, fit, full, term, planned_loss(cfg)[0])
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


def _activation_terms(cfg: Config, vocab: int, micro: int, fit: dict, full: dict, term, loss: str) -> None:
    """What the forward saves (`fit`: as configured; `full`: without checkpointing) and the backward's own peak, with
    the plain or the fused cross-entropy (`loss`)."""
    C, L, tokens = cfg.width, cfg.depth, micro * cfg.seq_len
    per_token = {k: fit[k][0] * C + fit[k][1] for k in fit if k != "weight_casts"}
    connections_recomputed = profiled_path(cfg) == "reference"
    if cfg.activation_checkpointing:
        held = "stream states" if connections_recomputed else "stream states, u, y, coefficients"
        term("act: checkpointed inputs", tokens * L * per_token["block"],
             f"{L} blocks x {micro} x {cfg.seq_len} tokens x {per_token['block'] / 1024:.1f} KiB ({held} held)")
    else:
        parts = ", ".join(f"{k} {per_token[k] / 1024:.1f}" for k in ("attention", "mlp", "streams"))
        term("act: blocks", tokens * L * per_token["block"],
             f"{L} blocks x {micro} x {cfg.seq_len} tokens x ({parts} KiB)")
    term("act: embedding, head", tokens * per_token["rest"],
         "embedding, n-stream expansion, collapse, final norm, head input")
    # the backward's own peak on top of what is saved: with checkpointing, one sublayer recomputed (on the formulas
    # with its connection); the plain loss's backward holds two more fp32 buffers of the logits' size (the gradients
    # into and out of log_softmax)
    recomputed = ("sublayer",) if connections_recomputed else ("attention", "mlp")
    recompute = tokens * max(full[k][0] * C + full[k][1] for k in recomputed) if cfg.activation_checkpointing else 0.0
    if loss == "fused":
        head = fused_loss_peak(tokens, C, vocab, 4 if cfg.dtype == "fp32" else 2)
        term("act: log-probabilities", 0.0, "none: the fused cross-entropy keeps no logits")
        why = f"fused loss backward: a chunk of {cross_entropy.chunk_rows(tokens, C, vocab)} tokens' logits, the head's gradients"
    else:
        head = 2 * tokens * per_token["loss"]
        term("act: log-probabilities", head / 2, f"fp32 log_softmax over the {vocab:,}-token vocabulary")
        why = "loss backward: 2 fp32 buffers of the logits' size"
    term("act: backward peak", max(head, recompute), "one sublayer recomputed" if recompute > head else why)


def fused_loss_peak(tokens: int, width: int, vocab: int, compute_bytes: int) -> float:
    """What the fused cross-entropy's backward allocates at once (torch/nn/modules/linear_cross_entropy.py, its CUDA
    bf16 layout; not measured): one chunk's logits in fp32 and in the compute dtype, the head weight's gradient in the
    compute dtype (its fp32 copy becomes the weight's .grad, counted with the gradients) and the head input's gradient in
    fp32 and the compute dtype. Its forward holds one chunk's fp32 logits, less. The head's input and its weight, cast,
    are saved as with the plain loss (the activations measured and the autocast weight cache)."""
    rows = cross_entropy.chunk_rows(tokens, width, vocab)
    return rows * vocab * (4 + compute_bytes) + vocab * width * compute_bytes + tokens * width * (4 + compute_bytes)


def memory_floor(cfg: Config, vocab: int, micro: int, world: int, loss: str = "plain") -> float:
    """A floor, in closed form (nothing built), of the bytes one process needs: 16 per parameter of the plain GPT
    body (fp32 weights, gradients, AdamW's two states; sharded under FSDP), per token a residual state (at
    --stream-dtype) and an fp32 sublayer output per block and, with the plain loss, the fp32 log-probabilities with
    their two backward buffers, and the validation token ids.
    The real plan (--estimate) is larger; this only has to be cheap enough to run before the first allocation."""
    C = cfg.width
    parameters = (vocab + cfg.seq_len) * C + cfg.depth * 12 * C * C
    shards = world if world > 1 and cfg.parallel == "fsdp" else 1
    activations = micro * cfg.seq_len * ((STATE_BYTES[cfg.stream_dtype] + 4) * cfg.depth * C
                                         + (12 * vocab if loss == "plain" else 0))
    return 16 * parameters / shards + activations + 8 * cfg.eval_batches * cfg.batch_size * (cfg.seq_len + 1)


def check_memory(cfg: Config, vocab: int, micro: int, world: int, device: torch.device) -> None:
    """memory_floor against this GPU's memory or this machine's: a run that cannot fit ends before it allocates."""
    if device.type == "cuda":
        available, where = gpu_memory_bytes(cfg), f"this GPU ({torch.cuda.get_device_name(device)})"
    else:
        available, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
    loss = planned_loss(cfg, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")[0]
    need = memory_floor(cfg, vocab, micro, world, loss)
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


def auto_micro_batch(gpt: type, cfg: Config, world: int, card: float | None = None,
                     below: int | None = None) -> tuple[int, MemoryPlan]:
    """The largest micro-batch dividing the per-process batch whose plan fills at most 1 - AUTO_MARGIN of the card;
    given `below`, smaller than it (the GPU check's rehearsal ran out of memory there)."""
    plan = None
    for micro in divisors_descending(cfg.batch_size // world):
        if below and micro >= below:
            continue
        plan = memory_plan(gpt, cfg, micro, world, card)
        if plan.total <= (1 - AUTO_MARGIN) * plan.card:
            return micro, plan
    if plan is None:
        raise PlanError(f"micro-batch 1 ran out of memory in the GPU check's rehearsal of {cfg.residual} at depth "
                        f"{cfg.depth} on this GPU: use --activation-checkpointing, or --parallel fsdp over more GPUs")
    raise PlanError(f"micro-batch 1 already needs {plan.total / GiB:.1f} GiB of this {plan.card / GiB:.1f} GiB GPU "
                      "(see --estimate): use --activation-checkpointing, or --parallel fsdp over more GPUs")


def cpu_auto_micro_batch(cfg: Config, world: int) -> int:
    return next(d for d in divisors_descending(cfg.batch_size // world) if d <= CPU_AUTO_MICRO)


def resolve_micro_batch(gpt: type, cfg: Config, world: int, on_gpu: bool, card: float | None = None,
                        gpu: str | None = None) -> tuple[int, str]:
    """The micro-batch a run uses and, for auto, why: on a GPU the largest the memory plan fits, below any the GPU
    check's rehearsal saw run out of memory on this GPU type (`gpu`: default this CUDA device, else the planner's
    assumed card; an explicit one at or above it is refused); on the CPU, where there is no device memory to plan
    against, the per-process batch capped at CPU_AUTO_MICRO."""
    check_batch_split(cfg, world)
    failed_at = rehearsed_failure(cfg, world, gpu) if on_gpu else None
    if cfg.micro_batch_size != "auto":
        micro, why = int(cfg.micro_batch_size), ""
        if failed_at and micro >= failed_at:
            raise PlanError(rehearsed.refusal(cfg, micro, failed_at, gpu or this_gpu()))
    elif on_gpu:
        micro, plan = auto_micro_batch(gpt, cfg, world, card, failed_at)
        why = (f"planned {plan.total / GiB:.1f} of {plan.card / GiB:.1f} GiB, at most {1 - AUTO_MARGIN:.0%} "
               "of the card" + (f", below the {failed_at} the GPU check saw run out of memory" if failed_at else "")
               + "; --estimate shows the plan")
    else:
        micro = cpu_auto_micro_batch(cfg, world)
        why = (f"CPU: the per-process batch {cfg.batch_size // world} capped at {CPU_AUTO_MICRO}, no GPU memory to "
               "plan against")
    check_batch_split(cfg, world, micro)
    return micro, why


def this_gpu() -> str:
    """The GPU a plan is for where none is named: this CUDA device, else the documented node's card."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else ASSUMED_GPU


def rehearsed_failure(cfg: Config, world: int, gpu: str | None = None) -> int | None:
    """The smallest micro-batch the GPU check's rehearsal of this shape ran out of memory at on this GPU type (its
    result.json in --out), None where it saw none."""
    return rehearsed.out_of_memory_at(load_check(cfg.out), cfg, gpu or this_gpu(), world)


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


def batch_plan(cfg: Config, world: int, on_gpu: bool | None = None, card: float | None = None,
               gpu: str | None = None) -> tuple[int, int, str]:
    """(micro-batch, accumulation steps, why auto chose it): every optimizer step sees --batch-size sequences;
    auto is resolve_micro_batch's, for a GPU (default: where CUDA is; `gpu` its name) or the CPU."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    micro, why = resolve_micro_batch(GPT, cfg, world, on_gpu, card, gpu)
    # the streams each process reads from (ranks share streams when the world size does not divide them)
    read = min(len({p % cfg.data_streams for p in range(rank, cfg.batch_size, world)}) for rank in range(world))
    if cfg.data_workers > read:
        raise ConfigError(f"--data-workers {cfg.data_workers} exceeds the {read} data stream(s) each of {world} "
                          "process(es) reads (a loader process owns whole streams); lower --data-workers, or raise "
                          "--data-streams and --batch-size")
    return micro, cfg.batch_size // (micro * world), why
