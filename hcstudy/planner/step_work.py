"""The work of a training step, counted on the real model (a TorchDispatchMode): every kernel launch, the bytes each
non-matmul kernel moves and the matmuls' FLOPs, per block and token, for each arm and kernel path."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from hcstudy import arms
from hcstudy.kernels import triton_library
from hcstudy.planner.memory import STATE_BYTES, count_parameter_numels, cuda_autocast

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
        # the triton path's operators (triton_library.py): each one's kernel, a stub here, counts itself
        if not (func.is_view or name in _NO_KERNEL or func.namespace == triton_library.NAMESPACE):
            self.launch(0 if self._priced_by_flops(name, args) else sum(map(_extent, _tensors(args, kwargs, out))))
        return out


@contextlib.contextmanager
def counting(width: int, triton: tuple[str, int, int, int] | None = None):
    """A KernelCounter over the code run inside. triton (arm, n, tokens, bytes of a state value): triton_ops'
    kernels replaced by launches of the bytes they move (their own count, triton_ops.traffic), so that the triton
    path runs on the CPU for counting: its cuBLAS and torch calls are counted as they run."""
    counter = KernelCounter(width)
    module = importlib.import_module("hcstudy.kernels.triton_ops") if triton else None
    per_token = module.traffic(triton[0], triton[1], width, stream_bytes=triton[3]) if triton else {}
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
            triton = (cfg.residual, cfg.expansion, idx.numel(), STATE_BYTES[cfg.stream_dtype])
            with counting(width, triton if path == "triton" else None) as counter:
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
    """The settings the counted work depends on: the model's kind, not its size, schedule or seed, nor --compile
    (the count runs the model eager: a compiled step is priced as eager)."""
    return dataclasses.replace(cfg, width=type(cfg).width, depth=type(cfg).depth, seq_len=type(cfg).seq_len,
                               batch_size=type(cfg).batch_size, micro_batch_size="auto", steps=1, seed=0, compile=False,
                               dtype="fp32" if cfg.dtype == "fp32" else "bf16", run_name="", out="")


def _counted_width(cfg: Config) -> int:
    """The smaller counted width: a multiple of the heads, twice what the mixing's matmuls have in place of the width
    (the coefficients per token, the counted tokens times the streams), so that KernelCounter tells them apart."""
    n = cfg.expansion
    coefficients = 2 * n + max(n * n, arms.res_logit_count(cfg.residual, n))
    return cfg.heads * -(-2 * max(coefficients, 2 * COUNT_SEQ * n) // cfg.heads)


@functools.cache
def step_work(gpt: type, key: Config, path: str) -> StepWork:
    """count_steps at two widths and depths, fitted: key from work_key, path one that choice.supports."""
    w1 = _counted_width(key)
    counts = {(w, d): count_steps(gpt, key, path, w, d) for w in (w1, 2 * w1) for d in (1, 2)}
    launches = counts[w1, 2][1][0] - counts[w1, 1][1][0]
    per_token = {wd: (c[2][1] - c[1][1]) / COUNT_SEQ for wd, c in counts.items()}
    fixed = {wd: c[1][1] - COUNT_SEQ * per_token[wd] for wd, c in counts.items()}      # per micro-batch
    numels = count_parameter_numels(gpt, dataclasses.replace(key, width=2 * w1, depth=2, seq_len=COUNT_SEQ))
    fixed_block = fixed[2 * w1, 2] - fixed[2 * w1, 1]

    def line(part):                                 # a * width + b through the two widths
        low, high = part(w1), part(2 * w1)
        return (high - low) / w1, 2 * low - high
    return StepWork(path, (launches, counts[w1, 1][1][0] - launches),
                    line(lambda w: per_token[w, 2] - per_token[w, 1]),
                    line(lambda w: 2 * per_token[w, 1] - per_token[w, 2]),
                    (fixed_block / numels["block"], (fixed[2 * w1, 1] - fixed_block) / (numels["total"] - 2 * numels["block"])))
