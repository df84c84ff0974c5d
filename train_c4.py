"""Train a GPT-style transformer on C4 with a plain residual, Hyper-Connections (HC) or
manifold-constrained Hyper-Connections (mHC), and measure whether the residual streams amplify.

    python train_c4.py --depth 48 --seed 123                 # one full C4 run (mHC by default)
    python train_c4.py --preset demo --residual hc           # CPU minutes, bundled Shakespeare
    torchrun --nproc_per_node=8 train_c4.py --parallel fsdp  # one run over a whole node

The maths, the metrics and every choice where the papers are silent are in docs/model.md; the run folder,
exit codes and reliability rules in README.md and docs/reliability.md.
Sections, in file order:
  config/CLI            the errors that carry the exit codes (contract.py: the codes and the run-name
                        format the launcher and the report share), Config, presets, --help's groups,
                        every check of a value
  model                 the GPT body and the three residual paths (PlainResidual, HyperConnection,
                        ManifoldHyperConnection)
  instability metrics   composite gains, the study's recipe, the Sinkhorn truncation, the probe
  data                  tokenizers, C4 (hub or local), held-out documents, the rank's batches (RankBatches)
                        and the Loader that reads them ahead: a thread or loader processes
  distributed           torchrun's process group, DDP / FSDP2 wrapping, a failing rank's reason
  checkpointing         write, seal, verify and safely load checkpoints; --consolidate
  logging               train.log, metrics.jsonl, status.json, W&B
  training loop         GPU peaks, FLOPs per token; the planner (memory plan, --micro-batch-size auto,
                        --estimate); the batch split, lr schedule, precision, resume checks,
                        config.json's record, signals, fault hooks, Trainer, progress, preflight checks,
                        build_trainer, train
  main                  the one classification of a failure into a line and an exit code; main
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import functools
import glob
import hashlib
import importlib.metadata
import io
import itertools
import json
import math
import multiprocessing
import os
import pickle
import queue
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str
from torch.distributed.distributed_c10d import _get_default_store, _set_pg_timeout
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import contract
from contract import (EXIT_BAD_CONFIG, EXIT_DATA, EXIT_DEVICE, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_OK,
                      EXIT_OOM)

# Imported where they are used, on purpose: datasets and torch.distributed's fsdp and checkpoint packages (each
# about a second, as much as torch itself: `python -X importtime -c 'import train_c4'`), which --help, --estimate
# and most tests never need; flash_attn, optional and CUDA only; wandb (its own line says why).

ROOT = Path(__file__).resolve().parent

# ----------------------------------------------------------------------------------------------
# config/CLI: every setting of a run, resolved once into a frozen Config

class TrainerError(Exception):
    """An expected failure: its message is the one line the user sees, exit_code what the launcher reads."""
    exit_code = 1


class ConfigError(TrainerError):
    exit_code = EXIT_BAD_CONFIG


class DataUnavailable(TrainerError):
    exit_code = EXIT_DATA


class Diverged(TrainerError):
    exit_code = EXIT_DIVERGED


class Interrupted(TrainerError):
    exit_code = EXIT_INTERRUPTED


class DeviceFailure(TrainerError):
    exit_code = EXIT_DEVICE


class RunFailed(TrainerError):
    """A failure already classified (by `failure`) and recorded in status.json; the cause is chained."""

    def __init__(self, exit_code: int, reason: str):
        super().__init__(reason)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class Config:
    preset: str = "c4"
    # model (docs/model.md, "Baseline and the transformer body": depth 32 at width 2048 is the 1.73B model)
    residual: str = "mhc"
    depth: int = 32
    width: int = 2048
    heads: int = 32
    expansion: int = 4
    seq_len: int = 1024
    sinkhorn_iters: int = 20
    hc_scale_init: float = 0.01
    mhc_gate_init: float = 0.01
    mhc_res_diag: float = 4.0
    mhc_pre_bias: float = 4.0
    norm_eps: float = 1e-5
    attn: str = "auto"
    activation_checkpointing: bool = False
    compile: bool = False
    dtype: str = "auto"
    # optimisation
    batch_size: int = 32
    micro_batch_size: str = "auto"
    steps: int = 10_000
    lr: float = 1e-4
    warmup: int = 500
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    no_mixing_decay: bool = False
    seed: int = 42
    allow_changed_settings: bool = False
    # data
    data: str = "c4"
    val_data: str = ""
    tokenizer: str = "gpt2"
    data_seed: int = 1234
    data_streams: int = 8
    data_workers: int = 1
    prefetch: int = 4
    data_timeout: float = 600.0
    shuffle_buffer: int = 1024
    # measurement
    eval_every: int = 500
    eval_batches: int = 20
    metrics_every: int = 50
    layer_metrics_every: int = 500
    probe_sequences: int = 8
    log_every: int = 10
    # run folder and services
    ckpt_every: int = 1000
    keep_checkpoints: int = 2
    out: str = "runs"
    run_name: str = ""
    resume: str = "auto"
    parallel: str = "ddp"
    wandb: str = "auto"
    wandb_project: str = ""
    estimate: bool = False
    estimate_world_size: int = 0
    gpu_memory_gb: float = 0.0

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


PRESETS = {
    "c4": {},
    # a few thousand parameters: the test suite's model
    "tiny": dict(depth=2, width=16, heads=2, expansion=4, seq_len=32, batch_size=4, micro_batch_size="2",
                 steps=20, lr=3e-3, warmup=2, data="sample", tokenizer="byte", eval_every=10,
                 eval_batches=2, metrics_every=5, layer_metrics_every=10, probe_sequences=2,
                 log_every=5, ckpt_every=10, shuffle_buffer=64, data_streams=2, data_workers=0, wandb="disabled"),
    # CPU minutes on the bundled Shakespeare: large enough learning rate for HC to drift visibly
    "demo": dict(depth=4, width=128, heads=4, seq_len=128, batch_size=16, micro_batch_size="16",
                 steps=600, lr=3e-3, warmup=50, data="sample", tokenizer="byte", eval_every=100,
                 eval_batches=4, metrics_every=20, layer_metrics_every=100, probe_sequences=4,
                 log_every=20, ckpt_every=200, shuffle_buffer=64, data_workers=0),
    # the public 10M-parameter small-scale reproduction (character-level Shakespeare)
    "part1": dict(depth=6, width=384, heads=6, seq_len=256, batch_size=64, micro_batch_size="16",
                  steps=5000, lr=1e-3, warmup=100, data="sample", tokenizer="byte", eval_every=250,
                  eval_batches=8, metrics_every=50, layer_metrics_every=250, log_every=50,
                  ckpt_every=500, shuffle_buffer=64, data_workers=0),
    # the public 1.7B study's stress arm (run at depths 32, 48 and 64): 3x the learning rate, 3000 steps
    "stress": dict(lr=3e-4, steps=3000),
}

CHOICES = dict(residual=("baseline", "hc", "mhc"), preset=tuple(PRESETS), attn=("auto", "flash", "sdpa"),
               dtype=("auto", "bf16", "fp32"), tokenizer=("gpt2", "byte"), resume=("auto", "never"),
               parallel=("ddp", "fsdp"), wandb=("auto", "online", "offline", "disabled"))

HELP = dict(
    residual="residual path: plain pre-norm residual, dynamic HC, or manifold-constrained HC",
    depth="number of transformer blocks (each has an attention and an MLP sublayer)",
    width="model width C", heads="attention heads (width must divide by it)",
    expansion="number of residual streams n for HC and mHC", seq_len="context length in tokens",
    sinkhorn_iters="Sinkhorn-Knopp iterations per mHC mixing matrix",
    hc_scale_init="initial HC dynamic scales s_a, s_b", mhc_gate_init="initial mHC gates a_pre, a_post, a_res",
    mhc_res_diag="mHC b_res = c * I: the diagonal bias of H_res's logits (c=4: diagonal ~0.95 at init)",
    mhc_pre_bias="mHC b_pre: +c on stream (k mod n), -c elsewhere", norm_eps="epsilon of every LayerNorm",
    attn="attention kernel: flash-attn 2, PyTorch SDPA, or auto (flash when installed on CUDA with bf16)",
    activation_checkpointing="recompute each sublayer (and its stream mixing) in the backward pass",
    compile="torch.compile each transformer block", dtype="autocast dtype (auto: bf16 on CUDA, fp32 on CPU)",
    batch_size="global sequences per optimizer step, whatever the number of processes",
    micro_batch_size="sequences per device per forward ('auto' picks from memory)",
    steps="optimizer steps", lr="peak learning rate", warmup="linear warm-up steps",
    min_lr_ratio="cosine decays to lr * this", weight_decay="AdamW weight decay (weight matrices only)",
    grad_clip="clip the global gradient norm to this (0 = off); the pre-clip norm is logged",
    no_mixing_decay="no weight decay on the dynamic mixing weights (HC's W_m, W_r, W_b; mHC's phi), which are "
    "otherwise decayed like every weight matrix",
    seed="model initialisation seed",
    allow_changed_settings="resume a run folder although its training settings (lr, steps, batch, schedule, seed, "
    "data) differ from this command's; the change is recorded in the run folder (settings_changes.jsonl)",
    data="'c4' (the hub), 'sample' (bundled Shakespeare) or a path/glob "
    "of C4-format .json/.json.gz files; files with 'validation' in their names are held out, never trained on",
    val_data="a path/glob of C4-format files for validation and the probe (never trained on); without it and "
    "without 'validation' files, a fixed slice of the training documents, chosen by a hash of their text, is "
    "held out instead (docs/data.md)",
    tokenizer="gpt2 BPE (shipped in data/) or UTF-8 bytes",
    data_seed="document-order seed, independent of --seed",
    data_streams="disjoint virtual data streams (sequence p of every global batch comes from stream p mod this); "
    "any number of processes that divides the global batch reads the same data",
    data_workers="loader processes per rank, each reading and tokenizing its share of the rank's streams "
    "(0: a background thread of the training process)",
    prefetch="micro-batches read ahead by the background loader thread (with --data-workers 0)",
    data_timeout="seconds without a batch before the run stops with exit 6 instead of hanging",
    shuffle_buffer="documents in the shuffle buffer",
    eval_every="steps between validation losses", eval_batches="micro-batches in the fixed validation set",
    metrics_every="steps between instability probes", layer_metrics_every="steps between per-layer gain lists",
    probe_sequences="held-out sequences in the fixed probe batch", log_every="steps between plain log lines",
    ckpt_every="steps between checkpoints", keep_checkpoints="complete checkpoints kept (newest)",
    out="folder holding the run folders", run_name="run folder name (default {residual}_d{depth}_s{seed})",
    resume="auto: continue from the newest complete checkpoint; never: refuse an existing run",
    parallel="strategy under torchrun", wandb="Weights & Biases mode; beats $WANDB_MODE (auto: $WANDB_MODE when set, "
    "else online with credentials, offline without)",
    wandb_project="W&B project (default: $WANDB_PROJECT, else hc-mhc-c4)",
    preset="a named set of defaults; explicit flags win",
    estimate="print the model size, the memory plan per GPU and the time per step, and stop (train nothing)",
    estimate_world_size="processes the --estimate plan is for (0: $WORLD_SIZE, else 1); with --parallel fsdp "
    "the parameters, gradients and optimizer states are sharded over them",
    gpu_memory_gb="GiB of one GPU for --estimate and --micro-batch-size auto (0: the CUDA device's own, else 80)",
)


# --help's argument groups: every Config field in exactly one (a test checks it)
FLAG_GROUPS = {
    "model": ("preset", "residual", "depth", "width", "heads", "expansion", "seq_len", "sinkhorn_iters",
              "hc_scale_init", "mhc_gate_init", "mhc_res_diag", "mhc_pre_bias", "norm_eps", "attn", "dtype"),
    "optimisation": ("batch_size", "micro_batch_size", "steps", "lr", "warmup", "min_lr_ratio", "weight_decay",
                     "grad_clip", "no_mixing_decay", "seed", "compile", "activation_checkpointing"),
    "data": ("data", "val_data", "tokenizer", "data_seed", "data_streams", "data_workers", "prefetch", "data_timeout",
             "shuffle_buffer"),
    "measurement and logging": ("eval_every", "eval_batches", "metrics_every", "layer_metrics_every",
                                "probe_sequences", "log_every", "wandb", "wandb_project"),
    "run folder and checkpoints": ("out", "run_name", "resume", "allow_changed_settings", "ckpt_every",
                                   "keep_checkpoints"),
    "parallelism": ("parallel",),
    "planning": ("estimate", "estimate_world_size", "gpu_memory_gb"),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def presets_text() -> str:
    """The presets and what each one sets, for --help."""
    return "presets (explicit flags win):\n" + "\n".join(textwrap.fill(
        f"{name}: " + (", ".join(f"{_flag(k)} {v}" for k, v in values.items()) or "the defaults above"),
        width=100, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False)
        for name, values in PRESETS.items())


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse's own checks, reported as one line (and exit 2) instead of the usage block."""

    def error(self, message):
        raise ConfigError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    epilog = (presets_text() + "\n\npython train_c4.py --consolidate CHECKPOINT OUT.pt writes one file with the "
              "weights of a checkpoint\n(FSDP's sharded ones included), loadable without a process group.")
    parser = _OneLineErrorParser(description="Train baseline / HC / mHC transformers on C4.", epilog=epilog,
                                 argument_default=argparse.SUPPRESS, formatter_class=argparse.RawDescriptionHelpFormatter)
    fields = {field.name: field for field in dataclasses.fields(Config)}
    for title, names in FLAG_GROUPS.items():
        group = parser.add_argument_group(title)
        for field in (fields[name] for name in names):
            flag = _flag(field.name)
            if field.type == "bool":
                group.add_argument(flag, action="store_true", help=HELP[field.name])
            else:
                kind = {"int": int, "float": float}.get(field.type, str)
                group.add_argument(flag, type=kind, choices=CHOICES.get(field.name), help=HELP[field.name]
                                   + f" (default {field.default!r}, or the preset's)")
    return parser


def parse_config(argv: list[str] | None = None) -> Config:
    """Defaults, then the preset, then explicit flags; every check that can fail before a run starts."""
    explicit = vars(build_parser().parse_args(argv))
    preset = explicit.get("preset", "c4")
    values = {**PRESETS[preset], **explicit}
    cfg = Config(**values)
    validate(cfg)
    if not cfg.run_name:
        cfg = dataclasses.replace(cfg, run_name=contract.run_name(cfg.residual, cfg.depth, cfg.seed, cfg.preset))
    return cfg


# Upper bounds far above any real run. Beyond them the model built on the meta device (--estimate), the planner's
# CPU measurements (at 4 x --heads), the divisor search or the loader would loop or allocate without end before any
# memory check could refuse them. Integers are int64 (torch.manual_seed, tensor sizes); --data-timeout also bounds
# a queue wait and the collective time-out. Magnitudes of the initial values and of lr x weight decay stay far inside
# float32: near its 3.4e38 a parameter starts as inf (a fake divergence at step 1) or AdamW cannot convert its factor.
LIMITS = dict(depth=1024, width=65536, heads=512, expansion=64, seq_len=2 ** 20, batch_size=2 ** 20,
              sinkhorn_iters=10_000, data_streams=4096, prefetch=1024, shuffle_buffer=2 ** 20,
              estimate_world_size=2 ** 20, data_timeout=1e6, gpu_memory_gb=1e6, lr=1e3, weight_decay=1e3,
              hc_scale_init=1e6, mhc_gate_init=1e6, mhc_res_diag=1e6, mhc_pre_bias=1e6)
INT64_MAX = 2 ** 63 - 1


def validate(cfg: Config) -> None:
    """Every numeric setting: finite, within its range; nothing is built or read here."""
    numbers = [(f.name, getattr(cfg, f.name), f.type) for f in dataclasses.fields(Config) if f.type in ("int", "float")]
    for name, value, kind in numbers:
        if kind == "float" and not math.isfinite(value):
            raise ConfigError(f"{_flag(name)} must be a finite number, got {value}")
    positive = ("depth", "width", "heads", "expansion", "seq_len", "batch_size", "steps", "sinkhorn_iters",
                "eval_every", "eval_batches", "metrics_every", "layer_metrics_every", "probe_sequences",
                "log_every", "ckpt_every", "keep_checkpoints", "data_streams", "prefetch",
                "data_timeout", "norm_eps")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{_flag(name)} must be positive, got {getattr(cfg, name)}")
    for name, value, kind in numbers:
        if kind == "int" and not 0 <= value <= INT64_MAX:
            raise ConfigError(f"{_flag(name)} must be an integer in [0, 2**63 - 1], got {value}")
        if name in LIMITS and abs(value) > LIMITS[name]:
            raise ConfigError(f"{_flag(name)} {value} is beyond the plausible magnitude {LIMITS[name]:,}")
    if cfg.width % cfg.heads:
        raise ConfigError(f"--width {cfg.width} is not divisible by --heads {cfg.heads}")
    if cfg.micro_batch_size != "auto" and not (cfg.micro_batch_size.isdigit() and int(cfg.micro_batch_size) > 0):
        raise ConfigError(f"--micro-batch-size must be a positive integer or 'auto', got {cfg.micro_batch_size!r}")
    if cfg.gpu_memory_gb < 0:
        raise ConfigError(f"--gpu-memory-gb must be >= 0 (0: the CUDA device's memory), got {cfg.gpu_memory_gb}")
    if cfg.lr <= 0 or cfg.grad_clip < 0 or cfg.weight_decay < 0 or not 0 <= cfg.min_lr_ratio <= 1:
        raise ConfigError("--lr must be > 0, --grad-clip and --weight-decay >= 0, --min-lr-ratio in [0, 1]")
    if os.sep in cfg.run_name or cfg.run_name.startswith("."):
        raise ConfigError(f"--run-name {cfg.run_name!r} must be a plain folder name")


def padded_vocab_size(tokenizer: str) -> int:
    # GPT-2's 50257 padded to a multiple of 64: the embedding matmuls run on aligned shapes
    return 256 if tokenizer == "byte" else 50304


# ----------------------------------------------------------------------------------------------
# model: GPT-2 body with a switchable residual path (plain, HC, mHC) acting on n persistent streams

class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config, use_flash: bool):
        super().__init__()
        self.heads, self.use_flash = cfg.heads, use_flash
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).unbind(2)
        if self.use_flash:
            from flash_attn import flash_attn_func
            y = flash_attn_func(q, k, v, causal=True)
        else:
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True).transpose(1, 2)
        return self.proj(y.reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.fc = nn.Linear(cfg.width, 4 * cfg.width, bias=False)
        self.proj = nn.Linear(4 * cfg.width, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class StreamNorm(nn.LayerNorm):
    """LayerNorm in its input's dtype. Under FSDP its weights arrive in bf16 while the streams it reads are
    fp32 (precision_policy): the weights are cast to the input, which CUDA's autocast does anyway (layer_norm
    runs in fp32 there) and CPU's autocast refuses to do."""

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(u, self.normalized_shape, self.weight.to(u.dtype), self.bias.to(u.dtype), self.eps)


class PreNorm(nn.Module):
    """F(norm(u)): the block's own pre-norm sublayer, identical for all three residual paths."""

    def __init__(self, cfg: Config, inner: nn.Module):
        super().__init__()
        self.norm = StreamNorm(cfg.width, eps=cfg.norm_eps)
        self.inner = inner

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.inner(self.norm(u))


def stream_update(x, H_pre, H_post, H_res, sublayer):
    """x_next = H_res @ x + H_post^T * F(norm(H_pre @ x)) for every token; x is (..., n, C), stored stream-major
    (GPT.forward). The coefficients come with their stream (and matrix) axes first, as the connections compute
    them: H_pre and H_post (n, ...), H_res (n, n, ...) with H_res[i, j] the weight of stream j in stream i."""
    # Autocast is off: the streams are mixed in their own dtype, never rounded to bf16 on the way. The Functions
    # take x as n slabs of (..., C)
    with _autocast_off(x):
        u, streams = _StreamRead.apply(H_pre.to(x.dtype), x.movedim(-2, 0))
    y = sublayer(u)
    with _autocast_off(x):
        return _StreamWrite.apply(H_res.to(x.dtype), streams, H_post.to(x.dtype), y.to(x.dtype))


def _token_dots(a, b):
    """(..., p, q): per token, the dot products over C of a's p slabs (p, ..., C) with b's q slabs (q, ..., C).
    One batched matmul over the tokens, (p x C) @ (C x q) each, read straight from the stream-major slabs."""
    p, q, C = a.shape[0], b.shape[0], a.shape[-1]
    tokens = a.shape[1:-1]
    return torch.bmm(a.reshape(p, -1, C).transpose(0, 1), b.reshape(q, -1, C).permute(1, 2, 0)).view(*tokens, p, q)


def _mixed_slabs(H, slabs):
    """(n, ..., C) with slab i = sum_j H[i, j] * slabs[j], for per-token weights H (n, m, ...) and slabs (m, ..., C):
    m scaled adds of contiguous (..., C) slabs, all n destinations at once: the per-token (n x m) @ (m x C) product
    without one tiny matmul per token, which the CPU runs at ~6 GFLOP/s (benchmarks.md). The result is a new
    stream-major tensor, whatever the layout of the slabs."""
    # H contiguous (a small copy at most) puts the destination axis first in the product's inferred layout, in eager
    # and in torch.compile's functionalised graph alike (an out= argument would hold in eager only)
    weights, sources = H.contiguous().unsqueeze(-1).unbind(1), slabs.unbind(0)    # two ops, not two per source
    out = weights[0] * sources[0]
    for weight, source in zip(weights[1:], sources[1:]):
        out.addcmul_(weight, source)
    return out


class _StreamRead(torch.autograd.Function):
    """u = sum_j H_pre[j] x[j] per token, for H_pre (n, ...) and the stream slabs x (n, ..., C); x is passed through
    as a second output for _StreamWrite to read. The backward is written out so that this term of x's gradient is
    added in place into the one the write created, where autograd would add the two into a new n x C tensor
    per token (benchmarks.md)."""

    @staticmethod
    def forward(ctx, H_pre, streams):
        ctx.save_for_backward(H_pre, streams)
        # passed through as a detached alias (same storage, no copy): returning the input itself makes autograd
        # wrap it as a view, which torch.compile's tracing of the Function rejects
        return _mixed_slabs(H_pre.unsqueeze(0), streams)[0], streams.detach()

    @staticmethod
    def backward(ctx, grad_u, grad_streams):
        H_pre, streams = ctx.saved_tensors
        # grad_streams is _StreamWrite's own new tensor (or autograd's materialised zeros): nothing else holds it
        grad_x = grad_streams.addcmul_(H_pre.unsqueeze(-1), grad_u)
        return _token_dots(grad_u.unsqueeze(0), streams).squeeze(-2).movedim(-1, 0), grad_x


class _StreamWrite(torch.autograd.Function):
    """x_next[i] = sum_j H_res[i, j] x[j] + H_post[i] y per token, for H_res (n, n, ...), the stream slabs
    x (n, ..., C), H_post (n, ...), y (..., C); the result is the state (..., n, C), stored stream-major. The
    backward is written out (scaled adds of slabs for x and y, per-token dot products for the coefficients) and
    guarantees what _StreamRead relies on: x's gradient is a new tensor of its own."""

    @staticmethod
    def forward(ctx, H_res, streams, H_post, y):
        ctx.save_for_backward(H_res, streams, H_post, y)
        # returned as a detached alias of the stream-major slabs, not as a view of them: FSDP2 warns of every view
        # a wrapped module returns (an in-place op on it would skip its all-gather), and nothing else holds them
        return _mixed_slabs(H_res, streams).addcmul_(H_post.unsqueeze(-1), y).movedim(0, -2).detach()

    @staticmethod
    def backward(ctx, grad):
        H_res, streams, H_post, y = ctx.saved_tensors
        grad = grad.movedim(-2, 0)          # the slabs: stream-major as the next connection's backward made it
        # x's gradient (n slabs) and y's (one more) in one pass over grad; the slabs do not overlap
        grad_x_y = _mixed_slabs(torch.cat([H_res.transpose(0, 1), H_post.unsqueeze(0)]), grad)
        return (_token_dots(grad, streams).movedim((-2, -1), (0, 1)), grad_x_y[:-1],
                _token_dots(grad, y.unsqueeze(0)).squeeze(-1).movedim(-1, 0), grad_x_y[-1])


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Project exp(logits) onto the doubly stochastic matrices with `iters` column-then-row normalisations;
    rows are normalised last, so row sums are exact. Computed in at least fp32 (bf16 input is promoted).

    The first pair runs in the log domain (subtracting logsumexps): the same maths as dividing exp(logits) by
    its sums, but it cannot overflow or divide by zero, and afterwards every row holds an entry >= 1/n and
    every column one >= 1/n^2. So the remaining pairs, plain divisions on the cheaper linear scale, never
    meet a zero sum either, whatever the logits' range (+-1e4, a column that would underflow entirely)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # the work runs with the matrix axes first and the tokens last: each sum over a matrix axis then adds n
    # contiguous rows of tokens, ~7x faster on the CPU than n-element reductions per token (benchmarks.md)
    balanced = logits.movedim((-2, -1), (0, 1)).contiguous()
    balanced = balanced - balanced.logsumexp(0, keepdim=True)
    balanced = balanced - balanced.logsumexp(1, keepdim=True)
    # returned as a view of that layout: the stream update reads H_res with the matrix axes first as well
    return _SinkhornNormalisations.apply(balanced.exp(), iters - 1).movedim((0, 1), (-2, -1))


class _SinkhornNormalisations(torch.autograd.Function):
    """iters times: P /= column sums, then P /= row sums, for matrices P (n, n, ...) stored with the matrix axes
    first; forward identical to the plain loop. The backward is written out: through Q = P / s (s: sums over one
    axis), dP = (dQ - sum(dQ * Q)) / s over that axis, which is 4 small kernels per half-step where autograd
    runs about 8 (the Sinkhorn is hundreds of tiny ops). Only the sums and the final P are kept: the backward
    walks the iterations in reverse and recovers each earlier P as Q * s, so per token and iteration it keeps the
    2n sums instead of 2n^2 + 2n numbers (benchmarks.md)."""

    @staticmethod
    def forward(ctx, P, iters):
        sums = []
        for _ in range(iters):
            for dim in (0, 1):
                sums.append(P.sum(dim, keepdim=True))
                P = P / sums[-1]
        ctx.save_for_backward(P, *sums)
        return P

    @staticmethod
    def backward(ctx, grad):
        Q, *sums = ctx.saved_tensors
        grad = grad.contiguous()            # it arrives in the caller's tokens-first layout: every op would keep it
        for k in reversed(range(len(sums))):
            s = sums[k]
            grad = (grad - (grad * Q).sum(k % 2, keepdim=True)) / s
            if k:
                Q = Q * s                   # the P this half-step divided: the previous half-step's result
        return grad, None


def _autocast_off(x: torch.Tensor):
    # mixing coefficients are computed in fp32 and the streams mixed in their own dtype, whatever the autocast
    return torch.autocast(x.device.type, enabled=False)


class PlainResidual(nn.Module):
    """Baseline: x + F(norm(x)) on a single stream; it has no mixing matrix (reported as gain 1).

    Every connection returns the next state and its mixing record for the probe: None here, (H_res, None)
    for HC, (H_res, the logits Sinkhorn projected) for mHC, so that the probe can measure the projection."""

    def forward(self, x, sublayer):
        return x + sublayer(x.squeeze(-2)).unsqueeze(-2), None


class _StreamMixing(nn.Module):
    """HC and mHC: coefficients from the streams (the subclass's), then the shared stream update.

    The subclass's streams_and_coefficients(x) returns x passed through its coefficient projection, then
    H_pre, H_post, H_res with their stream axes first (stream_update) and the logits Sinkhorn projected (None
    for HC). The stream update reads the passed-through x, so x's whole gradient reaches the projection's
    backward, which adds its own term in place (see _StreamRead): one n x C gradient per token and sublayer
    instead of five (benchmarks.md)."""

    def forward(self, x, sublayer):
        x, H_pre, H_post, H_res, res_logits = self.streams_and_coefficients(x)
        # the record is for measuring, not for training: detached, it is no view FSDP2 would warn of either
        record = H_res.detach().movedim((0, 1), (-2, -1)), None if res_logits is None else res_logits.detach()
        return stream_update(x, H_pre, H_post, H_res, sublayer), record

    def coefficients(self, x):
        """H_pre (..., n), H_post (..., n), H_res (..., n, n) and res_logits of the streams x (..., n, C)."""
        _, H_pre, H_post, H_res, res_logits = self.streams_and_coefficients(x)
        return H_pre.movedim(0, -1), H_post.movedim(0, -1), H_res.movedim((0, 1), (-2, -1)), res_logits


class HyperConnection(_StreamMixing):
    """Dynamic HC (arXiv 2409.19606): per-stream read, mix and write weights, tanh-scaled around static ones."""

    def __init__(self, cfg: Config, sublayer_index: int):
        super().__init__()
        n = cfg.expansion
        self.n, self.eps, self.sublayer_index = n, cfg.norm_eps, sublayer_index
        # one fused projection for W_m (1 column), W_r (n columns) and W_b (1 column)
        self.dynamic = nn.Linear(cfg.width, n + 2, bias=False)
        self.A_m_static = nn.Parameter(torch.zeros(n))
        self.A_r_static = nn.Parameter(torch.zeros(n, n))
        self.B_static = nn.Parameter(torch.zeros(n))
        self.s_a = nn.Parameter(torch.zeros(()))
        self.s_b = nn.Parameter(torch.zeros(()))
        self.scale_init = cfg.hc_scale_init
        self.reset_mixing()

    @torch.no_grad()
    def reset_mixing(self):
        # the HC paper's init, under which HC computes exactly a pre-norm transformer
        self.dynamic.weight.zero_()
        self.A_m_static.copy_(F.one_hot(torch.tensor(self.sublayer_index % self.n), self.n).float())
        self.A_r_static.copy_(torch.eye(self.n))
        self.B_static.fill_(1.0)
        self.s_a.fill_(self.scale_init)
        self.s_b.fill_(self.scale_init)

    def streams_and_coefficients(self, x):
        with _autocast_off(x):
            H_pre, H_post, H_res, x = _HCCoefficients.apply(
                x, self.dynamic.weight.float(), self.A_m_static.float(), self.A_r_static.float(),
                self.B_static.float(), self.s_a.float(), self.s_b.float(), self.eps)
        return x, H_pre, H_post, H_res, None


class _HCCoefficients(torch.autograd.Function):
    """(H_pre, H_post, H_res, x) of HC for the streams x (..., n, C), x passed through (see _StreamMixing).

    Per stream i and token: z = layer_norm(x_i) @ W^T (no affine), d = tanh(z), and the k = n + 2 coefficients
    c = static_i + scale * d: c_0 = A_m[i] (H_pre), c_1..n = A_r[i, :] (column i of H_res = A_r^T), c_n+1 = B[i]
    (H_post); scale is s_a, except s_b for B. All of it is one Function, computed k-major (k, n, tokens), so that
    each coefficient comes out as contiguous slabs with the stream axes first, as the stream update reads them,
    and autograd records one node instead of one per small op.

    The norm is folded into the projection: [W; 1/C] @ x gives the raw products and the mean in one thin matmul,
    a vector norm gives mean(x^2), and z = rstd (W x - mean W 1). So the normalised copy of the state is never
    written. The variance mean(x^2) - mean^2 loses digits when a stream's mean is far above its spread
    (relative error ~ 1e-7 (mean / spread)^2; tests/test_perf.py checks mean 30x spread against the plain norm).
    The backward is written out: with g = dz rstd, dW = g^T x - (g . mean) 1^T and
    dx = g @ (W - row means) - rstd (g . z) (x - mean) / C, accumulated in place into x's incoming gradient."""

    @staticmethod
    def forward(ctx, x, W, A_m_static, A_r_static, B_static, s_a, s_b, eps):
        n, C = x.shape[-2:]
        tokens = x.shape[:-2]
        xs = x.movedim(-2, 0).to(W.dtype).reshape(-1, C)                      # (n tokens, C), a view in the model
        raw = torch.cat([W, W.new_full((1, C), 1 / C)]) @ xs.t()               # (k + 1, n tokens)
        mean = raw[-1]
        var = (torch.linalg.vector_norm(xs, dim=-1).square_().div_(C) - mean.square()).clamp_min_(0)
        rstd = var.add_(eps).rsqrt_()
        z = raw[:-1].addcmul_(W.sum(-1, keepdim=True), mean, value=-1).mul_(rstd)
        d = torch.tanh(z)
        scale = torch.cat([s_a.expand(n + 1), s_b.view(1)]).unsqueeze(-1)       # (k, 1)
        statics = torch.cat([A_m_static.view(1, n), A_r_static.t(), B_static.view(1, n)]).unsqueeze(-1)
        coef = torch.addcmul(statics, d.view(n + 2, n, -1), scale.unsqueeze(-1))    # (k, n, tokens)
        ctx.save_for_backward(xs, W, mean, rstd, z, d, scale)
        ctx.x_shape, ctx.scale_shapes = x.shape, (s_a.shape, s_b.shape)     # () or, under FSDP, (1,)
        return (coef[0].view(n, *tokens), coef[n + 1].view(n, *tokens), coef[1:n + 1].view(n, n, *tokens),
                x.detach())

    @staticmethod
    def backward(ctx, grad_pre, grad_post, grad_res, grad_x):
        xs, W, mean, rstd, z, d, scale = ctx.saved_tensors
        n, C = ctx.x_shape[-2:]
        # the gradients arrive in whatever layout their consumers made: cat copies them into one k-major tensor
        grad_coef = torch.cat([grad_pre.unsqueeze(0), grad_res, grad_post.unsqueeze(0)]).view(n + 2, -1)
        grad_statics = grad_coef.view(n + 2, n, -1).sum(-1)                       # (k, n)
        by_scale = (grad_coef * d).sum(-1)
        g = grad_coef.mul_(scale).mul_(1 - d.square()).mul_(rstd)               # dz rstd, (k, n tokens)
        grad_W = (g @ xs).sub_((g @ mean).unsqueeze(-1))
        # the mean's term of dx joins the matmul as one more row: [g; -a mean] @ [W - row means; 1]
        a = (g * z).sum(0).mul_(rstd / -C)
        lhs = torch.cat([g, (a * mean).neg_().unsqueeze(0)])
        rhs = torch.cat([W - W.mean(-1, keepdim=True), W.new_ones(1, C)])
        dtype, gx = grad_x.dtype, grad_x.movedim(-2, 0).to(W.dtype).reshape(-1, C)     # a view when stream-major
        gx.addmm_(lhs.t(), rhs).addcmul_(xs, a.unsqueeze(-1))
        grad_x = gx.view(n, *ctx.x_shape[:-2], C).movedim(0, -2).to(dtype)
        return (grad_x, grad_W, grad_statics[0], grad_statics[1:n + 1].t(), grad_statics[n + 1],
                by_scale[:n + 1].sum().view(ctx.scale_shapes[0]), by_scale[n + 1].view(ctx.scale_shapes[1]), None)


class ManifoldHyperConnection(_StreamMixing):
    """mHC (arXiv 2512.24880): coefficients from the whole flattened state, H_res doubly stochastic."""

    def __init__(self, cfg: Config, sublayer_index: int):
        super().__init__()
        n = cfg.expansion
        self.n, self.iters, self.eps = n, cfg.sinkhorn_iters, cfg.norm_eps
        self.sublayer_index, self.cfg_init = sublayer_index, (cfg.mhc_gate_init, cfg.mhc_pre_bias, cfg.mhc_res_diag)
        self.phi = nn.Linear(n * cfg.width, n * n + 2 * n, bias=False)    # [z_pre | z_post | z_res]
        self.a_pre, self.a_post, self.a_res = (nn.Parameter(torch.zeros(())) for _ in range(3))
        self.b_pre, self.b_post = nn.Parameter(torch.zeros(n)), nn.Parameter(torch.zeros(n))
        self.b_res = nn.Parameter(torch.zeros(n, n))
        self.reset_mixing()

    @torch.no_grad()
    def reset_mixing(self):
        gate, pre_bias, res_diag = self.cfg_init
        self.phi.weight.zero_()
        for a in (self.a_pre, self.a_post, self.a_res):
            a.fill_(gate)
        own = F.one_hot(torch.tensor(self.sublayer_index % self.n), self.n).bool()
        self.b_pre.copy_(torch.where(own, pre_bias, -pre_bias))
        self.b_post.zero_()
        self.b_res.copy_(res_diag * torch.eye(self.n))

    def streams_and_coefficients(self, x):
        n = self.n
        with _autocast_off(x):
            z, x = _RMSScaledProjection.apply(x, self.phi.weight.float(), self.eps)
            z_pre, z_post, z_res = z.split([n, n, n * n], dim=-1)
            H_pre = torch.sigmoid(self.a_pre.float() * z_pre + self.b_pre.float())
            H_post = 2 * torch.sigmoid(self.a_post.float() * z_post + self.b_post.float())
            res_logits = self.a_res.float() * z_res.unflatten(-1, (n, n)) + self.b_res.float()
            H_res = sinkhorn(res_logits, self.iters)
        # sinkhorn's result is a view of a matrix-axes-first tensor: back to that layout, no copy
        return x, H_pre.movedim(-1, 0), H_post.movedim(-1, 0), H_res.movedim((-2, -1), (0, 1)), res_logits


class _RMSScaledProjection(torch.autograd.Function):
    """(z, x) with z = (v @ phi^T) / sqrt(mean(v^2) + eps), v the flattened streams vec(x) of x (..., n, C), in phi's
    dtype; x is passed through (see _StreamMixing). v is never formed: its columns are the n stream-major slabs, so
    v @ phi^T is a sum of n (tokens x C) @ (C x k) products (one batched matmul) and the RMS a sum of per-stream norms.
    The backward is written out: the RMS term's gradient, a per-token multiple of x, and the projection's are added
    in place into x's incoming gradient, where autograd writes five nC-sized tensors per token (the projection's,
    the norm's three, their sum) and a sixth to add them to x's."""

    @staticmethod
    def forward(ctx, x, phi, eps):
        n, C = x.shape[-2:]
        xs = x.movedim(-2, 0).to(phi.dtype)     # fp32 in the model (the weight is cast to it)
        phis = phi.view(-1, n, C).transpose(0, 1)                               # (n, k, C): stream j's columns
        raw = torch.bmm(xs.reshape(n, -1, C), phis.transpose(1, 2)).sum(0).view(*x.shape[:-2], -1)
        # norms, not vecdot(x, x): that multiplies into an nC-sized temporary first
        inv_rms = torch.rsqrt(torch.linalg.vector_norm(xs, dim=-1).square().sum(0).unsqueeze(-1) / (n * C) + eps)
        ctx.save_for_backward(xs, phi, raw, inv_rms)
        return raw * inv_rms, x.detach()        # passed through as in _StreamRead

    @staticmethod
    def backward(ctx, grad, grad_x):
        xs, phi, raw, inv_rms = ctx.saved_tensors
        n, C = xs.shape[0], xs.shape[-1]
        grad_raw = (grad * inv_rms).reshape(-1, phi.shape[0])                   # (tokens, k)
        # d inv_rms / dv = -inv_rms^3 v / N
        coef = (grad * raw).sum(-1, keepdim=True) * inv_rms.pow(3) / -(n * C)
        phis = phi.view(-1, n, C).transpose(0, 1)
        # accumulated in place when grad_x is already stream-major; autograd's materialised zeros get a copy
        dtype, gx = grad_x.dtype, grad_x.movedim(-2, 0).to(phi.dtype).contiguous()
        gx.view(n, -1, C).baddbmm_(grad_raw.expand(n, *grad_raw.shape), phis).addcmul_(xs.reshape(n, -1, C),
                                                                                       coef.reshape(1, -1, 1))
        grad_phi = torch.bmm(grad_raw.t().expand(n, *grad_raw.t().shape), xs.reshape(n, -1, C))
        return gx.to(dtype).movedim(0, -2), grad_phi.transpose(0, 1).reshape(phi.shape), None


CONNECTIONS = {"baseline": lambda cfg, k: PlainResidual(), "hc": HyperConnection, "mhc": ManifoldHyperConnection}


class Block(nn.Module):
    """Maps the residual state (B, T, n, C) to (B, T, n, C): the streams persist across blocks."""

    def __init__(self, cfg: Config, index: int, use_flash: bool):
        super().__init__()
        self.attn = PreNorm(cfg, CausalSelfAttention(cfg, use_flash))
        self.mlp = PreNorm(cfg, MLP(cfg))
        self.attn_conn = CONNECTIONS[cfg.residual](cfg, 2 * index)
        self.mlp_conn = CONNECTIONS[cfg.residual](cfg, 2 * index + 1)
        self.activation_checkpointing = cfg.activation_checkpointing

    def forward(self, x, return_mixing: bool = False):
        # the mixing records are returned, not appended to a caller's list: a list argument makes torch.compile guard on
        # its length, i.e. one graph per block index in the probe, past dynamo's limit of 8 at depth > 6
        mixing = []
        for conn, sublayer in ((self.attn_conn, self.attn), (self.mlp_conn, self.mlp)):
            if self.activation_checkpointing and torch.is_grad_enabled():
                # the stream mixing is recomputed with the sublayer: storing it would cost n x C per token
                x, record = checkpoint(conn, x, sublayer, use_reentrant=False)
            else:
                x, record = conn(x, sublayer)
            mixing.append(record)
        return (x, mixing) if return_mixing else x


class GPT(nn.Module):
    def __init__(self, cfg: Config, use_flash: bool = False):
        super().__init__()
        self.streams = 1 if cfg.residual == "baseline" else cfg.expansion
        self.wte = nn.Embedding(padded_vocab_size(cfg.tokenizer), cfg.width)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg, i, use_flash) for i in range(cfg.depth))
        self.ln_f = StreamNorm(cfg.width, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.width, self.wte.num_embeddings, bias=False)
        self.lm_head.weight = self.wte.weight
        self._init_weights(cfg.depth)

    @torch.no_grad()
    def _init_weights(self, depth: int):
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                # GPT-2: residual output projections scaled by 1/sqrt(number of residual additions)
                std = 0.02 / math.sqrt(2 * depth) if name.endswith("inner.proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
        for module in self.modules():
            if hasattr(module, "reset_mixing"):
                module.reset_mixing()

    def forward(self, idx, targets=None, mixing_out: list | None = None):
        positions = torch.arange(idx.shape[1], device=idx.device)
        # the residual streams are fp32 in every mode (precision_policy): under FSDP the embeddings are bf16
        h = (self.wte(idx) + self.wpe(positions)).float()
        # expand once, into the stream-major layout every connection works in: the state is (B, T, n, C) stored as
        # (n, B, T, C), so that each stream is one contiguous slab and a per-token mixing is n x n scaled adds of
        # slabs (stream_update). Materialised: a stride-0 stream axis would make every slab the same memory.
        # The baseline's single stream keeps the strides its blocks return (torch.compile specialises on them)
        x = h.expand(self.streams, *h.shape).contiguous().movedim(0, -2) if self.streams > 1 else h.unsqueeze(-2)
        for block in self.blocks:
            if mixing_out is None:
                x = block(x)
            else:
                x, mixing = block(x, return_mixing=True)
                mixing_out.extend(mixing)
        if x.requires_grad and self.streams > 1:
            # the sum's backward hands the last block the same gradient for every stream through a stride-0
            # view; its per-token dot products (_token_dots) want each stream's gradient a slab of its own
            x.register_hook(lambda grad: grad.movedim(-2, 0).contiguous().movedim(0, -2))
        logits = self.lm_head(self.ln_f(x.sum(dim=-2)))                        # collapse once
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def decay_groups(model: nn.Module, weight_decay: float, decay_mixing: bool = True) -> list[dict]:
    """Weight decay on weight matrices of linears and embeddings only: never on norms, biases,
    HC static matrices and scales, or mHC gates and biases (those are raw Parameters, not layers).
    The dynamic mixing weights (the linears inside the connections) only with `decay_mixing`."""
    decay = {id(m.weight): m.weight for name, m in model.named_modules()
             if isinstance(m, (nn.Linear, nn.Embedding)) and (decay_mixing or "_conn." not in name)}
    rest = [p for p in model.parameters() if id(p) not in decay]
    return [{"params": list(decay.values()), "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW as one fused kernel per step on every device: the for-loop version PyTorch picks on the CPU runs ~10
    small ops per parameter tensor, and HC and mHC add 6-7 tensors per sublayer (benchmarks.md)."""
    return torch.optim.AdamW(decay_groups(model, cfg.weight_decay, not cfg.no_mixing_decay), lr=cfg.lr,
                             betas=(0.9, 0.95), fused=True)


def count_parameters(cfg: Config) -> dict:
    """Parameter counts from a model built on the meta device: no memory for the weights."""
    with torch.device("meta"):
        model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.wte.weight.numel() + model.wpe.weight.numel()
    streams = sum(p.numel() for name, p in model.named_parameters() if "_conn." in name)
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "streams": streams}


# ----------------------------------------------------------------------------------------------
# instability metrics: gains of the mixing matrices H_res (acting as x_next = H_res @ x), per token

def row_gain(M):
    """g_fwd: the largest absolute row sum."""
    return M.sum(dim=-1).abs().amax(dim=-1)


def col_gain(M):
    """g_bwd: the largest absolute column sum."""
    return M.sum(dim=-2).abs().amax(dim=-1)


def composites(H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix products P_k = H_k ... H_1 and suffix products S_k = H_L ... H_k of H (L, tokens, n, n)."""
    prefix, suffix = [H[0]], [H[-1]]
    for k in range(1, H.shape[0]):
        prefix.append(H[k] @ prefix[-1])
        suffix.append(suffix[-1] @ H[-1 - k])
    return torch.stack(prefix), torch.stack(suffix[::-1])


def study_gains(H: torch.Tensor) -> torch.Tensor:
    """The public 1.7B study's reading, for comparison with its figures: each sublayer's H averaged over the
    tokens, multiplied in increasing layer order (H_1 H_2 ... H_k, the reverse of the forward composite), and
    the larger of the largest absolute row sum and the largest absolute column sum; one value per k."""
    mean = H.mean(dim=1)
    products = list(itertools.accumulate(mean, torch.matmul))
    return torch.stack([torch.maximum(Q.abs().sum(-1).amax(), Q.abs().sum(-2).amax()) for Q in products])


def gain_metrics(H: torch.Tensor) -> dict:
    """Every probe metric from the per-token mixing matrices H (L sublayers, tokens, n, n); per-token
    gains are averaged over tokens, then the max (or min) over sublayers is taken."""
    H = H.double()
    P, S = composites(H)
    scalars = torch.stack([row_gain(P).mean(-1).max(), col_gain(S).mean(-1).max(),
                           P.abs().sum(-1).amax(-1).mean(-1).max(), S.abs().sum(-2).amax(-1).mean(-1).max(),
                           P.sum(-1).amin(-1).mean(-1).min(), S.sum(-2).amin(-1).mean(-1).min(), study_gains(H).max()])
    layers = torch.stack([row_gain(H).mean(-1), col_gain(H).mean(-1)])
    # one device-to-host copy for everything the probe logs, not one synchronisation per value
    values = torch.cat([scalars, layers.flatten()]).tolist()
    keys = ("amax_fwd", "amax_bwd", "amax_fwd_abs", "amax_bwd_abs", "min_row_sum", "min_col_sum", "amax_study")
    layer_fwd, layer_bwd = values[len(keys):len(keys) + H.shape[0]], values[len(keys) + H.shape[0]:]
    return {**dict(zip(keys, values)), "amax_l0_fwd": layer_fwd[0], "amax_l0_bwd": layer_bwd[0],
            "layer_gain_fwd": layer_fwd, "layer_gain_bwd": layer_bwd}


def unit_gain_metrics(sublayers: int) -> dict:
    """The plain residual has H_res = 1 by definition."""
    ones = torch.ones(sublayers, 1, 1, 1)
    return gain_metrics(ones)


def stochastic_errors(H: torch.Tensor) -> torch.Tensor:
    """How far each sublayer's H (L, tokens, n, n) is from doubly stochastic: (2, L) of max |row sum - 1| and
    max |column sum - 1| over the tokens."""
    return torch.stack([(H.sum(-1) - 1).abs().amax((1, 2)), (H.sum(-2) - 1).abs().amax((1, 2))])


@torch.no_grad()
def sinkhorn_converged(logits: torch.Tensor, tol: float = 1e-6, max_iters: int = 20_000) -> tuple[torch.Tensor, int]:
    """The probe's reference projection: the same logits, in fp64, iterated until every row and column sum is
    within `tol` of 1 (or `max_iters`); returns it and the iterations the slowest matrix took. Nearly
    permutation matrices can need thousands of iterations while most converge in tens, so each round of 20
    works only on the matrices still off; every check is one host synchronisation."""
    P = sinkhorn(logits.double(), 1)
    # (n, n, matrices): the matrix axes first, as _SinkhornNormalisations works
    matrices, done = P.reshape(-1, *P.shape[-2:]).movedim(0, -1).contiguous(), 1
    todo = torch.arange(matrices.shape[-1], device=P.device)
    while done < max_iters:
        off = matrices[..., todo]
        todo = todo[torch.maximum((off.sum(1) - 1).abs().amax(0), (off.sum(0) - 1).abs().amax(0)) > tol]
        if not len(todo):
            break
        matrices[..., todo] = _SinkhornNormalisations.apply(matrices[..., todo], 20)
        done += 20
    return matrices.movedim(-1, 0).reshape(P.shape), done


def projection_metrics(H: torch.Tensor, logits: torch.Tensor) -> dict:
    """mHC: the truncation error of the H_res the model used (per sublayer and the max), and the composite
    gains of the same logits projected to convergence, which is what the doubly stochastic manifold
    guarantees. The difference between the "as used" and the converged gains is Sinkhorn truncation."""
    converged, iters = sinkhorn_converged(logits)
    exact = gain_metrics(converged)
    # one device-to-host copy for the per-sublayer errors; their maxima are taken on the host
    layer_row, layer_col = stochastic_errors(H.double()).tolist()
    row_err, col_err = max(layer_row), max(layer_col)
    left = stochastic_errors(converged).max().item()
    # non-negative H whose column sums are within e_k of 1: no column sum of a suffix product exceeds
    # prod(1 + e_k), so an as-used amax_bwd under this bound can be truncation alone
    bound = math.prod(1 + e for e in layer_col)
    return {"sinkhorn_row_err": row_err, "sinkhorn_col_err": col_err, "layer_sinkhorn_row_err": layer_row,
            "layer_sinkhorn_col_err": layer_col, "sinkhorn_bwd_bound": bound, "amax_fwd_converged": exact["amax_fwd"],
            "amax_bwd_converged": exact["amax_bwd"], "amax_study_converged": exact["amax_study"],
            "sinkhorn_converged_iters": iters, "sinkhorn_converged_err": left}


LAYER_KEYS = ("layer_gain_fwd", "layer_gain_bwd", "layer_sinkhorn_row_err", "layer_sinkhorn_col_err")


@torch.no_grad()
def instability_probe(model: nn.Module, probe_idx: torch.Tensor, autocast_ctx, with_layers: bool) -> dict:
    """Run the fixed probe batch and measure the gains. No RNG, no autograd state; the mode is restored."""
    was_training = model.training
    model.eval()
    try:
        mixing: list = []
        with autocast_ctx():
            model(probe_idx, mixing_out=mixing)
    finally:
        model.train(was_training)
    if mixing[0] is None:
        metrics = unit_gain_metrics(len(mixing))
    else:
        n = mixing[0][0].shape[-1]
        H = torch.stack([h.float().reshape(-1, n, n) for h, _ in mixing])
        metrics = gain_metrics(H)
        if mixing[0][1] is not None:
            metrics |= projection_metrics(H, torch.stack([z.float().reshape(-1, n, n) for _, z in mixing]))
    if not with_layers:
        metrics = {key: value for key, value in metrics.items() if key not in LAYER_KEYS}
    return metrics


# ----------------------------------------------------------------------------------------------
# data: tokenizers, C4 (hub or local shards) and the bundled sample, streamed and exactly resumable

DATA_DIR = ROOT / "data"
# tiktoken's published sha256 of OpenAI's GPT-2 files (tiktoken_ext/openai_public.py)
GPT2_HASHES = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
               "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
C4_HUB = "hf://datasets/allenai/c4/en"
C4_TRAIN_SHARDS, C4_VALIDATION_SHARDS = 1024, 8
HUB_RETRIES, HUB_MAX_BACKOFF_S = 6, 60         # about two minutes of retries before exit 6
# training files without held-out files give up 1 document in this many for validation: about 3,500 of a
# C4 shard, more than the default eval set (640 sequences of 1,024 tokens) needs, so it reads one shard
HELD_OUT_EVERY = 100


class ByteTokenizer:
    """UTF-8 bytes; byte 0 (never in text) separates documents."""
    vocab_size, eot = 256, 0

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]


class GPT2Tokenizer:
    """GPT-2 BPE through tiktoken, built from the files in data/gpt2 (never downloaded)."""
    vocab_size = 50257

    def __init__(self):
        files = {name: str(DATA_DIR / "gpt2" / name) for name in GPT2_HASHES}
        ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=files["vocab.bpe"],
                                                encoder_json_file=files["encoder.json"],
                                                vocab_bpe_hash=GPT2_HASHES["vocab.bpe"],
                                                encoder_json_hash=GPT2_HASHES["encoder.json"])
        self.encoding = tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                          special_tokens={"<|endoftext|>": 50256})
        self.eot = self.encoding.eot_token

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts, num_threads=4)


def make_tokenizer(name: str):
    return ByteTokenizer() if name == "byte" else GPT2Tokenizer()


@dataclasses.dataclass(frozen=True)
class DataFiles:
    """What a run reads. held_out_slice: no held-out files were found, so `val` is the training files and
    validation reads only their held-out slice (in_held_out_slice), which training skips."""
    train: list[str]
    val: list[str]
    held_out_slice: bool


def resolve_data_files(data: str, val_data: str = "") -> DataFiles:
    """Held out: the files of --val-data, else those of --data with "validation" in their names (C4's
    convention; never trained on, with or without --val-data), else a slice of the training documents."""
    if data == "c4":
        train = [f"{C4_HUB}/c4-train.{i:05d}-of-{C4_TRAIN_SHARDS:05d}.json.gz" for i in range(C4_TRAIN_SHARDS)]
        val = [f"{C4_HUB}/c4-validation.{i:05d}-of-{C4_VALIDATION_SHARDS:05d}.json.gz"
               for i in range(C4_VALIDATION_SHARDS)]
    else:
        files = local_files("--data", data)
        val = [f for f in files if "validation" in os.path.basename(f)]
        train = [f for f in files if f not in val]
    if val_data:
        val = local_files("--val-data", val_data)
        train = [f for f in train if f not in val]
    if not train:
        raise ConfigError(f"--data {data!r} leaves no training file: every file it matches is held out "
                          "('validation' in its name, or in --val-data)")
    return DataFiles(train, val or train, held_out_slice=not val)


def local_files(flag: str, value: str) -> list[str]:
    pattern = str(DATA_DIR / "sample" / "*.json.gz") if value == "sample" else value
    if os.path.isdir(pattern):
        pattern = os.path.join(pattern, "*.json*")
    files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    if not files:
        raise ConfigError(f"{flag} {value!r} matches no file; give a C4-format .json/.json.gz path or glob")
    return files


def in_held_out_slice(text: str) -> bool:
    """Whether a document is in the held-out slice: 1 in HELD_OUT_EVERY, decided by a hash of its text alone,
    so the slice is the same for every run, rank, world size and resume, needs no state in a checkpoint, and
    repeated copies of a document all fall on the same side."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELD_OUT_EVERY == 0


def parse_c4_line(line: str) -> str | None:
    """The document text of one C4 JSON line, or None for a malformed line or an empty document."""
    try:
        text = json.loads(line)["text"]
    except (ValueError, KeyError, TypeError):
        return None
    return text if isinstance(text, str) and text.strip() else None


class DocumentStream:
    """This rank's documents, in an order fixed by the data seed, resumable exactly.

    Lines are read with `datasets`' streaming text builder (the same path for the hub and local
    shards) and parsed here, so that one malformed line is skipped instead of failing its shard.
    Shard order is shuffled per epoch; documents pass through our own shuffle buffer, whose contents
    and RNG state are part of the saved state (datasets' own shuffle buffer is not resumable)."""

    def __init__(self, files: list[str], rank: int, world: int, seed: int | None, buffer_size: int,
                 held_out: bool | None = None):
        """seed None keeps the file order (held-out data); buffer_size 0 keeps the document order; held_out
        True reads only the held-out slice's documents (in_held_out_slice), False all but those, None all."""
        self.files, self.rank, self.world, self.seed, self.buffer_size = files, rank, world, seed, buffer_size
        self.held_out = held_out
        self.remote = any(f.startswith("hf://") for f in files)
        self.epoch, self.position, self.buffer, self.skipped = 0, None, [], 0
        self.rng = torch.Generator().manual_seed((seed or 0) * 1_000_003 + rank)

    def _open_epoch(self):
        import datasets
        from datasets.distributed import split_dataset_by_node
        order = range(len(self.files)) if self.seed is None else torch.randperm(
            len(self.files), generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        stream = datasets.load_dataset("text", data_files=[self.files[i] for i in order], split="train",
                                       streaming=True, encoding_errors="replace")
        stream = split_dataset_by_node(stream, rank=self.rank, world_size=self.world)
        if self.position is not None:
            stream.load_state_dict(self.position)
        return stream

    def __iter__(self):
        failures, usable, whole_epoch = 0, 0, self.position is None
        while True:
            try:
                stream = self._open_epoch()
                # iter(), unlike a plain loop, does not split the shards again inside a DataLoader worker
                for row in stream.iter(batch_size=1):
                    self.position, failures = stream.state_dict(), 0
                    text = parse_c4_line(row["text"][0])
                    if text is None:
                        self.skipped += 1
                        continue
                    if self.held_out is not None and in_held_out_slice(text) != self.held_out:
                        continue
                    usable += 1
                    self.buffer.append(text)
                    if len(self.buffer) > self.buffer_size:
                        slot = int(torch.randint(len(self.buffer), (), generator=self.rng))
                        self.buffer[slot], self.buffer[-1] = self.buffer[-1], self.buffer[slot]
                        yield self.buffer.pop()
            except Exception as error:
                failures += 1
                self._wait_or_give_up(error, failures)
                continue                       # reopen at the saved position: nothing read twice
            if whole_epoch and not usable and not self.buffer:
                raise ConfigError(f"data stream {self.rank} of {self.world} holds no usable document "
                                  f"({self.skipped} malformed or empty lines); check the files of --data")
            self.epoch, self.position, usable, whole_epoch = self.epoch + 1, None, 0, True

    def _wait_or_give_up(self, error: Exception, failures: int) -> None:
        """Hub errors (429, 5xx, time-outs) are retried with exponential backoff and jitter, so that
        eight ranks hitting a rate limit together do not retry together; local files are not retried."""
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if not self.remote:
            raise ConfigError(f"a data shard is unreadable ({cause}); check the files of --data") from error
        if failures > HUB_RETRIES or "Offline" in type(error).__name__:
            raise DataUnavailable(f"C4 could not be streamed from the hub after {failures} attempt(s) ({cause}); "
                                  "download shards once with `bash setup.sh --prefetch-c4 N` and pass their "
                                  "glob to --data, or pass another local glob") from error
        delay = min(HUB_MAX_BACKOFF_S, 2 ** failures) * random.Random().uniform(0.5, 1.5)
        print(f"warning: hub read failed ({cause}); retry {failures}/{HUB_RETRIES} in {delay:.0f} s", file=sys.stderr)
        time.sleep(delay)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "buffer": list(self.buffer),
                "rng": self.rng.get_state(), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.buffer = state["epoch"], state["position"], list(state["buffer"])
        self.rng.set_state(state["rng"])
        self.skipped = state["skipped"]


class TokenWindows:
    """Packs one document stream, documents separated by the end-of-text token, into seq_len + 1 windows.

    Pending tokens live in a tensor that is replaced, never modified, so a state snapshot is just a
    reference and an offset: the prefetch thread takes one after every batch."""

    def __init__(self, documents: DocumentStream, tokenizer, seq_len: int, docs_per_encode: int = 64):
        self.documents, self.tokenizer = documents, tokenizer
        self.window, self.docs_per_encode = seq_len + 1, docs_per_encode
        self.tokens, self.offset = torch.zeros(0, dtype=torch.long), 0
        self._docs = iter(documents)

    def _refill(self) -> None:
        texts = [text for _, text in zip(range(self.docs_per_encode), self._docs)]
        if not texts:
            raise ConfigError("the data stream holds no usable document")
        ids = [token for doc in self.tokenizer.encode_batch(texts) for token in (*doc, self.tokenizer.eot)]
        self.tokens = torch.cat([self.tokens[self.offset:], torch.tensor(ids, dtype=torch.long)])
        self.offset = 0

    def take(self, count: int) -> torch.Tensor:
        need = count * self.window
        while len(self.tokens) - self.offset < need:
            self._refill()
        windows = self.tokens[self.offset:self.offset + need].view(count, self.window)
        self.offset += need
        return windows

    def state_dict(self) -> dict:
        return {"documents": self.documents.state_dict(), "tokens": self.tokens, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.documents.load_state_dict(state["documents"])
        self.tokens, self.offset = state["tokens"], state["offset"]
        self._docs = iter(self.documents)


class RankBatches:
    """This rank's share of every global batch, the same sequences whatever the number of processes.

    The corpus is split into --data-streams disjoint virtual streams. Sequence p of a global batch
    always comes from stream p mod streams, and rank r takes positions r, r + world, ... So any number
    of processes that divides the global batch trains on exactly the same sequences at every step, and a
    checkpoint saved with one world size resumes exactly with another. When the world size does not
    divide the streams, ranks share a stream: each reads all of its windows of a step (the same state
    everywhere) and keeps its own positions', skipping the others' (`skips`)."""

    def __init__(self, files: list[str], tokenizer, cfg: Config, rank: int, world: int, micro: int,
                 skip_held_out: bool = False):
        # what a loader process rebuilds it from
        self.recipe = (files, tokenizer, cfg, rank, world, micro, skip_held_out)
        count, held_out = cfg.data_streams, False if skip_held_out else None
        positions = range(rank, cfg.batch_size, world)
        self.owners = [p % count for p in positions]
        self.skips = stream_skips(positions, count, cfg.batch_size)
        # the streams it reads, and its share of those no position reads (a batch below --data-streams): their
        # untouched states go into the checkpoint too, for a resume at another world size
        read = sorted(set(self.owners) | set(range(rank, count, world)))
        self.streams = {v: TokenWindows(DocumentStream(files, v, count, cfg.data_seed, cfg.shuffle_buffer, held_out),
                                        tokenizer, cfg.seq_len) for v in read}
        self.micro, self.cursor = micro, 0

    def window(self, slot: int) -> torch.Tensor:
        """The window of this rank's `slot`-th position of a step, past the shared stream's other windows."""
        stream, (before, after) = self.streams[self.owners[slot]], self.skips[slot]
        if before:
            stream.take(before)
        window = stream.take(1)
        if after:
            stream.take(after)
        return window

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        windows = torch.cat([self.window(slot) for slot in range(self.cursor, self.cursor + self.micro)])
        self.cursor = (self.cursor + self.micro) % len(self.owners)
        return windows[:, :-1], windows[:, 1:]

    @property
    def skipped(self) -> int:
        return sum(stream.documents.skipped for stream in self.streams.values())

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "streams": {str(v): s.state_dict() for v, s in self.streams.items()}}

    def load_state_dict(self, states: list[dict]) -> None:
        """`states` are every rank's saved states: each stream is found wherever it was saved."""
        saved = {int(v): state for rank_state in states for v, state in rank_state["streams"].items()}
        missing = sorted(set(self.streams) - set(saved))
        if missing:
            raise ConfigError(f"the checkpoint holds no state for data stream(s) {missing}; was --data-streams "
                              "changed? resume with the original value")
        for v, stream in self.streams.items():
            stream.load_state_dict(saved[v])
        self.cursor = states[0]["cursor"]


def stream_skips(positions: range, streams: int, batch: int) -> list[tuple[int, int]]:
    """For each of a rank's positions of a step (in order): how many windows of its stream belong to other ranks'
    positions just before it, and, after the rank's last position of that stream, how many until the step's end.
    All zeros when the world size divides the streams (every stream is one rank's). Position p is window
    p // streams of stream p mod streams within the step."""
    skips, last = [], {}
    for slot, p in enumerate(positions):
        v, k = p % streams, p // streams
        skips.append([k - last.get(v, (-1, None))[0] - 1, 0])
        last[v] = (k, slot)
    for v, (k, slot) in last.items():
        skips[slot][1] = len(range(v, batch, streams)) - 1 - k
    return [tuple(skip) for skip in skips]


def stalled(timeout: float) -> DataUnavailable:
    return DataUnavailable(f"the data loader delivered nothing for {timeout:.0f} s (--data-timeout); "
                           "the data source stalled")


class Loader(Protocol):
    """What the training loop reads its batches from (make_loader: Prefetcher or LoaderProcesses), both reading a
    RankBatches ahead in the background. Reading starts at the first next_batch, so that a resume can load the saved
    position first; state_dict is the position right after the last batch consumed, never after one read ahead."""
    batches: RankBatches
    waited: float               # seconds next_batch spent waiting for data
    skipped: int                # malformed or empty lines skipped so far

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, states: list[dict]) -> None:
        """Every rank's saved states (RankBatches.load_state_dict), before the first next_batch."""

    def close(self) -> None: ...


class Prefetcher:
    """Builds the next batches in a background thread, so the accelerator does not wait on reading and
    tokenizing. Each batch travels with the loader state right after it: a checkpoint saves the state
    of the last batch consumed, not of the ones read ahead. A stall longer than `timeout` raises."""

    def __init__(self, batches: RankBatches, depth: int, timeout: float, pin_memory: bool = False):
        self.batches, self.timeout, self.pin_memory = batches, timeout, pin_memory
        self.state, self.waited = batches.state_dict(), 0.0
        self.queue, self.stopping = queue.Queue(maxsize=depth), threading.Event()
        self.thread = threading.Thread(target=self._produce, daemon=True, name="prefetch")

    def load_state_dict(self, states: list[dict]) -> None:
        self.batches.load_state_dict(states)
        self.state = self.batches.state_dict()

    def _produce(self) -> None:
        item = None
        while not self.stopping.is_set():
            if item is None:
                try:
                    batch = self.batches.next_batch()
                    if self.pin_memory:                # page-locked: the copy to the GPU runs asynchronously
                        batch = tuple(t.pin_memory() for t in batch)
                    item = (batch, self.batches.state_dict(), None)
                except BaseException as error:             # handed to the consumer, raised there
                    item = (None, None, error)
            try:
                self.queue.put(item, timeout=0.1)
            except queue.Full:
                continue
            if item[2] is not None:
                return
            item = None

    def close(self) -> None:
        """Stop the thread before the interpreter exits: a thread killed inside torch aborts the process."""
        self.stopping.set()
        if self.thread.ident is not None:
            self.thread.join(timeout=60)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.thread.ident is None:
            self.thread.start()
        started = time.perf_counter()
        try:
            batch, state, error = self.queue.get(timeout=self.timeout)
        except queue.Empty:
            raise stalled(self.timeout) from None
        finally:
            self.waited += time.perf_counter() - started
        if error is not None:
            raise error
        self.state = state
        return batch

    @property
    def skipped(self) -> int:
        return self.batches.skipped

    def state_dict(self) -> dict:
        return self.state


class _StepShares(torch.utils.data.IterableDataset):
    """What one loader process reads: the windows of its own streams (every workers-th of those the rank's
    batches read), one optimizer step after another. Its streams' states after each recent step stay in the process,
    and a thread sends one when the training process asks (at a checkpoint): a state holds the shuffle buffers,
    megabytes that would cost the training process more to receive every step than reading the data."""

    KEEP = 8            # recent steps whose states are kept: more than a worker can run ahead (prefetch 2)

    def __init__(self, batches: RankBatches, workers: int):
        self.recipe, self.state, self.workers = batches.recipe, batches.state_dict(), workers
        self.requests, self.replies = [multiprocessing.Queue() for _ in range(workers)], multiprocessing.Queue()

    def __iter__(self):
        worker = torch.utils.data.get_worker_info().id
        batches = RankBatches(*self.recipe)
        batches.load_state_dict([self.state])
        mine = sorted(set(batches.owners))[worker::self.workers]    # a batch below --data-streams reads fewer
        slots, states = [p for p, v in enumerate(batches.owners) if v in mine], {}
        threading.Thread(target=self._answer, args=(worker, states), daemon=True).start()
        try:
            for step in itertools.count():
                windows = torch.cat([batches.window(p) for p in slots])
                states[step] = {str(v): batches.streams[v].state_dict() for v in mine}
                states.pop(step - self.KEEP, None)
                yield slots, windows, None
        except TrainerError as error:          # raised in the training process as one line, not a worker traceback
            yield None, None, error

    def _answer(self, worker: int, states: dict) -> None:
        while True:
            self.replies.put(states[self.requests[worker].get()])

    def states_after(self, step: int, timeout: float) -> dict:
        """Every worker's stream states after `step` (counted from 0), merged."""
        for requests in self.requests:
            requests.put(step)
        streams = {}
        try:
            for _ in self.requests:
                streams |= self.replies.get(timeout=timeout)
        except queue.Empty:
            raise DataUnavailable(f"a data loader process did not send its state within {timeout:.0f} s") from None
        return streams


def _leave_group_signals_to_the_trainer(_worker_id: int) -> None:
    """A SIGTERM or Ctrl-C sent to the job's process group (the launcher, a terminal) must reach the training
    process alone: it finishes its step with data from the workers, checkpoints, then ends them. In a group
    of its own a worker would outlive a training process killed outright, so Linux is asked to end it then."""
    os.setpgrp()
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
        if os.getppid() == 1:                               # the training process died before the line above
            os._exit(1)


class LoaderProcesses:
    """--data-workers > 0: the rank's streams are read and tokenized in a torch DataLoader's worker processes,
    so the training process's interpreter lock is left to the training loop. DataLoader hands the workers'
    step shares back in worker order, which makes the batches exactly those of the in-process loader. The
    state is that after the last whole step consumed; checkpoints are only taken between steps."""

    def __init__(self, batches: RankBatches, workers: int, timeout: float, pin_memory: bool = False):
        self.batches, self.workers, self.timeout, self.pin_memory = batches, workers, timeout, pin_memory
        self.micro, self.per_step, self.steps, self.cursor, self.waited = batches.micro, len(batches.owners), 0, 0, 0.0
        self.state, self.inputs, self.targets, self.shares = (0, batches.state_dict()), None, None, None

    def load_state_dict(self, states: list[dict]) -> None:
        self.batches.load_state_dict(states)
        self.state = (0, self.batches.state_dict())

    def _start(self) -> None:
        self.unread = self.state[1]["streams"]          # streams no batch position reads keep this state
        self.shares = _StepShares(self.batches, self.workers)
        self.loader = iter(torch.utils.data.DataLoader(self.shares, batch_size=None, num_workers=self.workers,
                                                       prefetch_factor=2, timeout=self.timeout,
                                                       worker_init_fn=_leave_group_signals_to_the_trainer))

    def _next_step(self) -> None:
        if self.shares is None:
            self._start()
        started = time.perf_counter()
        try:
            shares = [next(self.loader) for _ in range(self.workers)]
        except RuntimeError as error:
            if "timed out" not in str(error):
                raise DataUnavailable(f"a data loader process failed ({str(error).splitlines()[0]})") from None
            raise stalled(self.timeout) from None
        finally:
            self.waited += time.perf_counter() - started
        for *_, error in shares:
            if error is not None:
                raise error
        windows = torch.empty(self.per_step, shares[0][1].shape[1], dtype=torch.long)
        for slots, part, _ in shares:
            windows[slots] = part
        self.inputs, self.targets = (t.contiguous() for t in (windows[:, :-1], windows[:, 1:]))
        if self.pin_memory:
            self.inputs, self.targets = self.inputs.pin_memory(), self.targets.pin_memory()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cursor == 0:
            self._next_step()
        start, self.cursor = self.cursor, (self.cursor + self.micro) % self.per_step
        self.steps += self.cursor == 0
        return self.inputs[start:start + self.micro], self.targets[start:start + self.micro]

    def state_dict(self) -> dict:
        if self.state[0] != self.steps:
            streams = self.unread | self.shares.states_after(self.steps - 1, self.timeout)
            self.state = (self.steps, {"cursor": 0, "streams": streams})
        return self.state[1]

    @property
    def skipped(self) -> int:
        return sum(stream["documents"]["skipped"] for stream in self.state_dict()["streams"].values())

    def close(self) -> None:
        self.loader = None                     # the DataLoader iterator shuts its workers down when released


def make_loader(batches: RankBatches, cfg: Config, pin_memory: bool) -> Loader:
    if cfg.data_workers:
        return LoaderProcesses(batches, cfg.data_workers, cfg.data_timeout, pin_memory)
    return Prefetcher(batches, cfg.prefetch, cfg.data_timeout, pin_memory)


def fixed_sequences(data: DataFiles, tokenizer, seq_len: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` windows of the held-out documents in file order: the same for every run and every eval.
    Read one document at a time, so that the stream's epoch says whether the held-out documents ran out."""
    documents = DocumentStream(data.val, rank=0, world=1, seed=None, buffer_size=0,
                               held_out=True if data.held_out_slice else None)
    sequences = TokenWindows(documents, tokenizer, seq_len, docs_per_encode=1).take(count)
    if documents.epoch and int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: the held-out set ({', '.join(map(os.path.basename, data.val))}"
              f"{', its held-out slice' if data.held_out_slice else ''}) is smaller than the {count} "
              f"sequences of {seq_len + 1} tokens evaluation takes (--eval-batches x --batch-size): its documents "
              "repeat, so val_loss and the probe rest on less data than asked", file=sys.stderr, flush=True)
    return sequences[:, :-1], sequences[:, 1:]


# ----------------------------------------------------------------------------------------------
# distributed: process group from torchrun's environment, one device per rank, DDP or FSDP2

@dataclasses.dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# a healthy step, eval or checkpoint of the 2.5B model takes well under a minute; ten minutes
# without progress means a rank is hung (a dead device, a stuck read), and the job should fail
# and be requeued rather than hold a node. TRAIN_C4_STEP_TIMEOUT_S overrides it (tests).
START_TIMEOUT_S, STEP_TIMEOUT_S = 30 * 60, 10 * 60


def setup_distributed() -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        # start-up waits for every rank to stream its first documents, verify and load a checkpoint and
        # compile: generous; shorten_timeout() tightens it once the first step has gone through
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                             timeout=timedelta(seconds=START_TIMEOUT_S))
    return Dist(rank, world, device)


def shorten_timeout(dist: Dist, data_timeout: float) -> None:
    """The short collective time-out for the steady state (what torchtitan does after its first step).
    It stays 2 minutes above --data-timeout: a rank starved of data then gives up first and says why,
    instead of its peers timing out without knowing the cause."""
    if dist.world > 1:
        seconds = float(os.environ.get("TRAIN_C4_STEP_TIMEOUT_S", max(STEP_TIMEOUT_S, data_timeout + 120)))
        _set_pg_timeout(timedelta(seconds=seconds))


def end_distributed() -> None:
    """Only when every rank ends together (completed, diverged, interrupted): after a failure the process
    just exits, since tearing down a group whose peer is gone can block."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def barrier(dist: Dist) -> None:
    if dist.world > 1:
        torch.distributed.barrier()


def all_ranks_sum(dist: Dist, values: torch.Tensor) -> torch.Tensor:
    if dist.world > 1:
        torch.distributed.all_reduce(values)
    return values


def all_ranks_gather(dist: Dist, obj) -> list:
    """Every rank's `obj` (small picklable values: file checksums, one-line problems), in rank order."""
    if dist.world == 1:
        return [obj]
    gathered = [None] * dist.world
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


def _failure_key(rank: int) -> str:
    return f"train_c4/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/failed/{rank}"


def rank_failure(dist: Dist, code: int, reason: str) -> tuple[int, str, bool]:
    """The job's exit code and one-line reason for a failure seen on this rank, and whether it is this rank's
    own (not another rank's, nor a lost contact that no rank explains).

    A rank's own failure is written to the rendezvous store before the rank exits; the others only see
    a closed connection (gloo), a time-out or torchrun's SIGTERM (NCCL), and a rank that lost contact
    (code 5) reports the failure another rank noted, naming that rank, with its exit code: the launcher
    then acts on the root cause (halve the micro-batch, retry the data...) instead of blaming a GPU."""
    if dist.world == 1 or not torch.distributed.is_initialized():
        return code, reason, True
    with contextlib.suppress(Exception):                   # best effort: the store's host may be gone too
        store = _get_default_store()
        if code == EXIT_DEVICE:
            for rank in range(dist.world):
                if rank != dist.rank and store.check([_failure_key(rank)]):
                    peer_code, peer_reason = json.loads(store.get(_failure_key(rank)))
                    return peer_code, f"rank {rank} failed: {peer_reason}", False
        store.set(_failure_key(dist.rank), json.dumps([code, reason]))
    if code == EXIT_DEVICE and "lost contact" in reason:
        return code, reason + ("; no other rank reported an error: one was killed (out of host memory?) or is "
                               "hung, see torchrun's summary and the ranks' logs"), False
    return code, reason, True


def _vectorise_scalars(model: nn.Module) -> None:
    """FSDP2 shards dim 0 and refuses 0-d parameters (HC's s_a, s_b; mHC's gates): hold them as
    1-element vectors, which broadcast exactly like the scalars in the coefficient code.
    `consolidate` gives them back the model's own shapes."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                setattr(module, name, nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))


def wrap_model(model: GPT, cfg: Config, dist: Dist, dtype: torch.dtype) -> nn.Module:
    """Activation checkpointing lives in the blocks; then compile per block; then DDP or FSDP2.
    Build the optimizer after this: FSDP2 replaces every parameter by its sharded DTensor."""
    if cfg.compile:
        for block in model.blocks:
            block.compile()
    if dist.world == 1:
        return model
    if cfg.parallel == "ddp":
        return DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    _vectorise_scalars(model)
    # The matmul weights are gathered in the compute dtype (bf16 on CUDA), gradients always reduced in fp32.
    # The connections are sharded on their own with fp32 parameters: the coefficients are computed from
    # unrounded weights, as under DDP (precision_policy). No input casting: it would hand every block its residual
    # streams in bf16, and the streams are kept and mixed in fp32 in every mode.
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    mixing_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                         cast_forward_inputs=False)
    for block in model.blocks:
        if cfg.residual != "baseline":
            for conn in (block.attn_conn, block.mlp_conn):
                fully_shard(conn, mp_policy=mixing_policy)
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def unwrap(model: nn.Module) -> GPT:
    return model.module if hasattr(model, "module") else model


# ----------------------------------------------------------------------------------------------
# checkpointing: temp folder + marker with checksums + rename; the newest complete one is used

MARKER = "COMPLETE.json"
SHARDED = "sharded"     # an FSDP checkpoint's model and optimizer: torch.distributed.checkpoint files
# what DCP's Metadata pickle is made of (torch 2.13); torch's dtypes are allowed by type
DCP_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                        *(("torch.distributed.checkpoint.metadata", name) for name in (
                            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                            "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"))}


class _DcpMetadataUnpickler(pickle.Unpickler):
    """DCP's FileSystemReader unpickles sharded/.metadata with plain pickle, where a crafted file runs code
    (checkpoints are copied between nodes): only the classes the metadata is made of are resolved."""

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                        torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


@functools.cache
def safe_dcp() -> tuple[type, type]:
    """(reader, planner) for dcp.load that never unpickle arbitrary objects: the metadata through the
    restricted unpickler, and the non-tensor entries (the optimizer's param_groups), which DCP's planner loads
    with weights_only=False, checked with weights_only=True first. Built on first use: importing
    torch.distributed.checkpoint takes about a second."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _DcpMetadataUnpickler(f).load()
            metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            plain = io.BytesIO()                          # what DCP unpickles is then our own plain data
            torch.save(torch.load(value, weights_only=True), plain)
            plain.seek(0)
            super().load_bytes(read_item, plain)

    return SafeReader, SafePlanner


def dcp_load(state: dict, folder: Path, no_dist: bool = False) -> None:
    """dcp.load of a checkpoint's SHARDED/ into `state`, in place, through safe_dcp's reader and planner."""
    import torch.distributed.checkpoint as dcp
    reader, planner = safe_dcp()
    try:
        with warnings.catch_warnings():      # "assuming the intent is to load in a single process": with no_dist it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, storage_reader=reader(folder / SHARDED), planner=planner(), no_dist=no_dist)
    except dcp.CheckpointException as error:
        raise ConfigError(f"checkpoint {folder} cannot be loaded safely ({_first_cause(error)})") from None


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Checkpoint folders `step-N`, oldest first (temp and set-aside folders are never listed)."""
    root = run_dir / "checkpoints"
    found = [d for d in root.glob("step-*") if d.name[5:].isascii() and d.name[5:].isdigit()] if root.is_dir() else []
    return sorted(found, key=lambda d: int(d.name[5:]))


def set_aside(folder: Path) -> Path:
    """Rename a checkpoint that failed verification or loading to `rejected-step-N` (never listed, never loaded,
    kept for inspection), so that the run writes that step again; an older rejected copy of it is replaced."""
    aside = folder.with_name(f"rejected-{folder.name}")
    if aside.is_symlink() or aside.is_file():
        aside.unlink()
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(folder, aside)
    return aside


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_file(obj, path: Path) -> None:
    """torch.save, then fsync. torch.save reports a failed write (full disk, quota, file size limit) as a
    RuntimeError without an errno ("unexpected pos 704 vs 598"): raised again as the OSError it is."""
    try:
        torch.save(obj, path)
    except RuntimeError as error:
        raise OSError(errno.EIO, f"writing {path.name} failed ({_first_cause(error)}): a full disk, a quota or a "
                      "file size limit") from error
    _fsync_path(path)


def write_atomically(path: Path, write) -> None:
    """write(temp file), then rename it over `path`: readers see the old file or the new one, never half of one,
    and a failed write (full disk, quota, read-only, permission) leaves no temp file behind."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_checkpoint(run_dir: Path, step: int, files: dict, dist: Dist, keep: int, sharded: dict | None = None) -> None:
    """Every rank passes the files it owns and, under FSDP, its shards of the model and optimizer
    (`sharded`, written with torch.distributed.checkpoint into SHARDED/). The folder appears under its
    final name only when complete, sealed by a marker holding the sha256 of every file, DCP's included."""
    root = run_dir / "checkpoints"
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    from torch.distributed.checkpoint import CheckpointException
    try:
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(dist)
        for name, obj in files.items():
            save_file(obj, tmp / name)
        written = list(files) + (_write_shards(sharded, tmp, dist) if sharded is not None else [])
        barrier(dist)
        # each rank hashes its own files and a share of DCP's: tens of GB at 2.5B parameters
        digests = all_ranks_gather(dist, {name: _sha256(tmp / name) for name in written})
        if dist.is_main:
            marker = {"step": step, "world_size": dist.world, "format": "sharded" if sharded else "full",
                      "files": dict(sorted(item for part in digests for item in part.items()))}
            _seal(tmp, final, marker)
            for old in checkpoint_dirs(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    except (OSError, CheckpointException) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = checkpoint_dirs(run_dir)
        intact = (f"the previous checkpoint {kept[-1].name} and metrics.jsonl are intact" if kept else
                  "metrics.jsonl is intact (no earlier checkpoint exists)")
        raise TrainerError(f"could not write checkpoint step-{step} ({_first_cause(error)}); {intact}; free disk "
                           "space (or fix the permission) and rerun to resume") from error
    barrier(dist)


def _write_shards(sharded: dict, tmp: Path, dist: Dist) -> list[str]:
    """Collective: DCP writes every rank's shards (and fsyncs them); returns this rank's share of DCP's
    files to hash. DCP's metadata names every file of every rank, so the marker does not depend on a
    directory listing (stale on network file systems)."""
    import torch.distributed.checkpoint as dcp
    metadata = dcp.save(sharded, checkpoint_id=tmp / SHARDED)
    shards = sorted({info.relative_path for info in metadata.storage_data.values()})
    return [f"{SHARDED}/{name}" for name in [".metadata", *shards][dist.rank::dist.world]]


def _seal(tmp: Path, final: Path, marker: dict) -> None:
    """The marker, then the rename: a checkpoint folder under its final name is always complete. One already
    there under that name was not resumed from, so it failed to verify or load: it is set aside, not kept."""
    (tmp / MARKER).write_text(json.dumps(marker))
    _fsync_path(tmp / MARKER)
    if final.exists() or final.is_symlink():
        set_aside(final)
    os.replace(tmp, final)
    _fsync_path(final.parent)


def _checkpoint_problem(folder: Path, marker: dict | None, dist: Dist) -> str | None:
    """What is wrong with this rank's share of the files (the ranks share the hashing), or None."""
    if folder.is_symlink():
        return "is a symbolic link, not a folder this run wrote"
    if marker is None:
        return "has no valid completion marker"
    if folder.name.startswith("step-") and folder.name != f"step-{marker.get('step')}":
        return f"holds step {marker.get('step')!r} under the name {folder.name}"
    for name, digest in list(marker["files"].items())[dist.rank::dist.world]:
        if not (folder / name).is_file():
            return f"is missing {name}"
        if _sha256(folder / name) != digest:
            return f"has a corrupted {name} (checksum mismatch)"
    return None


def _load_verified(folder: Path, marker: dict) -> dict:
    """The top-level .pt files of a verified checkpoint, loaded with weights_only=True; a sharded one's DCP
    metadata is read through the restricted unpickler too, so a crafted file is refused before DCP sees it."""
    if marker.get("format") == "sharded":
        safe_dcp()[0](folder / SHARDED).read_metadata()
    return {name: torch.load(folder / name, map_location="cpu", weights_only=True)
            for name in marker["files"] if "/" not in name}


def _first_cause(error: BaseException) -> str:
    """One line for an error; DCP's CheckpointException holds each rank's error with its traceback."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))[0]
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _read_marker(folder: Path) -> dict | None:
    """The marker, when it names plain files inside the folder with their sha256 digests."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        files = marker.get("files")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    plain = isinstance(files, dict) and all(isinstance(d, str) and not name.startswith("/") and ".." not in name
                                            for name, d in files.items())
    return marker if plain else None


def _contents_problem(files: dict, marker: dict) -> str | None:
    """What a verified checkpoint lacks for a resume: its step and tokens, every rank's data state, and (unless
    DCP holds them) the model and optimizer; None when complete."""
    state = files.get("train_state.pt")
    if not (isinstance(state, dict) and type(state.get("step")) is int and type(state.get("tokens")) is int
            and state["step"] == marker["step"] and state["tokens"] >= 0):
        return "holds no valid train_state.pt (its step and tokens)"
    ranks = sorted(name for name in files if name.startswith("rank"))
    if marker.get("world_size") != len(ranks) or set(ranks) != {f"rank{r}.pt" for r in range(len(ranks))}:
        return f"holds the data states of {len(ranks)} rank(s), its marker says {marker.get('world_size')!r}"
    needed = ["model.pt", "optimizer.pt"] if marker.get("format") != "sharded" else []
    missing = [name for name in ranks + needed if not isinstance(files.get(name), dict)]
    if not missing and needed and not all(isinstance(t, torch.Tensor) for t in files["model.pt"].values()):
        missing = ["model.pt's tensors"]
    return f"is missing {missing[0]}" if missing else None


def agreed_problem(dist: Dist, problem: str | None) -> str | None:
    """Every rank takes the same decision: the first rank's problem, or None when none has one."""
    return next((p for p in all_ranks_gather(dist, problem) if p), None)


def verified_checkpoints(folders: list[Path], dist: Dist, log):
    """In the order given, (folder, its top-level .pt files loaded safely (weights_only), its marker) of each
    checkpoint that verifies; each one that does not is logged. DCP's files (format "sharded") are verified
    here and loaded by the caller, which falls back to the next one when its load fails."""
    for folder in folders:
        marker = _read_marker(folder)
        problem = agreed_problem(dist, _checkpoint_problem(folder, marker, dist))
        files = {}
        if problem is None:
            try:
                files = _load_verified(folder, marker)
                problem = _contents_problem(files, marker)
            except Exception as error:                     # a crafted or damaged pickle lands here
                problem = f"cannot be loaded safely ({_first_cause(error)})"
            problem = agreed_problem(dist, problem)
        if problem is None:
            yield folder, files, marker
        else:
            log(f"checkpoint {folder.name} {problem}; falling back to the previous one")


def newest_first(run_dir: Path, dist: Dist) -> list[Path]:
    """The run's checkpoint folders as rank 0 lists them, newest first: every rank takes the same decisions."""
    return [run_dir / "checkpoints" / name for name in all_ranks_gather(dist, [
        d.name for d in checkpoint_dirs(run_dir)[::-1]])[0]]


def read_checkpoint(run_dir: Path, dist: Dist, log) -> tuple[Path, dict, dict] | None:
    """The newest checkpoint that verifies (verified_checkpoints), or None."""
    return next(verified_checkpoints(newest_first(run_dir, dist), dist, log), None)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def consolidate(source: Path, out: Path) -> str:
    """Write the model's weights from a checkpoint (FSDP's sharded ones included), loadable without a process
    group: OUT, a GPT state_dict for torch.load(OUT, weights_only=True), and beside it OUT's stem .safetensors
    (no pickle at all; the head, tied to the embedding, left out) with OUT's stem .json, the model's config.
    `source` is a checkpoint folder or a run folder (its newest complete checkpoint). Returns what was written."""
    folder, marker = _complete_checkpoint(source.resolve())
    cfg = _saved_config(folder.parent.parent)
    state = _saved_model_state(folder, sharded=marker.get("format") == "sharded")
    with torch.device("meta"):
        reference = GPT(cfg).state_dict()
    state.setdefault("lm_head.weight", state.get("wte.weight"))          # tied to the embedding
    if set(state) != set(reference) or any(state[k].numel() != v.numel() for k, v in reference.items()):
        raise ConfigError(f"checkpoint {folder} does not match the model of {folder.parent.parent / 'config.json'}")
    # the model's own shapes again (FSDP held its scalars as 1-element vectors); the head is the embedding
    state = {key: state[key].reshape(like.shape) for key, like in reference.items()}
    state["lm_head.weight"] = state["wte.weight"]
    _write_weights(out, state, cfg, folder)
    count = sum(t.numel() for k, t in state.items() if k != "lm_head.weight")
    return (f"{out} and {out.with_suffix('.safetensors').name}: {count:,} parameters of {cfg.residual} depth "
            f"{cfg.depth} from {folder}")


def _saved_config(run_dir: Path) -> Config:
    """The run's Config from its config.json, checked as a command line would be (a bad value is one line)."""
    path = run_dir / "config.json"
    try:
        saved = json.loads(path.read_text())["config"]
        fields = {f.name for f in dataclasses.fields(Config)}
        cfg = Config(**{k: v for k, v in saved.items() if k in fields - {"micro_batch_size"}})  # saved: the one used
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError):
        raise ConfigError(f"{path} is missing or unreadable: the model cannot be rebuilt") from None
    try:
        for field in dataclasses.fields(Config):
            value = getattr(cfg, field.name)
            if not (type(value) is type(field.default) or type(field.default) is float and type(value) is int):
                raise ConfigError(f"{field.name} is {value!r}, not of the type {type(field.default).__name__}")
            if value not in CHOICES.get(field.name, (value,)):
                raise ConfigError(f"{field.name} is {value!r}, not one of {', '.join(CHOICES[field.name])}")
        validate(cfg)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}; the model cannot be rebuilt") from None
    return cfg


def _write_weights(out: Path, state: dict, cfg: Config, folder: Path) -> None:
    from safetensors.torch import save_file as save_safetensors
    untied = {key: tensor.contiguous() for key, tensor in state.items() if key != "lm_head.weight"}
    model_config = {key: getattr(cfg, key) for key in MODEL_KEYS}
    try:
        write_atomically(out, functools.partial(save_file, state))
        write_atomically(out.with_suffix(".safetensors"), lambda tmp: save_safetensors(untied, tmp))
        write_atomically(out.with_suffix(".json"), lambda tmp: tmp.write_text(json.dumps(model_config, indent=1)))
    except OSError as error:
        raise TrainerError(f"could not write {out} ({_first_cause(error)}); {folder} is untouched") from error


def _complete_checkpoint(source: Path) -> tuple[Path, dict]:
    """`source` itself when it is a complete checkpoint, else the newest complete one of the run folder."""
    folders, skipped = [source] if (source / MARKER).exists() else checkpoint_dirs(source)[::-1], []
    for folder, _, marker in verified_checkpoints(folders, Dist(0, 1, torch.device("cpu")), skipped.append):
        print(*(f"warning: {line}" for line in skipped), sep="\n", file=sys.stderr, end="\n" if skipped else "")
        return folder, marker
    newest = f" (newest: {skipped[0].removeprefix('checkpoint ').split(';')[0]})" if skipped else ""
    raise ConfigError(f"{source} holds no complete, safely loadable checkpoint{newest}; pass a run folder or one of "
                      "its checkpoints/step-N folders")


def _saved_model_state(folder: Path, sharded: bool) -> dict:
    """The model entries of a checkpoint (not the optimizer's), in the shapes they were saved with."""
    if not sharded:
        return torch.load(folder / "model.pt", map_location="cpu", weights_only=True)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    entries = safe_dcp()[0](folder / SHARDED).read_metadata().state_dict_metadata
    state = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in entries.items() if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    wrapped = {"model": state}
    dcp_load(wrapped, folder, no_dist=True)
    return wrapped["model"]


# ----------------------------------------------------------------------------------------------
# logging: train.log, metrics.jsonl (append + flush), status.json (atomic), progress, W&B

STATUS_RESERVE_BYTES = 1 << 20     # far more than any status.json; random bytes, which no file system compresses


def write_json_atomic(path: Path, obj: dict) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1)))


def lock_run_folder(run_dir: Path):
    """An exclusive flock on RUN/.lock, held while the process lives (the kernel drops it when the process dies,
    so a dead holder never blocks): two trainers on one folder would interleave metrics and checkpoints."""
    handle = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip()[:200] or "another process"
        handle.close()
        raise ConfigError(f"{run_dir} is in use by {holder}; wait for it to end (or stop it), or choose another "
                          "--run-name or --out") from None
    handle.truncate(0)
    handle.write(f"process {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle


def _same_file(stream, path: Path) -> bool:
    try:
        return path.exists() and os.path.samestat(os.fstat(stream.fileno()), os.stat(path))
    except (OSError, ValueError):
        return False


class RunLog:
    """The run folder's human and machine logs; only rank 0 writes."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir, self.enabled = run_dir, enabled
        self.bar = None
        self.live = {}      # what status.json shows of a running run besides its state (README, "A run's folder")
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.lock = lock_run_folder(run_dir)
            # freed when status.json finds the disk full, so that the final state is still recorded
            self.reserve = run_dir / ".status-reserve"
            with contextlib.suppress(OSError):
                self.reserve.write_bytes(os.urandom(STATUS_RESERVE_BYTES))
            # the launcher already appends our stdout to train.log; writing it twice would double every line
            tee = not _same_file(sys.stdout, run_dir / "train.log")
            self.log_file = open(run_dir / "train.log", "a", buffering=1) if tee else None
            self.metrics_file = None

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}"
        (self.bar.write if self.bar else print)(line)
        sys.stdout.flush()
        if self.log_file:
            self.log_file.write(line + "\n")

    def open_metrics(self, keep_through_step: int) -> None:
        """Drop lines after the checkpoint being resumed (they are recomputed identically), then append."""
        if not self.enabled:
            return
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            records = _metrics_records(path)
            kept = [line for line, step in records if step is not None and step <= keep_through_step]
            unusable = sum(step is None for _, step in records)
            if unusable:
                self.info(f"warning: {path}: {unusable} line(s) that are not metrics records (no whole-number step) "
                          "dropped")
            write_atomically(path, lambda tmp: tmp.write_text("".join(line + "\n" for line in kept)))
        self.metrics_file = open(path, "a")

    def metrics(self, record: dict) -> None:
        if self.enabled:
            try:
                self.metrics_file.write(json.dumps(record) + "\n")
                self.metrics_file.flush()
            except OSError as error:
                raise TrainerError(f"could not append step {record['step']} to {self.run_dir / 'metrics.jsonl'} "
                                   f"({_first_cause(error)}); the lines before it and the checkpoints are intact, "
                                   "free disk space and rerun to resume") from error

    def status(self, state: str, step: int, exit_code: int | None = None, reason: str = "") -> None:
        """status.json, rewritten atomically on every change of state and at every log step."""
        if not self.enabled:
            return
        record = {"state": state, "step": step, "exit_code": exit_code, "reason": reason, "updated": time.time(),
                  **self.live}
        try:
            write_json_atomic(self.run_dir / "status.json", record)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.reserve.exists():
                raise
            self.reserve.unlink()
            write_json_atomic(self.run_dir / "status.json", record)

    def refuse(self, reason: str) -> ConfigError:
        """A resume that cannot go on, recorded as failed (exit 2) at the step status.json had, and returned."""
        step = self.previous_status().get("step")
        with contextlib.suppress(OSError):
            self.status("failed", step if type(step) is int else 0, EXIT_BAD_CONFIG, reason)
        return ConfigError(reason)

    def previous_status(self) -> dict:
        try:
            previous = json.loads((self.run_dir / "status.json").read_text())
        except (OSError, ValueError, RecursionError):
            return {}
        return previous if isinstance(previous, dict) else {}

    def count_restart(self) -> None:
        """restarts: how often this run folder was started again after its first start."""
        restarts = self.previous_status().get("restarts", -1)
        self.live["restarts"] = restarts + 1 if type(restarts) is int and restarts >= -1 else 0


def _metrics_records(path: Path) -> list[tuple[str, int | None]]:
    """(line, its step) of every line; the step is None where the line is no record: cut by a kill mid-write,
    not a JSON object, too deeply nested to parse, or without a whole-number step."""
    records = []
    for line in filter(str.strip, path.read_text(errors="replace").splitlines()):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError, RecursionError):
            step = None
        records.append((line, step if type(step) is int else None))
    return records


def _wandb_credentials() -> bool:
    netrc = Path.home() / ".netrc"
    return bool(os.environ.get("WANDB_API_KEY")) or (netrc.exists() and "api.wandb.ai" in netrc.read_text())


def wandb_mode(cfg: Config) -> str:
    """--wandb beats $WANDB_MODE; auto is $WANDB_MODE when set, else online with credentials, offline without."""
    if cfg.wandb != "auto":
        return cfg.wandb
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env in CHOICES["wandb"][1:]:
        return env
    return "offline" if env == "dryrun" or not _wandb_credentials() else "online"


def wandb_run_id(run_dir: Path) -> str:
    """Made once at random and kept in the run folder: every resume of the folder continues its W&B run, and a new
    folder is a new run even at the same path on another node (a hash of the path would collide)."""
    path = run_dir / "wandb_id.txt"
    if path.exists():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id


def start_wandb(cfg: Config, run_dir: Path, config_record: dict, log: RunLog):
    """W&B on rank 0 only. Group: the matrix (the runs folder, or $WANDB_RUN_GROUP), job type: the method, name: the
    run folder. An online init that fails falls back to offline with one warning; training never stops for W&B."""
    mode = wandb_mode(cfg)
    if mode == "disabled" or not log.enabled:
        return None
    import wandb            # about a second to import: only when W&B is on
    init = functools.partial(
        wandb.init, project=cfg.wandb_project or os.environ.get("WANDB_PROJECT") or "hc-mhc-c4",
        id=wandb_run_id(run_dir), name=run_dir.name, resume="allow", job_type=cfg.residual, config=config_record,
        group=os.environ.get("WANDB_RUN_GROUP") or Path(cfg.out).resolve().name,
        dir=os.environ.get("WANDB_DIR") or str(run_dir), settings=wandb.Settings(init_timeout=120))
    for attempt in dict.fromkeys((mode, "offline")):
        try:
            run = init(mode=attempt)
        except Exception as error:
            log.info(f"warning: W&B {attempt} init failed ({type(error).__name__}: {str(error).splitlines()[0][:200]}"
                     f"); {'logging offline instead' if attempt == 'online' else 'continuing without W&B'}")
            continue
        if attempt == "offline":
            sync = f"wandb sync {Path(run.dir).parent.resolve()}"
            log.info(f"W&B is offline; upload this run later with: {sync}")
            (run_dir / "wandb_sync.txt").write_text(sync + "\n")
        return run
    return None


def wandb_record(record: dict) -> dict:
    """A metrics line as W&B can plot it: each per-sublayer list becomes one scalar per sublayer under its key."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, list):
            flat |= {f"{key}/{index:03d}": v for index, v in enumerate(value)}
        elif key not in ("step", "time"):
            flat[key] = value
    return flat


# ----------------------------------------------------------------------------------------------
# training loop: AdamW, warm-up + cosine, accumulation, pre-clip gradient norm, eval, probe, checkpoints

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
ASSUMED_GPU = "NVIDIA H100 80GB HBM3"          # what time estimates assume where no GPU can be asked
# keys whose change makes a different model: resuming over them would mix two experiments
MODEL_KEYS = ("residual", "depth", "width", "heads", "expansion", "seq_len", "tokenizer", "sinkhorn_iters",
              "hc_scale_init", "mhc_gate_init", "mhc_res_diag", "mhc_pre_bias", "norm_eps")
# keys whose change makes the rest of a run a different experiment (schedule, batches, data): resuming over
# them needs --allow-changed-settings. The micro-batch, world size and loader count are not among them: the
# batches and the maths stay the same.
TRAINING_KEYS = ("lr", "steps", "batch_size", "warmup", "min_lr_ratio", "weight_decay", "grad_clip",
                 "no_mixing_decay", "seed", "data", "val_data", "data_seed", "data_streams", "shuffle_buffer")


def flops_per_token(cfg: Config, non_embedding_params: int) -> float:
    # 6N for the weight matmuls (forward + backward) + 12 * depth * width * seq_len for attention (PaLM)
    return 6 * non_embedding_params + 12 * cfg.depth * cfg.width * cfg.seq_len


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def gpu_peak_flops(name: str) -> float | None:
    """The dense bf16 peak of the device named `name` (device_name), None where it is not known."""
    return GPU_PEAK_BF16_FLOPS.get(name)


# ---- planner: the memory one GPU needs (--estimate, --micro-batch-size auto) and one run's time

GiB = 2 ** 30
DEFAULT_GPU_MEMORY_GIB = 80.0   # the card planned for when no CUDA device is visible (an H100 80GB shows 79.2)
# Framework overhead per process, assumed (it cannot be measured without a GPU): the CUDA context with the
# cuBLAS workspaces and the kernels of the first step (0.5-1 GiB on an H100), NCCL's buffers when there are
# peers, and the caching allocator's fragmentation (reserved minus allocated) as a share of the allocated
# peak: a few per cent when every step repeats the same shapes
CUDA_CONTEXT_BYTES, NCCL_BYTES, FRAGMENTATION = 1.0 * GiB, 1.0 * GiB, 0.05
AUTO_MARGIN = 0.05      # auto fills at most 95% of the card by the plan: a model of the memory, not a measurement
CPU_AUTO_MICRO = 8      # auto on the CPU, where there is no device memory to plan against
ASSUMED_MFU = 0.40      # time estimates without calibration: this share of the GPU's dense bf16 peak
# grad_fn nodes that only view or cast: followed from a saved tensor, they lead to the parameter that
# autocast copied to bf16 (memory per model, not per token)
_VIEW_OR_CAST = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
                 "UnsqueezeBackward0", "ExpandBackward0", "UnsafeViewBackward0"}


class _CudaAutocastOnCpu(torch.overrides.TorchFunctionMode):
    """CPU autocast with CUDA's casting policy where the two differ for this model: on CUDA, layer_norm and
    sum run in fp32 (a bf16 input is cast, and layer_norm saves the fp32 copy); the CPU keeps bf16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (torch.is_autocast_enabled("cpu") and args and isinstance(args[0], torch.Tensor)
                and args[0].dtype == torch.bfloat16):
            if func is F.layer_norm:
                args = (args[0].float(), *args[1:])
            elif func in (torch.sum, torch.Tensor.sum) and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)


class _SavedTensorCounter:
    """Saved-tensor and module hooks that add up, by the module being run, the bytes autograd keeps."""

    def __init__(self, model: GPT):
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


def saved_bytes(model: GPT, idx: torch.Tensor, bf16: bool) -> dict:
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
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), \
                _CudaAutocastOnCpu() if bf16 else contextlib.nullcontext(), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(idx, idx)
    finally:
        for handle in handles:
            handle.remove()
    return {**counter.counts, "weight_casts": counter.casts}


def _saved_per_token(cfg: Config, width: int, depth: int, bf16: bool, micro: int = 2, seq_len: int = 16) -> dict:
    small = dataclasses.replace(cfg, width=width, depth=depth, seq_len=seq_len, compile=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(small)
        idx = torch.randint(0, model.wte.num_embeddings, (micro, seq_len))
        saved = saved_bytes(model, idx, bf16)
    casts = saved.pop("weight_casts")
    return {"weight_casts": casts, **{k: v / (micro * seq_len) for k, v in saved.items()}}


@functools.cache
def activation_profile(residual: str, expansion: int, heads: int, tokenizer: str, sinkhorn_iters: int,
                       bf16: bool, checkpointing: bool) -> dict:
    """Activation bytes per token as (a, b) with bytes = a * width + b, measured on the real GPT on the CPU at
    widths 2 and 4 x heads (the real head count: per-head terms like attention's logsumexp are exact) and depths
    2 and 3, with the real vocabulary. Keys: 'block' (the depth difference), its parts 'attention', 'mlp' and
    'streams' (the n-stream states, mixing coefficients and the sublayer outputs written into the streams),
    'sublayer' (the larger sublayer: what checkpointing recomputes at once), 'loss' (log-probabilities),
    'rest' (embedding, expansion, collapse, head); 'weight_casts': the parameters autocast copies to bf16."""
    cfg = Config(residual=residual, expansion=expansion, heads=heads, tokenizer=tokenizer,
                 sinkhorn_iters=sinkhorn_iters, activation_checkpointing=checkpointing)
    widths, rows = (2 * heads, 4 * heads), []
    for width in widths:
        d2, d3 = (_saved_per_token(cfg, width, depth, bf16) for depth in (2, 3))
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


@functools.cache
def parameter_numels(cfg: Config) -> dict:
    """numel per parameter name (block parameters summed over the blocks as '*.attn.inner.qkv.weight'...),
    with 'total', 'tensors' and 'block' (one block's), from the model built on the meta device."""
    with torch.device("meta"):
        model = GPT(cfg)
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


def memory_plan(cfg: Config, micro: int, world: int = 1, card: float | None = None) -> MemoryPlan:
    """The memory one GPU needs to train `cfg` at this micro-batch (dtype auto plans bf16, as on CUDA).
    Parameter terms are exact; activations are activation_profile scaled to the real width, depth and tokens."""
    bf16 = cfg.dtype != "fp32"
    fit, full = (activation_profile(cfg.residual, cfg.expansion, cfg.heads, cfg.tokenizer, cfg.sinkhorn_iters, bf16,
                                    checkpointing) for checkpointing in (cfg.activation_checkpointing, False))
    terms, notes = {}, {}

    def term(name: str, value: float, note: str) -> None:
        terms[name], notes[name] = value, note

    _parameter_terms(cfg, world, full["weight_casts"], term)
    _activation_terms(cfg, micro, fit, full, term)
    allocated = sum(terms.values())
    term("overhead: CUDA context", CUDA_CONTEXT_BYTES + (NCCL_BYTES if world > 1 else 0),
         "assumed: context, cuBLAS workspaces, kernels" + (", NCCL buffers" if world > 1 else ""))
    term("overhead: fragmentation", FRAGMENTATION * allocated, f"assumed: {FRAGMENTATION:.0%} of the allocated peak")
    return MemoryPlan(micro, world, gpu_memory_bytes(cfg) if card is None else card, terms, notes)


def _parameter_terms(cfg: Config, world: int, weight_casts: set, term) -> None:
    """Weights, gradients, AdamW, and the copies DDP, FSDP or autocast add: exact from the parameter counts."""
    numels = parameter_numels(cfg)
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


def _activation_terms(cfg: Config, micro: int, fit: dict, full: dict, term) -> None:
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
         f"fp32 log_softmax over the {padded_vocab_size(cfg.tokenizer):,}-token vocabulary")
    # the backward's own peak on top of what is saved: the loss backward holds two more fp32 buffers of the
    # logits' size (the gradients into and out of log_softmax); with checkpointing, one sublayer is recomputed
    recompute = tokens * (full["sublayer"][0] * C + full["sublayer"][1]) if cfg.activation_checkpointing else 0.0
    term("act: backward peak", max(2 * loss, recompute),
         "one sublayer recomputed" if recompute > 2 * loss else "loss backward: 2 fp32 buffers of the logits' size")


def check_batch_split(cfg: Config, world: int, micro: int | None = None) -> None:
    """--batch-size splits evenly over the processes and, given a micro-batch, into whole micro-batches on each."""
    if cfg.batch_size % (world * (micro or 1)):
        into = f"{world} process(es)" if micro is None else f"--micro-batch-size {micro} x {world} process(es)"
        raise ConfigError(f"--batch-size {cfg.batch_size} is not divisible by {into}")


def divisors_descending(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def auto_micro_batch(cfg: Config, world: int, card: float | None = None) -> tuple[int, MemoryPlan]:
    """The largest micro-batch dividing the per-process batch whose plan fills at most 1 - AUTO_MARGIN of the card."""
    for micro in divisors_descending(cfg.batch_size // world):
        plan = memory_plan(cfg, micro, world, card)
        if plan.total <= (1 - AUTO_MARGIN) * plan.card:
            return micro, plan
    raise ConfigError(f"micro-batch 1 already needs {plan.total / GiB:.1f} GiB of this {plan.card / GiB:.1f} GiB GPU "
                      "(see --estimate): use --activation-checkpointing, or --parallel fsdp over more GPUs")


def cpu_auto_micro_batch(cfg: Config, world: int) -> int:
    return next(d for d in divisors_descending(cfg.batch_size // world) if d <= CPU_AUTO_MICRO)


def confirm_micro_batch(cfg: Config, dist: Dist, model: nn.Module, dtype: torch.dtype, micro: int,
                        accum: int) -> tuple[int, int]:
    """--micro-batch-size auto on CUDA: one real forward and backward at the planned micro-batch, with the memory
    of AdamW's states (allocated at its first step) set aside; on out-of-memory, the next divisor at most half
    as large. Not under FSDP, whose collectives would hang the ranks that did not fail: the plan stands there."""
    if cfg.micro_batch_size != "auto" or dist.device.type != "cuda" or (dist.world > 1 and cfg.parallel == "fsdp"):
        return micro, accum
    local, per_rank = unwrap(model), cfg.batch_size // dist.world     # DDP's module: no all-reduce in the trial
    while True:
        try:
            # held, not used: the room AdamW's exp_avg and exp_avg_sq take at the first optimizer step
            states = torch.empty(8 * sum(p.numel() for p in local.parameters()), dtype=torch.uint8, device=dist.device)
            idx = torch.zeros(micro, cfg.seq_len, dtype=torch.long, device=dist.device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                _, loss = local(idx, idx)
            loss.backward()
            break
        except torch.OutOfMemoryError:
            if micro == 1:
                raise
            micro = next(d for d in divisors_descending(per_rank) if d <= micro // 2)
        finally:
            states = idx = loss = None      # released before the next, smaller trial allocates its own
            local.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    if dist.world > 1:                       # every rank must use the same micro-batch
        agreed = torch.tensor(micro, device=dist.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        micro = int(agreed)
    torch.cuda.reset_peak_memory_stats(dist.device)
    if dist.is_main:
        print(f"micro-batch auto: {micro}, confirmed by one forward and backward on {torch.cuda.get_device_name()}",
              flush=True)
    return micro, per_rank // micro


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


def print_estimate(cfg: Config) -> None:
    """Model size, work per token and the memory plan of one GPU: the model is built on the meta device and the
    activations are measured on tiny copies on the CPU, so nothing of the real size is allocated."""
    params = count_parameters(cfg)
    print(f"{cfg.residual} depth {cfg.depth} width {cfg.width}: {parameter_summary(params)}")
    flops = flops_per_token(cfg, params["non_embedding"])
    print(f"{flops:.4g} training FLOPs per token; "
          f"{cfg.tokens_per_step:,} tokens per step; {cfg.steps * cfg.tokens_per_step:,} tokens in "
          f"{cfg.steps:,} steps")
    world = cfg.estimate_world_size or int(os.environ.get("WORLD_SIZE", "1"))
    micro, auto_line = _estimate_micro_batch(cfg, world)
    strategy = f"{world} processes, {cfg.parallel.upper()}" if world > 1 else "1 process"
    print(f"memory of one GPU at micro-batch {micro} ({cfg.batch_size // (micro * world)} accumulation steps), "
          f"{'fp32' if cfg.dtype == 'fp32' else 'bf16 autocast'}, {strategy}, activation checkpointing "
          f"{'on' if cfg.activation_checkpointing else 'off'}:")
    print_memory_plan(memory_plan(cfg, micro, world))
    if cfg.residual != "baseline":
        fit = activation_profile(cfg.residual, cfg.expansion, cfg.heads, cfg.tokenizer, cfg.sinkhorn_iters,
                                 cfg.dtype != "fp32", False)["streams"]
        streams = micro * cfg.seq_len * cfg.depth * (fit[0] * cfg.width + fit[1])
        print(f"the {cfg.expansion} streams add {params['streams']:,} parameters and, without checkpointing, "
              f"{streams / GiB:.1f} GiB of activations (stream states, mixing coefficients, written sublayer outputs)")
    print(auto_line)
    _print_time_estimate(cfg, world, flops)


def _estimate_micro_batch(cfg: Config, world: int) -> tuple[int, str]:
    """The micro-batch the plan is printed for (the given one, else auto's) and what auto would choose."""
    check_batch_split(cfg, world)
    try:
        auto, _ = auto_micro_batch(cfg, world)
        auto_line = (f"--micro-batch-size auto: {auto} (the largest whose plan fills at most {1 - AUTO_MARGIN:.0%} "
                     "of the card)")
    except ConfigError as error:
        auto, auto_line = None, f"--micro-batch-size auto: none fits; {error}"
    micro = int(cfg.micro_batch_size) if cfg.micro_batch_size != "auto" else auto or 1
    check_batch_split(cfg, world, micro)
    return micro, auto_line


def _print_time_estimate(cfg: Config, world: int, flops: float) -> None:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    peak = gpu_peak_flops(name or ASSUMED_GPU)
    if not peak:
        print(f"time: no estimate, the dense bf16 peak of {name} is not known (GPU_PEAK_BF16_FLOPS)")
        return
    tokens_per_s = ASSUMED_MFU * peak * world / flops
    print(f"time at {ASSUMED_MFU:.0%} MFU on {world} x {name or ASSUMED_GPU + ' (assumed: no CUDA device here)'}: "
          f"{tokens_per_s:,.0f} tokens/s, {cfg.tokens_per_step / tokens_per_s:.2f} s per step, "
          f"{cfg.steps * cfg.tokens_per_step / tokens_per_s / 3600:.1f} h for {cfg.steps:,} steps")


# ---- end of the planner


def batch_plan(cfg: Config, world: int) -> tuple[int, int]:
    """(micro-batch per device, accumulation steps) so that every optimizer step sees --batch-size sequences.
    'auto' on CUDA: the largest micro-batch the memory plan fits on this GPU (build_trainer then confirms it with
    one real step); on the CPU: the per-process batch capped at CPU_AUTO_MICRO."""
    if cfg.micro_batch_size == "auto":
        check_batch_split(cfg, world)
        if torch.cuda.is_available():
            micro, plan = auto_micro_batch(cfg, world)
            why = (f"planned {plan.total / GiB:.1f} of {plan.card / GiB:.1f} GiB, at most {1 - AUTO_MARGIN:.0%} "
                   "of the card; --estimate shows the plan")
        else:
            micro = cpu_auto_micro_batch(cfg, world)
            why = (f"CPU: the per-process batch {cfg.batch_size // world} capped at {CPU_AUTO_MICRO}, "
                   "no GPU memory to plan against")
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"micro-batch auto: {micro} ({why})", flush=True)
    else:
        micro = int(cfg.micro_batch_size)
    check_batch_split(cfg, world, micro)
    # the streams each process reads from (ranks share streams when the world size does not divide them)
    read = min(len({p % cfg.data_streams for p in range(rank, cfg.batch_size, world)}) for rank in range(world))
    if cfg.data_workers > read:
        raise ConfigError(f"--data-workers {cfg.data_workers} exceeds the {read} data stream(s) each of {world} "
                          "process(es) reads (a loader process owns whole streams); lower --data-workers, or raise "
                          "--data-streams and --batch-size")
    return micro, cfg.batch_size // (micro * world)


def lr_at(cfg: Config, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def precision_policy(dtype: torch.dtype) -> dict:
    """What runs in which precision: the same under one process, DDP and FSDP (the streams' dtype is a choice:
    fp32, so that a gain is never a bf16 rounding artefact). Recorded in config.json; the report marks a table
    whose runs differ in it."""
    return {"matmuls": "bf16" if dtype == torch.bfloat16 else "fp32", "residual_streams": "fp32",
            "mixing_parameters": "fp32", "coefficients": "fp32", "probe": "fp32 H_res, fp64 products"}


def use_flash_attention(cfg: Config, device: torch.device, dtype: torch.dtype) -> bool:
    try:
        import flash_attn  # noqa: F401
        installed = True
    except ImportError:
        installed = False
    if cfg.attn == "flash" and not (installed and device.type == "cuda" and dtype == torch.bfloat16):
        raise ConfigError("--attn flash needs flash-attn installed (bash setup.sh on a CUDA machine), a CUDA "
                          "device and bf16; use --attn sdpa")
    return cfg.attn == "flash" or (cfg.attn == "auto" and installed and device.type == "cuda"
                                   and dtype == torch.bfloat16)


def check_resumable(run_dir: Path, cfg: Config, log: RunLog) -> dict:
    """Refuse to continue a run folder made by a different model, or any existing run under --resume never;
    refuse changed training settings unless --allow-changed-settings. Returns the allowed changes
    ({key: [old, new]})."""
    path = run_dir / "config.json"
    if not path.exists():
        return {}
    if cfg.resume == "never":
        raise ConfigError(f"{run_dir} already holds a run and --resume never refuses to overwrite it; "
                          "choose another --run-name or --out")
    try:
        old = json.loads(path.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError):
        old = None
    if not isinstance(old, dict):
        raise log.refuse(f"{path} is unreadable (no \"config\" record); move that run folder away or choose another "
                         "--run-name")
    for key in MODEL_KEYS:
        if old.get(key) != getattr(cfg, key):
            raise ConfigError(f"{run_dir} was trained with {key}={old.get(key)!r} but this command has "
                              f"{key}={getattr(cfg, key)!r}; choose another --run-name or --out")
    changes = {key: [old.get(key), getattr(cfg, key)] for key in TRAINING_KEYS if old.get(key) != getattr(cfg, key)}
    if changes and not cfg.allow_changed_settings:
        raise ConfigError(f"{run_dir} was trained with other settings ({changes_text(changes)}); rerun with its "
                          "settings, choose another --run-name, or pass --allow-changed-settings to continue under "
                          "the new ones")
    return changes


def changes_text(changes: dict) -> str:
    return ", ".join(f"{key} {was!r} -> {now!r}" for key, (was, now) in changes.items())


def record_setting_changes(run_dir: Path, changes: dict, log: RunLog, step: int) -> None:
    """A resume under changed training settings, said in the log and kept in settings_changes.jsonl."""
    if not changes:
        return
    log.info(f"continuing at step {step} under changed settings (--allow-changed-settings): {changes_text(changes)}")
    if log.enabled:
        with open(run_dir / "settings_changes.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "step": step, "changes": changes}) + "\n")


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_record(cfg: Config, micro: int, dist: Dist, dtype: torch.dtype, use_flash: bool, params: dict) -> dict:
    return {"config": {**dataclasses.asdict(cfg), "micro_batch_size": micro}, "n_params": params["total"],
            "params": params, "world_size": dist.world, "device": dist.device.type,
            "device_name": device_name(dist.device),
            "dtype": str(dtype).removeprefix("torch."), "precision": precision_policy(dtype),
            "attention": "flash" if use_flash else "sdpa",
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                         "datasets": importlib.metadata.version("datasets"),
                         "tiktoken": importlib.metadata.version("tiktoken")},
            "git_commit": git_commit()}


class StopRequest:
    """SIGTERM/SIGINT only set a flag: the step in flight finishes, then a checkpoint is saved."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


class Faults:
    """The test hooks, in one place and consulted at a few named points of a step (without the variables each
    point does nothing). TRAIN_C4_INJECT_NAN="WHAT:STEP[:RANK]": at optimizer step STEP (on RANK, default all)
    WHAT is data, loss or grad (made non-finite), hang or oom. TRAIN_C4_FAIL_DEVICES: device ids that behave
    as dead GPUs (for the launcher's tests)."""

    def __init__(self, rank: int):
        what, step, *only = (os.environ.get("TRAIN_C4_INJECT_NAN") or "none:0").split(":")
        self.what, self.step, self.rank = what, int(step), rank
        self.active = not only or int(only[0]) == rank

    def due(self, what: str, step: int) -> bool:
        return self.active and self.what == what and self.step == step

    def at_start(self) -> None:
        failing = set(filter(None, os.environ.get("TRAIN_C4_FAIL_DEVICES", "").split(",")))
        visible = set(filter(None, os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")))
        if failing & visible:
            raise DeviceFailure(f"device error on GPU {','.join(sorted(failing & visible))} (injected by "
                                "TRAIN_C4_FAIL_DEVICES)")

    def on_input(self, model: GPT, step: int):
        """Token ids cannot hold a NaN: the data fault makes the embedded batch, the data's first floating-point
        form, non-finite (the hook's handle removes it on leaving the with-block)."""
        if not self.due("data", step):
            return contextlib.nullcontext()
        return model.wte.register_forward_hook(lambda module, args, out: out * float("nan"))

    def on_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        if self.due("hang", step):          # a stuck rank: the others must time out, not wait forever
            time.sleep(24 * 3600)
        if self.due("oom", step):           # one rank fails alone: the others must name it and stop
            raise torch.OutOfMemoryError("injected by TRAIN_C4_INJECT_NAN")
        return loss * float("nan") if self.due("loss", step) else loss

    def on_gradients(self, model: nn.Module, step: int) -> None:
        if self.due("grad", step):
            next(model.parameters()).grad.fill_(float("inf"))


@dataclasses.dataclass
class Trainer:
    """What the loop needs, built once; the loop itself is the method `run`."""
    cfg: Config
    dist: Dist
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: Loader
    val: tuple[torch.Tensor, torch.Tensor]
    micro: int
    accum: int
    dtype: torch.dtype
    log: RunLog
    run_dir: Path
    peak_flops: float | None
    flops_per_token: float
    step: int = 0
    tokens: int = 0
    wandb_run: object = None
    steady: bool = False        # past the first step: the short collective time-out applies
    faults: Faults | None = None

    def autocast(self):
        return torch.autocast(self.dist.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16)

    def micro_steps(self, stop: StopRequest) -> torch.Tensor:
        """Forward and backward of every micro-batch; the gradient is all-reduced on the last one only."""
        device, loss_sum, step = self.dist.device, torch.zeros((), device=self.dist.device), self.step + 1
        for micro_step in range(self.accum):
            x, y = (t.to(device, non_blocking=True) for t in self.loader.next_batch())
            last = micro_step == self.accum - 1
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            with sync:
                with self.autocast(), self.faults.on_input(unwrap(self.model), step):
                    _, loss = self.model(x, y)
                loss = self.faults.on_loss(loss, step)
                (loss / self.accum).backward()
            loss_sum += loss.detach()
        self.faults.on_gradients(self.model, step)
        stop_flag = torch.tensor(float(stop.requested), device=device)
        return all_ranks_sum(self.dist, torch.stack([loss_sum / (self.accum * self.dist.world), stop_flag]))

    def optimizer_step(self, stop: StopRequest) -> tuple[float, float, bool]:
        lr = lr_at(self.cfg, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_and_stop = self.micro_steps(stop)
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip or float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        # the one host synchronisation of a step: divergence must be caught before the update is applied
        loss, stop_votes, norm = torch.cat([loss_and_stop, grad_norm.reshape(1).to(loss_and_stop)]).tolist()
        if not self.steady:
            shorten_timeout(self.dist, self.cfg.data_timeout)   # every rank has data, compiled code, communicators
            self.steady = True
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.log.metrics({"step": self.step + 1, "time": time.time(), "loss": loss, "lr": lr, "grad_norm": norm})
            raise Diverged(f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} at step "
                           f"{self.step + 1} (loss {loss}, pre-clip gradient norm {norm})")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm, stop_votes > 0

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation set; each rank takes every world-th sequence."""
        was_training = self.model.training
        self.model.eval()
        x_all, y_all = (t[self.dist.rank::self.dist.world] for t in self.val)
        total = torch.zeros(2, device=self.dist.device)
        # under the run's progress bar (an interactive terminal), a bar of its own: at C4 scale an evaluation
        # takes minutes, and a still bar would look like a hang
        for start in tqdm(range(0, len(x_all), self.micro), desc="evaluation", leave=False,
                          disable=self.log.bar is None):
            x, y = (t[start:start + self.micro].to(self.dist.device) for t in (x_all, y_all))
            with self.autocast():
                _, loss = self.model(x, y)
            total += torch.stack([loss.float() * len(x), torch.tensor(float(len(x)), device=self.dist.device)])
        self.model.train(was_training)
        loss_sum, count = all_ranks_sum(self.dist, total).tolist()
        return loss_sum / count

    def probe(self, with_layers: bool) -> dict:
        probe_idx = self.val[0][:self.cfg.probe_sequences].to(self.dist.device)
        return instability_probe(self.model, probe_idx, self.autocast, with_layers)

    def save(self) -> None:
        """Every rank: its data-loader and RNG state. Model and optimizer: rank 0 writes them whole
        (one process, DDP), or every rank writes its shards with torch.distributed.checkpoint (FSDP)."""
        files = {f"rank{self.dist.rank}.pt": {"data": self.loader.state_dict(), "rng": rng_state()}}
        sharded = None
        if is_sharded(self.model):
            from torch.distributed.checkpoint.state_dict import get_state_dict
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            sharded = {"model": model_state, "optimizer": optimizer_state}
        if self.dist.is_main:
            files["train_state.pt"] = {"step": self.step, "tokens": self.tokens}
            if sharded is None:
                files |= {"model.pt": unwrap(self.model).state_dict(), "optimizer.pt": self.optimizer.state_dict()}
        write_checkpoint(self.run_dir, self.step, files, self.dist, self.cfg.keep_checkpoints, sharded)
        self.log.live["last_checkpoint_step"] = self.step
        if self.loader.skipped:
            self.log.info(f"data: {self.loader.skipped} malformed or empty lines skipped so far")

    def restore(self) -> None:
        """Called after wrapping: FSDP loads its shards in place, resharded to this world size. The newest
        checkpoint that verifies and loads; the newer ones that did not are set aside, to be written again."""
        problems = []

        def fall_back(line: str) -> None:
            problems.append(line.removeprefix("checkpoint "))
            self.log.info(line)

        for folder, files, marker in verified_checkpoints(newest_first(self.run_dir, self.dist), self.dist, fall_back):
            problem = agreed_problem(self.dist, self._load(folder, files, marker))
            if problem is None:
                self.step, self.tokens = files["train_state.pt"]["step"], files["train_state.pt"]["tokens"]
                self.log.live["last_checkpoint_step"] = self.step
                self.log.info(f"resumed from {folder} (step {self.step}, {self.tokens:,} tokens)")
                self._set_aside_newer(folder)
                return
            fall_back(f"checkpoint {folder.name} {problem}; falling back to the previous one")
        if problems:
            # silently starting over would overwrite the logged history of a run that made progress
            raise self.log.refuse(f"no checkpoint of {self.run_dir} is usable (newest: {problems[0].split(';')[0]}); "
                                  "move that folder away or choose another --run-name to start over")

    def _set_aside_newer(self, resumed: Path) -> None:
        barrier(self.dist)                              # every rank has read what it needs of them
        if self.dist.is_main:
            for folder in checkpoint_dirs(self.run_dir)[::-1]:
                if folder == resumed:
                    break
                self.log.info(f"checkpoint {folder.name} set aside as {set_aside(folder).name}")

    def _load(self, folder: Path, files: dict, marker: dict) -> str | None:
        """Load a verified checkpoint into the model, optimizer, loader and RNG; what did not fit, or None."""
        sharded = marker.get("format") == "sharded"
        self._check_format(folder, sharded)             # the command's, not the checkpoint's, problem
        try:
            self._load_model_and_optimizer(folder, files, sharded)
            self._load_data_and_rng(files)
        except (torch.OutOfMemoryError, torch.distributed.DistError):
            raise
        except (TrainerError, RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
            return f"does not fit this run ({_first_cause(error)})"
        return None

    def _check_format(self, folder: Path, sharded: bool) -> None:
        if sharded != is_sharded(self.model):
            fix = ("resume it under torchrun with --parallel fsdp (any number of processes), or export the "
                   "weights with `python train_c4.py --consolidate CHECKPOINT OUT.pt`" if sharded else
                   "resume it with one process or --parallel ddp")
            this_run = "FSDP" if is_sharded(self.model) else "not FSDP"
            raise ConfigError(f"checkpoint {folder} holds {'sharded (FSDP)' if sharded else 'whole'} model "
                              f"and optimizer state, this run is {this_run}; {fix}")

    def _load_model_and_optimizer(self, folder: Path, files: dict, sharded: bool) -> None:
        if not sharded:
            unwrap(self.model).load_state_dict(files["model.pt"])
            self.optimizer.load_state_dict(files["optimizer.pt"])
            return
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp_load(state, folder)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def _load_data_and_rng(self, files: dict) -> None:
        ranks = [state for name, state in sorted(files.items()) if name.startswith("rank")]
        self.loader.load_state_dict([state["data"] for state in ranks])
        if len(ranks) != self.dist.world:
            self.log.info(f"data: the checkpoint was written by {len(ranks)} process(es), this run has "
                          f"{self.dist.world}; every data stream continues where it stopped, so the batches are "
                          "those of an uninterrupted run")
        own = files.get(f"rank{self.dist.rank}.pt")
        if own is not None:
            set_rng_state(own["rng"])

    def record(self, loss: float, norm: float, lr: float, seconds: float, data_wait: float) -> dict:
        tokens_per_s = self.cfg.tokens_per_step / seconds
        mem = torch.cuda.max_memory_allocated(self.dist.device) / 1e9 if self.dist.device.type == "cuda" else None
        mfu = tokens_per_s * self.flops_per_token / (self.peak_flops * self.dist.world) if self.peak_flops else None
        return {"step": self.step, "time": time.time(), "loss": loss, "lr": lr, "grad_norm": norm,
                "clipped": bool(self.cfg.grad_clip and norm > self.cfg.grad_clip), "tokens": self.tokens,
                "step_time_s": seconds, "tokens_per_s": tokens_per_s, "mfu": mfu, "mem_peak_gb": mem,
                "data_wait_share": data_wait / seconds}

    def measurements(self) -> dict:
        """The probe and the validation loss, at their own intervals (and always at the last step)."""
        cfg, step, last = self.cfg, self.step, self.step == self.cfg.steps
        out = {}
        if step % cfg.metrics_every == 0 or last:
            out |= self.probe(with_layers=step % cfg.layer_metrics_every == 0 or last)
        if step % cfg.eval_every == 0 or last:
            out["val_loss"] = self.evaluate()
        return out

    def run(self, stop: StopRequest) -> None:
        progress = Progress(self)
        if self.step == 0:
            self.log.metrics({"step": 0, "time": time.time(), **self.probe(with_layers=True)})
        while self.step < self.cfg.steps:
            started, lr, waited = time.perf_counter(), lr_at(self.cfg, self.step), self.loader.waited
            loss, norm, stopping = self.optimizer_step(stop)
            self.step += 1
            self.tokens += self.cfg.tokens_per_step
            seconds = time.perf_counter() - started
            measured = self.measurements()
            record = self.record(loss, norm, lr, seconds, self.loader.waited - waited) | measured
            self.log.metrics(record)
            if self.wandb_run is not None and (measured or self.step % self.cfg.log_every == 0):
                # not every step: W&B allows a run about 2 requests a second, and a matrix shares one project
                self.wandb_run.log(wandb_record(record), step=self.step)
            progress.update(record)
            if stopping or self.step % self.cfg.ckpt_every == 0 or self.step == self.cfg.steps:
                self.save()
            if stopping:
                raise Interrupted(f"stopped by a signal at step {self.step}; checkpoint saved, rerun to resume")
        progress.close()


class Progress:
    """A tqdm bar on an interactive terminal, a plain log line every --log-every steps otherwise. Both carry the
    run's pace (tokens/s, MFU, memory, ETA); status.json shows the same, rewritten at every log step."""

    LIVE_KEYS = ("loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s", "mfu", "mem_peak_gb",
                 "val_loss", "amax_fwd", "amax_bwd")

    def __init__(self, trainer: Trainer):
        self.trainer, self.step_seconds = trainer, None
        interactive = trainer.dist.is_main and sys.stderr.isatty()
        self.bar = tqdm(total=trainer.cfg.steps, initial=trainer.step, dynamic_ncols=True) if interactive else None
        trainer.log.bar = self.bar
        trainer.log.live["steps"] = trainer.cfg.steps

    def update(self, record: dict) -> None:
        cfg, log, step = self.trainer.cfg, self.trainer.log, record["step"]
        # a moving average: the ETA follows the recent pace, not the first step's compilation or an evaluation
        seconds = record["step_time_s"]
        self.step_seconds = seconds if self.step_seconds is None else 0.9 * self.step_seconds + 0.1 * seconds
        log.live.update({key: record[key] for key in self.LIVE_KEYS if key in record},
                        eta_s=self.step_seconds * (cfg.steps - step))
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                                 amax=self._amax())
            self.bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            if self.bar is None:
                log.info(self.line(record))
            log.status("running", step)

    def _amax(self) -> str:
        amax = self.trainer.log.live.get("amax_fwd")
        return f"{amax:.3g}" if amax is not None else "-"

    def line(self, record: dict) -> str:
        live = self.trainer.log.live
        val = f" val {record['val_loss']:.4f}" if "val_loss" in record else ""
        mfu = f" mfu {live['mfu']:.0%}" if live.get("mfu") is not None else ""
        mem = f" mem {live['mem_peak_gb']:.1f}GB" if live.get("mem_peak_gb") is not None else ""
        return (f"step {record['step']}/{self.trainer.cfg.steps} loss {record['loss']:.4f}{val} lr {record['lr']:.3g} "
                f"grad_norm {record['grad_norm']:.3g} amax_fwd {self._amax()} tok/s {record['tokens_per_s']:,.0f}"
                f"{mfu}{mem} eta {timedelta(seconds=round(live['eta_s']))}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.trainer.log.bar = None


def memory_floor(cfg: Config, micro: int, world: int) -> float:
    """A floor, in closed form (nothing built), of the bytes one process needs: 16 per parameter of the plain GPT
    body (fp32 weights, gradients, AdamW's two states; sharded under FSDP), per token a residual state and a sublayer
    output per block and the fp32 log-probabilities with their two backward buffers, and the validation token ids.
    The real plan (--estimate) is larger; this only has to be cheap enough to run before the first allocation."""
    vocab, C = padded_vocab_size(cfg.tokenizer), cfg.width
    parameters = (vocab + cfg.seq_len) * C + cfg.depth * 12 * C * C
    shards = world if world > 1 and cfg.parallel == "fsdp" else 1
    activations = micro * cfg.seq_len * 4 * (2 * cfg.depth * C + 3 * vocab)
    return 16 * parameters / shards + activations + 8 * cfg.eval_batches * cfg.batch_size * (cfg.seq_len + 1)


def check_memory(cfg: Config, dist: Dist, micro: int) -> None:
    if dist.device.type == "cuda":
        available, where = gpu_memory_bytes(cfg), f"this GPU ({torch.cuda.get_device_name(dist.device)})"
    else:
        available, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
    need = memory_floor(cfg, micro, dist.world)
    if need > available:
        raise ConfigError(f"this run needs at least {need / GiB:,.1f} GiB per process at micro-batch {micro}, more "
                          f"than the {available / GiB:,.1f} GiB of {where}; lower --depth, --width, --seq-len, "
                          "--micro-batch-size or --eval-batches (--estimate shows the plan)")


def check_writable_folder(folder: Path, what: str) -> None:
    """Create `folder` if needed and prove that it takes a file, before anything is computed: a bad path is a
    one-line config error (exit 2) instead of a failure at the first write."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{what} {folder} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ConfigError(f"{what} {folder} cannot be written to ({_first_cause(error)})") from None


def preflight(cfg: Config, dist: Dist) -> tuple[int, int, DataFiles]:
    """Every check of a run that needs no model and no data read: (micro-batch, accumulation steps, the files).
    A bad setting ends here with one line, before anything is allocated; only --out is created."""
    micro, accum = batch_plan(cfg, dist.world)
    check_memory(cfg, dist, micro)
    data = resolve_data_files(cfg.data, cfg.val_data)
    check_writable_folder(Path(cfg.out), "--out")
    return micro, accum, data


def build_trainer(cfg: Config, dist: Dist) -> Trainer:
    micro, accum, data = preflight(cfg, dist)
    run_dir = Path(cfg.out) / cfg.run_name
    log = RunLog(run_dir, dist.is_main)                 # locks the run folder before anything of it is read
    changes = check_resumable(run_dir, cfg, log)
    dtype = compute_dtype(cfg, dist.device)
    use_flash = use_flash_attention(cfg, dist.device, dtype)
    tokenizer = make_tokenizer(cfg.tokenizer)
    val = fixed_sequences(data, tokenizer, cfg.seq_len, cfg.eval_batches * cfg.batch_size)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg, use_flash).to(dist.device)
    wrapped = wrap_model(model, cfg, dist, dtype)        # before the optimizer: FSDP2 replaces the parameters
    optimizer = make_optimizer(model, cfg)
    micro, accum = confirm_micro_batch(cfg, dist, wrapped, dtype, micro, accum)     # auto on CUDA: one real step
    batches = RankBatches(data.train, tokenizer, cfg, dist.rank, dist.world, micro, data.held_out_slice)
    loader = make_loader(batches, cfg, pin_memory=dist.device.type == "cuda")
    params = count_parameters(cfg)
    trainer = Trainer(cfg, dist, wrapped, optimizer, loader, val,
                      micro, accum, dtype, log, run_dir,
                      gpu_peak_flops(device_name(dist.device)),
                      flops_per_token(cfg, params["non_embedding"]), faults=Faults(dist.rank))
    trainer.restore()
    record_setting_changes(run_dir, changes, trainer.log, trainer.step)
    record = run_record(cfg, micro, dist, dtype, use_flash, params)
    if dist.is_main:
        write_json_atomic(run_dir / "config.json", record)
    trainer.wandb_run = start_wandb(cfg, run_dir, record, trainer.log)
    announce(trainer, params, record, data)
    return trainer


def announce(trainer: Trainer, params: dict, record: dict, data: DataFiles) -> None:
    cfg, log = trainer.cfg, trainer.log
    log.info(f"run {cfg.run_name}: {cfg.residual} depth {cfg.depth} width {cfg.width} streams "
             f"{1 if cfg.residual == 'baseline' else cfg.expansion} on {trainer.dist.world} x {record['device_name']} "
             f"({record['dtype']}, {record['attention']} attention)")
    log.info(f"model: {parameter_summary(params)}")
    log.info(f"tokens per step: {cfg.tokens_per_step:,} = {cfg.batch_size} sequences x {cfg.seq_len}; micro-batch "
             f"{trainer.micro} x {trainer.accum} accumulation steps x {trainer.dist.world} process(es)")
    log.info(f"run: {cfg.steps:,} steps, {cfg.steps * cfg.tokens_per_step:,} tokens, "
             f"{trainer.flops_per_token:.3g} FLOPs per token")
    loader = f"{cfg.data_workers} loader process(es)" if cfg.data_workers else "a loader thread"
    read = len(set(trainer.loader.batches.owners))
    shared = ", shared between processes" if cfg.data_streams % trainer.dist.world else ""
    log.info(f"data: {cfg.data}, {cfg.data_streams} streams ({read} read by this process{shared}, {loader} each), "
             f"data seed {cfg.data_seed}")
    log.info(f"held out for validation and the probe: {held_out_source(data, cfg.val_data)}")


def held_out_source(data: DataFiles, val_data: str) -> str:
    if data.held_out_slice:
        return (f"1 document in {HELD_OUT_EVERY} of the training files (by a hash of its text), never trained on; "
                "the first of them in file order")
    return f"{len(data.val)} file(s) " + (f"of --val-data {val_data!r}" if val_data else "named 'validation'")


def train(cfg: Config) -> None:
    dist = setup_distributed()
    trainer = build_trainer(cfg, dist)
    log, stop = trainer.log, StopRequest()
    # a fresh start logs its own step-0 probe again, so nothing of an earlier attempt is kept
    log.open_metrics(keep_through_step=trainer.step if trainer.step else -1)
    log.count_restart()
    log.status("running", trainer.step)
    try:
        trainer.faults.at_start()
        trainer.run(stop)
    except Diverged as error:
        log.status("diverged", trainer.step, EXIT_DIVERGED, str(error))
        raise
    except Interrupted as error:
        log.status("interrupted", trainer.step, EXIT_INTERRUPTED, str(error))
        raise
    except BaseException as error:
        code, reason, own = failure(error, dist, trainer.micro)
        status = reason if dist.world == 1 or reason.startswith("rank ") else f"rank {dist.rank}: {reason}"
        if dist.world > 1 and not dist.is_main and own:
            # this rank failed first; rank 0 may be killed by torchrun before it can record why
            write_json_atomic(trainer.run_dir / "status.json", {"state": "failed", "step": trainer.step,
                              "exit_code": code, "reason": status, "updated": time.time()})
        with contextlib.suppress(OSError):  # a disk refusing even status.json: the printed line still says why
            log.status("failed", trainer.step, code, status)
        raise RunFailed(code, reason) from error
    finally:
        trainer.loader.close()
    log.status("completed", trainer.step, EXIT_OK)
    log.info(f"completed {trainer.step} steps; run folder {trainer.run_dir}")
    if trainer.wandb_run is not None:
        trainer.wandb_run.finish()


# ----------------------------------------------------------------------------------------------
# main: one line and an exit code for every expected failure (the codes: EXIT_* above, docs/reliability.md)

def failure(error: BaseException, dist: Dist, micro: int | None = None) -> tuple[int, str, bool]:
    """The one classification of a failure into (exit code, reason, whether it is this rank's own): a RunFailed
    keeps its own; a rank that only lost contact takes the reason of the rank that failed first (rank_failure)."""
    if isinstance(error, RunFailed):
        return error.exit_code, str(error), True
    code, reason = classify_failure(error, micro)
    if isinstance(error, (Diverged, Interrupted)):      # every rank stops at the same step: nothing to look up
        return code, reason, True
    return rank_failure(dist, code, reason)


def classify_failure(error: BaseException, micro: int | None) -> tuple[int, str]:
    if isinstance(error, TrainerError):
        return error.exit_code, str(error)
    if isinstance(error, torch.OutOfMemoryError):
        smaller = max(1, (micro or 2) // 2)
        return EXIT_OOM, f"out of memory at micro-batch {micro}; retry with --micro-batch-size {smaller}"
    text = str(error)
    if isinstance(error, RuntimeError) and "gloo/transport" in text:
        # a peer closed its connection or did not answer within the time-out: gloo's message, minus its source path
        cause = text.splitlines()[0].split("] ", 1)[-1].split(". This is typically")[0]
        return EXIT_DEVICE, f"lost contact with the other ranks ({cause})"
    if isinstance(error, torch.distributed.DistError) or (
            isinstance(error, RuntimeError) and any(key in text for key in ("CUDA error", "NCCL", "cuDNN", "Gloo"))):
        return EXIT_DEVICE, f"device or communication error: {text.splitlines()[0] if text else type(error).__name__}"
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted before the first step"
    if isinstance(error, OSError):          # the file system refused: full, quota, read-only, permission
        return 1, f"{error.strerror or error}{f': {error.filename}' if error.filename else ''}"
    return 1, f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    dist = Dist(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), torch.device("cpu"))
    try:
        if "--consolidate" in argv:
            print(consolidate(*consolidate_arguments(argv)))
            return EXIT_OK
        cfg = parse_config(argv)
        if cfg.estimate:
            print_estimate(cfg)
        else:
            train(cfg)
        end_distributed()
        return EXIT_OK
    except SystemExit as done:               # --help
        return done.code if isinstance(done.code, int) else EXIT_OK
    except BaseException as error:
        code, reason, _ = failure(error, dist)
        if isinstance(error, (Diverged, Interrupted)):
            end_distributed()                # every rank stops at the same step: a clean shutdown
        cause = error.__cause__ if isinstance(error, RunFailed) else error
        if code == 1 and not isinstance(cause, (TrainerError, OSError)):
            raise                            # a bug, not an expected failure: its traceback is what helps
        print(f"error: {'' if dist.world == 1 else f'rank {dist.rank}: '}{reason}", file=sys.stderr)
        if dist.world > 1:
            # torchrun sends SIGTERM to every other rank as soon as one exits non-zero, and Python restores
            # the default handler while it shuts down: a rank a few ms behind would be reported as killed
            # (-15) instead of with its own exit code
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return code


def consolidate_arguments(argv: list[str]) -> tuple[Path, Path]:
    parser = _OneLineErrorParser(prog="train_c4.py --consolidate", description="Write one file with the "
                                 "weights of a checkpoint (FSDP's sharded ones included), loadable without a "
                                 "process group: torch.load(OUT, weights_only=True) -> GPT.load_state_dict.")
    parser.add_argument("--consolidate", nargs=2, metavar=("CHECKPOINT", "OUT"), required=True,
                        help="a checkpoint folder (RUN/checkpoints/step-N) or a run folder (its newest "
                        "complete checkpoint), and the .pt file to write")
    source, out = map(Path, parser.parse_args(argv).consolidate)
    if not source.is_dir():
        raise ConfigError(f"--consolidate: {source} is not a checkpoint or run folder")
    if out.is_dir():
        raise ConfigError(f"--consolidate: {out} is a folder; give the .pt file to write")
    if not out.parent.is_dir():
        raise ConfigError(f"--consolidate: {out.parent} is not a folder; create it first")
    check_writable_folder(out.parent, f"--consolidate: {out}'s folder")
    return source, out


if __name__ == "__main__":
    sys.exit(main())
