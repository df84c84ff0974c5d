"""Train a GPT-style transformer on C4 with a plain residual, Hyper-Connections (HC) or
manifold-constrained Hyper-Connections (mHC), and measure whether the residual streams amplify.

    python train_c4.py --depth 48 --seed 123                 # one full C4 run (mHC by default)
    python train_c4.py --preset demo --residual hc           # CPU minutes, bundled Shakespeare
    torchrun --nproc_per_node=8 train_c4.py --parallel fsdp  # one run over a whole node

The maths, the metrics and every choice where the papers are silent are in docs/model.md; the run folder,
exit codes and reliability rules in README.md and docs/reliability.md. Sections, in file order: config/CLI,
model, instability metrics, data, distributed, checkpointing, logging, training loop, main. What is not the model,
the loader, the wrapping, bf16 or a checkpoint's contents lives in the package hcstudy (its map: hcstudy/__init__.py):
the kernels' fast paths, the planner, the run folder's files, the data read ahead, the run record and W&B, the flags,
the exit codes; it never imports this file, which passes what it needs.
"""

from __future__ import annotations

import contextlib, dataclasses, functools, glob, hashlib, itertools, json, math, os, random, re, signal, sys, time
from datetime import timedelta
from pathlib import Path

from hcstudy import contract
from hcstudy.contract import (EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_OK, PLAN_JOBS, STREAM_KEYS, STREAM_LAYER_KEYS,
                              ConfigError, DataUnavailable, Diverged, Interrupted, PlanRequest, RunFailed,
                              TrainerError)

if __name__ == "__main__":  # a stop while torch loads (a second or more) is a stop before any step: 75, not 143
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(EXIT_INTERRUPTED))
    contract.exit_without_packages("train_c4.py", "torch", "tiktoken", "tqdm")

import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from hcstudy import config_flags as flags
from hcstudy.config_flags import COUNT, NATURAL, option
from hcstudy.failures import classify_failure, exit_process, failure
from hcstudy.kernels import choice, cross_entropy, fused
from hcstudy.planner import gpus, memory
from hcstudy.planner.estimate import print_estimate
from hcstudy.planner.plan_jobs import answer_jobs
from hcstudy.progress import Progress
from hcstudy.readahead import Loader, dataset_cache, hf_cache_refused, in_hf_cache
from hcstudy.run_folder import (NonFiniteState, RunLog, check_resumable, check_writable_folder, dcp_load, first_cause,
                                history_on, resume_from, rng_state, set_rng_state, write_checkpoint, write_json_atomic)
from hcstudy.run_record import announce, device_name, run_record
from hcstudy.wandb_log import WANDB_MODES, start_wandb, wandb_record

# Imported where they are used, on purpose (`python -X importtime -c 'import train_c4'`): datasets and torch's
# fsdp and checkpoint packages (a second each, which --help and most tests never need), flash_attn, wandb.

ROOT = Path(__file__).resolve().parent

# ----------------------------------------------------------------------------------------------
# config/CLI: every setting of a run, resolved once into a frozen Config (its flags: config_flags; errors: contract)

PRESETS = {
    "c4": {},
    # a few thousand parameters: the test suite's model
    "tiny": dict(depth=2, width=16, heads=2, expansion=4, seq_len=32, batch_size=4, micro_batch_size="2", steps=20,
                 lr=3e-3, warmup=2, data="sample", tokenizer="byte", eval_every=10, eval_batches=2, metrics_every=5,
                 layer_metrics_every=10, probe_sequences=2, log_every=5, ckpt_every=10, shuffle_buffer=64,
                 data_streams=2, data_workers=0, wandb="disabled"),
    # CPU minutes on the bundled Shakespeare: large enough learning rate for HC to drift visibly
    "demo": dict(depth=4, width=128, heads=4, seq_len=128, batch_size=16, micro_batch_size="16", steps=600, lr=3e-3,
                 warmup=50, data="sample", tokenizer="byte", eval_every=100, eval_batches=4, metrics_every=20,
                 layer_metrics_every=100, probe_sequences=4, log_every=20, ckpt_every=200, shuffle_buffer=64,
                 data_workers=0),
    # the public 10M-parameter small-scale reproduction (character-level Shakespeare)
    "part1": dict(depth=6, width=384, heads=6, seq_len=256, batch_size=64, micro_batch_size="16", steps=5000, lr=1e-3,
                  warmup=100, data="sample", tokenizer="byte", eval_every=250, eval_batches=8, metrics_every=50,
                  layer_metrics_every=250, log_every=50, ckpt_every=500, shuffle_buffer=64, data_workers=0),
    # the public 1.7B study's stress arm (run at depths 32, 48 and 64): 3x the learning rate, 3000 steps
    "stress": dict(lr=3e-4, steps=3000),
    # the public 1.7B study's own HC and mHC and its recipe (docs/model.md, "The public study's model")
    "seed-study": dict(contract.SEED_STUDY_MODEL, coefficients="sequence", batch_size=8, micro_batch_size="8",
                       steps=5000, vocab="exact", shuffle_buffer=10_000),
}

# --help's groups, in its order
MODEL, OPTIMISATION, DATA, MEASUREMENT, RUN_FOLDER, PARALLELISM, PLANNING = (
    "model", "optimisation", "data", "measurement and logging", "run folder and checkpoints", "parallelism", "planning")
MHC_LITE_MAX_EXPANSION = 6                      # 720 permutations; 7 would be 5,040 logits per token and sublayer


@dataclasses.dataclass(frozen=True)
class Config:
    """Every flag, with its facts: a new flag is one more line here. The bounds, far beyond any real run, keep
    --estimate, the planner and the loader from allocating without end, and initial values far inside float32."""
    # the defaults are the study's 1.73B model (docs/model.md, "Baseline and the transformer body")
    preset: str = option("c4", MODEL, None, "named sets of defaults, applied in order (demo,seed-study or repeated "
        "--preset); explicit flags win", repeated=True)
    residual: str = option("mhc", MODEL, contract.METHODS, "residual path: plain pre-norm residual, dynamic HC, "
        "manifold-constrained HC, mHC-lite (H_res a softmax mixture of the n! permutations) or identity-HC (mHC's read "
        "and write, H_res = I)")
    coefficients: str = option("token", MODEL, ("token", "sequence"), "the mixing coefficients from each token's "
        "streams (causal), or from the streams averaged over the whole sequence (the public study's; not causal)")
    depth: int = option(32, MODEL, (1, 512), "number of transformer blocks (each has an attention and an MLP sublayer)")
    width: int = option(2048, MODEL, (1, 2 ** 16), "model width C")
    heads: int = option(32, MODEL, (1, 256), "attention heads (width must divide by it)")
    expansion: int = option(4, MODEL, (1, 64), "number of residual streams n for HC and mHC")
    seq_len: int = option(1024, MODEL, (1, 2 ** 16), "context length in tokens")
    sinkhorn_iters: int = option(20, MODEL, (1, 10_000), "Sinkhorn-Knopp iterations per mHC mixing matrix")
    hc_scale_init: float = option(0.01, MODEL, (-1e6, 1e6), "initial HC dynamic scales s_a, s_b")
    mhc_gate_init: float = option(0.01, MODEL, (-1e6, 1e6), "initial mHC gates a_pre, a_post, a_res")
    mhc_res_diag: float = option(4.0, MODEL, (-1e6, 1e6), "mHC b_res = c * I: the diagonal bias of H_res's logits "
        "(c=4: diagonal ~0.95 at init)")
    mhc_pre_bias: float = option(4.0, MODEL, (-1e6, 1e6), "mHC b_pre: +c on the stream read (--read-stream), -c "
        "elsewhere")
    read_stream: str = option("rotate", MODEL, ("rotate", "first"), "the stream each sublayer reads at init (HC's "
        "one-hot A_m, mHC's b_pre): stream k mod n for sublayer k, or stream 0 for all")
    coefficient_norm: str = option("stream", MODEL, ("stream", "flat"), "HC's coefficients from each stream's own "
        "LayerNorm, or from the streams divided by the RMS of the flattened state (mHC-style)")
    dynamic_init_std: float = option(0.0, MODEL, (0, 1e6), "std of the initial dynamic mixing weights (HC's W_m, W_r, "
        "W_b; mHC's phi): 0 starts them at zero (the study's: 0.02, its 0.01 re-drawn by its init)")
    mhc_tanh: bool = option(False, MODEL, None, "a tanh on mHC's projected logits z, before the gates and biases")
    collapse: str = option("sum", MODEL, ("sum", "first"), "the n streams to one after the last block: their sum, or "
        "stream 0")
    hc_dynamic: str = option("stream", MODEL, ("stream", "state"), "HC's dynamic weights: a width-C Linear of each "
        "stream (W_m | W_r | W_b, s_a shared by read and mix), or Linears of the whole flattened n*C state (read n, "
        "write n, mix n*n outputs), each tanh-scaled by its own scale (the study's)")
    hc_write_init: str = option("all", MODEL, ("all", "first"), "HC's static write B: ones (every stream), or "
        "stream 0 only (the study's)")
    mhc_post_bias: float = option(0.0, MODEL, (-1e6, 1e6), "mHC b_post: +c on the stream read (--read-stream), 0 "
        "elsewhere")
    mhc_bias_others: str = option("minus", MODEL, ("minus", "zero"), "mHC b_pre off the stream read: -c "
        "(--mhc-pre-bias) or 0 (the study's)")
    mixing_norm: str = option("plain", MODEL, ("plain", "scaled"), "the connections' norm of the streams: no weight, "
        "--norm-eps; or with a learnable scale per entry, eps 1e-8 (the study's RMSNorm)")
    sinkhorn_order: str = option("columns-first", MODEL, ("columns-first", "rows-first"), "Sinkhorn: the first pair "
        "in the log domain, columns then rows (rows exact); or exp, then rows then columns, each divided by its sum + "
        "1e-8 (columns exact; the study's)")
    mixing_precision: str = option("fp32", MODEL, ("fp32", "autocast"), "the coefficients and the stream mixing in "
        "fp32, or under the run's autocast (bf16 on CUDA; the study's)")
    mhc_norm_order: str = option("project-first", MODEL, ("project-first", "norm-first"), "mHC divides by the "
        "RMS of vec(x) after its projection phi (ours, as the kernels fuse it), or before it (the study's)")
    proj_init: str = option("scaled", MODEL, ("scaled", "flat"), "init std of the sublayers' output projections: "
        "0.02 / sqrt(2 depth) (GPT-2's), or 0.02 like every Linear (the study's)")
    vocab: str = option("padded", MODEL, ("padded", "exact"), "embedding rows: the tokenizer's vocabulary padded to "
        "a multiple of 64, or exact (gpt2: 50257, the study's)")
    norm_eps: float = option(1e-5, MODEL, (1e-45, 1e300), "epsilon of every LayerNorm")
    attn: str = option("auto", MODEL, ("auto", "flash", "sdpa"), "attention kernel: flash-attn 2, PyTorch SDPA, or "
        "auto (flash when installed on CUDA with bf16)")
    kernels: str = option("auto", MODEL, ("auto", "reference", "fused", "triton"), "the residual streams' code: "
        "the papers' formulas with autograd (reference), hcstudy/kernels/fused.py's hand-written backwards (fused), "
        "the Triton GPU kernels (triton; the interpreter on a CPU, for tests), or auto: on CUDA the path "
        "--check timed fastest, else triton once it passes a self-check; fused on the CPU (docs/benchmarks.md)")
    cross_entropy: str = option("auto", MODEL, ("auto", *cross_entropy.PATHS), "the loss: the logits and "
        "F.cross_entropy in fp32 (plain), or torch's chunked linear cross-entropy, without the (tokens x vocabulary) "
        "logits (fused); auto: the one --check timed faster on this GPU, else plain (docs/model.md)")
    dtype: str = option("auto", MODEL, ("auto", "bf16", "fp32"), "autocast dtype (auto: bf16 on CUDA, fp32 on CPU)")
    stream_dtype: str = option("fp32", MODEL, ("fp32", "bf16"), "dtype of the residual state stored between "
        "sublayers, every arm (the baseline's too); coefficients, mixing and gradients of parameters stay fp32")
    batch_size: int = option(32, OPTIMISATION, (1, 2 ** 16), "global sequences per optimizer step, whatever the "
        "number of processes")
    micro_batch_size: str = option("auto", OPTIMISATION, None, "sequences per device per forward ('auto' picks from "
        "memory)")
    steps: int = option(10_000, OPTIMISATION, COUNT, "optimizer steps")
    lr: float = option(1e-4, OPTIMISATION, (1e-12, 1e3), "peak learning rate")
    warmup: int = option(500, OPTIMISATION, NATURAL, "linear warm-up steps")
    warmup_from: str = option("one-step", OPTIMISATION, ("one-step", "zero"), "step 0's warm-up lr: one step's "
        "share, lr / warmup (lr reached at step warmup - 1), or 0 (lr * step / warmup, the study's)")
    min_lr_ratio: float = option(0.1, OPTIMISATION, (0, 1), "cosine decays to lr * this")
    weight_decay: float = option(0.1, OPTIMISATION, (0, 1e3), "AdamW weight decay (weight matrices only)")
    grad_clip: float = option(1.0, OPTIMISATION, (0, 1e300), "clip the global gradient norm to this (0 = off); the "
        "pre-clip norm is logged")
    no_mixing_decay: bool = option(False, OPTIMISATION, None, "no weight decay on the dynamic mixing weights (HC's "
        "W_m, W_r, W_b; mHC's phi), which are otherwise decayed like every weight matrix")
    weight_decay_on: str = option("matrices", OPTIMISATION, ("matrices", "all"), "weight decay on the weights of "
        "linears and embeddings, or on every parameter: norms, biases, scales and gates too (the study's)")
    seed: int = option(42, OPTIMISATION, NATURAL, "model initialisation seed")
    compile: bool = option(False, OPTIMISATION, None, "torch.compile the model (--compile-scope)")
    compile_scope: str = option("blocks", OPTIMISATION, ("blocks", "model"), "with --compile: each transformer block "
        "(one graph serves them all), or the whole model: embedding, blocks, final norm and loss")
    activation_checkpointing: bool = option(False, OPTIMISATION, None, "recompute each sublayer in the backward "
        "pass (on the formulas' path with its stream mixing)")
    data: str = option("c4", DATA, None, "'c4' (the hub), 'sample' (bundled Shakespeare) or a path/glob of C4-format "
        ".json/.json.gz files; files with 'validation' in their names are held out, never trained on")
    val_data: str = option("", DATA, None, "a path/glob of C4-format files for validation and the probe (never "
        "trained on); without it and without 'validation' files, a fixed slice of the training documents, chosen by a "
        "hash of their text, is held out instead (docs/data.md)")
    tokenizer: str = option("gpt2", DATA, ("gpt2", "byte"), "gpt2 BPE (shipped in data/) or UTF-8 bytes")
    doc_separator: str = option("eot", DATA, ("eot", "none"), "between documents, in training and held-out windows: "
        "the tokenizer's end-of-text token (byte 0 for bytes), or nothing (the study's)")
    data_seed: int = option(1234, DATA, NATURAL, "document-order seed, independent of --seed")
    data_streams: int = option(8, DATA, (1, 4096), "disjoint virtual data streams (sequence p of every global batch "
        "comes from stream p mod this); any number of processes that divides the global batch reads the same data")
    data_workers: int = option(1, DATA, (0, 4096), "loader processes per rank, each reading and tokenizing its share "
        "of the rank's streams (0: a background thread of the training process)")
    prefetch: int = option(4, DATA, (1, 1024), "micro-batches read ahead by the background loader thread (with "
        "--data-workers 0)")
    data_timeout: float = option(600.0, DATA, (10, 1e6), "seconds without a batch before the run stops with exit 6 "
        "instead of hanging")
    shuffle_buffer: int = option(1024, DATA, (0, 2 ** 20), "documents in the shuffle buffer")
    eval_every: int = option(500, MEASUREMENT, COUNT, "steps between validation losses")
    eval_batches: int = option(20, MEASUREMENT, COUNT, "micro-batches in the fixed validation set")
    metrics_every: int = option(50, MEASUREMENT, COUNT, "steps between instability probes")
    layer_metrics_every: int = option(500, MEASUREMENT, COUNT, "steps between per-layer gain lists")
    probe_sequences: int = option(8, MEASUREMENT, COUNT, "held-out sequences in the fixed probe batch")
    log_every: int = option(10, MEASUREMENT, COUNT, "steps between plain log lines")
    wandb: str = option("auto", MEASUREMENT, WANDB_MODES, "Weights & Biases mode; beats "
        "$WANDB_MODE (auto: $WANDB_MODE when set, else online with credentials, offline without)")
    wandb_project: str = option("", MEASUREMENT, None, "W&B project (default: $WANDB_PROJECT, else hc-mhc-c4)")
    out: str = option("runs", RUN_FOLDER, None, "folder holding the run folders")
    run_name: str = option("", RUN_FOLDER, None, "run folder name (default {residual}_d{depth}_s{seed})")
    resume: str = option("auto", RUN_FOLDER, ("auto", "never"), "auto: continue from the newest complete checkpoint; "
        "never: start over, an earlier run's files moved to RUN/previous-N/")
    allow_changed_settings: bool = option(False, RUN_FOLDER, None, "resume a run folder although its training "
        "settings (lr, steps, batch, schedule, seed, data) differ from this command's; the change is recorded in the "
        "run folder (settings_changes.jsonl)")
    ckpt_every: int = option(1000, RUN_FOLDER, COUNT, "steps between checkpoints")
    keep_checkpoints: int = option(2, RUN_FOLDER, COUNT, "complete checkpoints kept (newest)")
    parallel: str = option("ddp", PARALLELISM, ("ddp", "fsdp"), "strategy under torchrun")
    estimate: bool = option(False, PLANNING, None, "print the model size, the memory plan per GPU and the time per "
        "step, and stop (train nothing)")
    estimate_world_size: int = option(0, PLANNING, (0, 2 ** 20), "processes the --estimate plan is for (0: "
        "$WORLD_SIZE, else 1); with --parallel fsdp the parameters, gradients and optimizer states are sharded over "
        "them")
    gpu_memory_gb: float = option(0.0, PLANNING, (0, 1e6), "GiB of one GPU for --estimate and --micro-batch-size auto "
        "(0: the CUDA device's own, else 80)")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


CHOICES = flags.choices(Config)


def build_parser():
    epilog = (flags.presets_text(PRESETS) + "\n\npython train_c4.py --consolidate CHECKPOINT OUT.pt writes one file "
              "with the weights of a checkpoint\n(FSDP's sharded ones included), loadable without a process group.")
    return flags.build_parser(Config, "Train baseline / HC / mHC transformers on C4.", epilog)


def parse_config(argv: list[str] | None = None) -> Config:
    """Defaults, then the presets in order, then explicit flags; every check that can fail before a run starts.
    The run's name comes from its settings, however they were asked for (contract.run_name)."""
    explicit = vars(build_parser().parse_args(argv))
    names = flags.preset_names(explicit.pop("preset", ["c4"]), PRESETS)
    composed = Config(**flags.compose_presets(names, PRESETS, {"shuffle_buffer": "data"}), preset=",".join(names))
    try:                # what the presets alone make impossible is theirs to answer for, not the flags'
        validate(composed)
        micro = composed.micro_batch_size
        memory.check_batch_split(composed, 1, None if micro == "auto" else int(micro))
    except (ConfigError, memory.PlanError) as error:
        raise ConfigError(f"--preset {composed.preset} cannot compose: {error}") from None
    cfg = dataclasses.replace(composed, **explicit)
    flags.refuse_unused(explicit, cfg.residual, contract.ARMS_OF)
    validate(cfg)
    if not cfg.run_name:
        cfg = dataclasses.replace(cfg, run_name=contract.run_name(cfg.residual, cfg.depth, cfg.seed, cfg.preset,
                                                                  cfg.sinkhorn_iters, cfg.coefficients,
                                                                  dataclasses.asdict(cfg)))
    return cfg


def validate(cfg: Config) -> None:
    """Refuses, in one line, what cannot run or would be nonsense; nothing is built or read here."""
    flags.check_bounds(cfg)
    if cfg.residual == "mhc-lite" and cfg.mhc_res_diag < 0:
        raise ConfigError(f"--residual mhc-lite matches mHC's H_res diagonal at init only for --mhc-res-diag >= 0, "
                          f"got {cfg.mhc_res_diag:g}")
    if cfg.residual == "mhc-lite" and cfg.expansion > MHC_LITE_MAX_EXPANSION:
        raise ConfigError(f"--residual mhc-lite mixes all n! permutations: --expansion {cfg.expansion} would need "
                          f"{math.factorial(cfg.expansion):,} logits per token; use at most {MHC_LITE_MAX_EXPANSION}")
    if cfg.kernels in ("fused", "triton") and cfg.residual != "baseline" and choice.study_variants(cfg):
        raise ConfigError(f"--kernels {cfg.kernels} has the papers' HC and mHC only, not the study's "
                          f"--{choice.study_variants(cfg)[0].replace('_', '-')}; use --kernels auto or reference")
    if cfg.compile_scope != "blocks" and not cfg.compile:
        raise ConfigError(f"--compile-scope {cfg.compile_scope} says what --compile compiles: add --compile")
    if cfg.width % cfg.heads:
        raise ConfigError(f"--width {cfg.width} is not divisible by --heads {cfg.heads}")
    micro = cfg.micro_batch_size
    if micro != "auto" and not (re.fullmatch("[0-9]+", micro) and int(micro)):
        raise ConfigError(f"--micro-batch-size must be a positive integer or 'auto', got {cfg.micro_batch_size!r}")
    if cfg.probe_sequences > cfg.eval_batches * cfg.batch_size:
        raise ConfigError(f"--probe-sequences {cfg.probe_sequences} exceeds the {cfg.eval_batches * cfg.batch_size} "
                          "held-out sequences it is drawn from (--eval-batches x --batch-size)")
    if not cfg.out.strip():
        raise ConfigError("--out must name a folder (default runs)")
    # a run's name becomes a folder and a row of the report's table
    if cfg.run_name and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,99}", cfg.run_name):
        raise ConfigError(f"--run-name {cfg.run_name[:100]!r} must be 1 to 100 letters, digits or _.+=- "
                          "(not starting with . or -)")


def odd_settings(cfg: Config) -> list[str]:
    """What runs but seldom means what was meant: a warning in the run's log, not a refusal."""
    return [line for odd, line in [
        (cfg.warmup > cfg.steps, f"--warmup {cfg.warmup} exceeds --steps {cfg.steps}: the lr never reaches --lr"),
        (cfg.data_streams > cfg.batch_size, f"--data-streams {cfg.data_streams} exceeds --batch-size "
         f"{cfg.batch_size}: streams {cfg.batch_size} to {cfg.data_streams - 1} are never read")] if odd]


def padded_vocab_size(tokenizer: str, exact: bool = False) -> int:
    # GPT-2's 50257 padded to a multiple of 64: the embedding matmuls run on aligned shapes
    return 256 if tokenizer == "byte" else 50257 if exact else 50304


def embedding_rows(cfg: Config) -> int:
    return padded_vocab_size(cfg.tokenizer, cfg.vocab == "exact")


# ----------------------------------------------------------------------------------------------
# model: GPT-2 body with a switchable residual path (plain, HC, mHC, mHC-lite, identity-HC) acting on n persistent
# streams; each is its paper's formulas with autograd (docs/model.md), fused.py HC and mHC with hand-written backwards

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
    """LayerNorm in its input's dtype: FSDP gathers its weights in bf16, CPU's autocast does not cast them."""

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(u, self.normalized_shape, self.weight.to(u.dtype), self.bias.to(u.dtype), self.eps)


class PreNorm(nn.Sequential):
    """F(norm(u)): the block's own pre-norm sublayer, identical for all three residual paths."""

    def __init__(self, cfg: Config, inner: nn.Module):
        super().__init__()
        self.norm, self.inner = StreamNorm(cfg.width, eps=cfg.norm_eps), inner        # applied in this order


def mixing_autocast(x: torch.Tensor, autocast: bool = False):
    """Autocast off, so that the streams are mixed in fp32 and never rounded to bf16; or, for the study's
    --mixing-precision autocast, left as the run set it."""
    return contextlib.nullcontext() if autocast else torch.autocast(x.device.type, enabled=False)


def stream_update(x, H_pre, H_post, H_res, sublayer, autocast: bool = False):
    """x_next = H_res x + H_post^T F(norm(H_pre x)) per token, x (..., n, C), H_pre and H_post (..., n), H_res
    (..., n, n); sublayer is F(norm(.)). x is the state widened (fp32, or fp64): u and the mixing in its dtype,
    the caller rounds the result once to --stream-dtype."""
    with mixing_autocast(x, autocast):
        u = torch.einsum("...j,...jc->...c", H_pre, x)
    y = sublayer(u).to(x.dtype)
    with mixing_autocast(x, autocast):
        return H_res @ x + H_post.unsqueeze(-1) * y.unsqueeze(-2)


def sinkhorn(logits: torch.Tensor, iters: int, rows_first: bool = False) -> torch.Tensor:
    """exp(logits) made doubly stochastic by `iters` column-then-row normalisations, in fp32 or wider; rows_first:
    the study's, row-then-column on the linear scale with 1e-8 added to every sum."""
    P = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if rows_first:
        P = P.exp()
        for _ in range(iters):
            P = P / (P.sum(-1, keepdim=True) + 1e-8)
            P = P / (P.sum(-2, keepdim=True) + 1e-8)
        return P
    # the first pair in the log domain: the same maths, but it cannot overflow or leave a zero sum (docs/model.md)
    P = P - P.logsumexp(-2, keepdim=True)
    return balance((P - P.logsumexp(-1, keepdim=True)).exp(), iters - 1)


def balance(P: torch.Tensor, iters: int) -> torch.Tensor:
    """`iters` Sinkhorn pairs on the linear scale: divide by the column sums, then by the row sums."""
    for _ in range(iters):
        P = P / P.sum(-2, keepdim=True)
        P = P / P.sum(-1, keepdim=True)
    return P


class PlainResidual(nn.Module):
    """Baseline: x + F(norm(x)) on one stream; its mixing record (H_res, logits or None for HC) is None: gain 1.
    u and the add in fp32 (or wider) as for the streams, the sum rounded once to the state's dtype."""

    def forward(self, x, sublayer):
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        # the add promotes a bf16 sublayer output itself: no cast kernel of its own, the same sum
        return (wide + sublayer(wide.squeeze(-2)).unsqueeze(-2)).to(x.dtype), None


def read_stream(cfg: Config, sublayer_index: int) -> torch.Tensor:
    """The stream sublayer k reads at init, one-hot: k mod n (every stream in turn), or 0 (the public study's)."""
    return F.one_hot(torch.tensor(sublayer_index % cfg.expansion if cfg.read_stream == "rotate" else 0), cfg.expansion)


class _StreamMixing(nn.Module):
    """HC and mHC's family: coefficients (the subclass's), then the stream update; the kernels' path's (fused.py,
    triton_ops.py) where `kernels` names one."""

    def __init__(self, cfg: Config, kernels: str):
        super().__init__()
        self.n, self.width, self.kernels = cfg.expansion, cfg.width, kernels
        self.per_sequence, self.autocast = cfg.coefficients == "sequence", cfg.mixing_precision == "autocast"
        # the study's RMSNorm of the streams: a learnable scale per entry of the n x C state, eps 1e-8
        self.eps = 1e-8 if cfg.mixing_norm == "scaled" else cfg.norm_eps
        self.norm_scale = nn.Parameter(torch.ones(self.n, self.width)) if cfg.mixing_norm == "scaled" else None

    def scaled(self, x_normed: torch.Tensor) -> torch.Tensor:
        return x_normed if self.norm_scale is None else x_normed * self.norm_scale.to(x_normed.dtype)

    def forward(self, x, sublayer):
        if self.kernels == "fused":     # fused.py: the coefficients stream axes first, x passed through their maths
            x, H_pre, H_post, H_res, res_logits = self.fused_coefficients(x)
            x, H_res = fused.stream_update(x, H_pre, H_post, H_res, sublayer), H_res.detach().movedim((0, 1), (-2, -1))
        elif self.kernels == "triton":  # triton_ops.py: coefficients and read, then write, a few kernels each
            kernels = choice.triton_kernels()
            u, H_post, H_res, res_logits, x = getattr(kernels, self.triton_read)(self, x)
            x = kernels.write(x, H_res, H_post, sublayer(u))
        else:
            # a bf16 state widened once (exact), the one fp32 copy the coefficients and the update share: autograd
            # saves it once per connection, as it saves an fp32 state itself (docs/model.md, "Precision")
            wide = x.to(torch.promote_types(x.dtype, torch.float32))
            # per sequence: one set from the streams averaged over the positions (B, 1, n, C), broadcast to every
            # position; a later token then changes an earlier position's output (not causal, docs/model.md)
            H_pre, H_post, H_res, res_logits = self.coefficients(
                wide.mean(-3, keepdim=True) if self.per_sequence else wide)
            x = stream_update(wide, H_pre, H_post, H_res, sublayer, self.autocast).to(x.dtype)
        return x, (H_res.detach(), None if res_logits is None else res_logits.detach())     # the probe's, detached


class HyperConnection(_StreamMixing):
    """Dynamic HC (arXiv 2409.19606): per-stream read, mix and write weights, tanh-scaled around static ones."""
    fused_coefficients, triton_read = fused.hc_coefficients, "hc_read"

    def __init__(self, cfg: Config, sublayer_index: int, kernels: str = "reference"):
        super().__init__(cfg, kernels)
        n, self.flat_norm, self.of_state = self.n, cfg.coefficient_norm == "flat", cfg.hc_dynamic == "state"
        # the HC paper's W_m | W_r (n columns) | W_b of each stream; the study's read | write | mix of the whole state
        self.dynamic = nn.Linear(n * cfg.width, 2 * n + n * n, bias=False) if self.of_state else nn.Linear(
            cfg.width, n + 2, bias=False)
        if self.of_state:               # the study's mix has a scale of its own
            self.s_r = nn.Parameter(torch.tensor(cfg.hc_scale_init))
        # the HC paper's init, under which HC computes exactly a pre-norm transformer
        nn.init.zeros_(self.dynamic.weight)
        self.A_m_static = nn.Parameter(read_stream(cfg, sublayer_index).float())
        self.A_r_static = nn.Parameter(torch.eye(n))
        self.B_static = nn.Parameter(torch.ones(n) if cfg.hc_write_init == "all" else torch.eye(n)[0])
        self.s_a, self.s_b = (nn.Parameter(torch.tensor(cfg.hc_scale_init)) for _ in range(2))

    def coefficients(self, x):
        """H_pre, H_post (..., n), H_res (..., n, n) and no logits, for the streams x (..., n, C)."""
        n, dtype = self.n, torch.promote_types(x.dtype, torch.float32)
        with mixing_autocast(x, self.autocast):                       # the coefficients in fp32 (or fp64)
            x = x.to(dtype)
            if self.flat_norm:          # the public study's: every stream divided by one RMS of the whole state
                xb = self.scaled(x * torch.rsqrt(x.square().mean((-2, -1), keepdim=True) + self.eps))
            else:                       # the paper's: each stream's own norm, no affine
                xb = self.scaled(F.layer_norm(x, x.shape[-1:], eps=self.eps))
            if self.of_state:           # (..., 2n + n^2); its mixing block is H_res itself, as it acts on x
                d = torch.tanh(F.linear(xb.flatten(-2), self.dynamic.weight.to(dtype)))
                return (self.s_a * d[..., :n] + self.A_m_static, self.s_b * d[..., n:2 * n] + self.B_static,
                        self.s_r * d[..., 2 * n:].unflatten(-1, (n, n)) + self.A_r_static, None)
            d = torch.tanh(F.linear(xb, self.dynamic.weight.to(dtype)))         # (..., n, n + 2)
            A_m = self.s_a * d[..., 0] + self.A_m_static
            A_r = self.s_a * d[..., 1:n + 1] + self.A_r_static
            B = self.s_b * d[..., n + 1] + self.B_static
        # row i of A_r says where stream i goes: the matrix that acts on x is its transpose
        return A_m, B, A_r.transpose(-1, -2), None


class ManifoldHyperConnection(_StreamMixing):
    """mHC (arXiv 2512.24880): coefficients from the whole flattened state, H_res doubly stochastic. Its family
    (mHC-lite, identity-HC) shares the read and write and differs in `mixing` and H_res's logits."""
    fused_coefficients, triton_read, arm = fused.mhc_coefficients, "mhc_read", "mhc"

    @staticmethod
    def res_logit_count(n: int) -> int:
        return n * n

    def __init__(self, cfg: Config, sublayer_index: int, kernels: str = "reference"):
        super().__init__(cfg, kernels)
        n, mixes = self.n, self.res_logit_count(self.n) > 0
        self.iters, self.tanh, self.rows_first = cfg.sinkhorn_iters, cfg.mhc_tanh, cfg.sinkhorn_order == "rows-first"
        self.norm_first = cfg.mhc_norm_order == "norm-first"     # the study's: bf16 autocast keeps z, tanh(z), a z bf16
        self.phi = nn.Linear(n * cfg.width, 2 * n + self.res_logit_count(n), bias=False)    # [z_pre | z_post | z_res]
        nn.init.zeros_(self.phi.weight)
        self.a_pre, self.a_post = (nn.Parameter(torch.tensor(cfg.mhc_gate_init)) for _ in range(2))
        if mixes:
            self.a_res = nn.Parameter(torch.tensor(cfg.mhc_gate_init))
        # the paper gives no bias init (docs/model.md): read mostly one stream, write 1, H_res near I
        read = read_stream(cfg, sublayer_index)
        self.b_pre = nn.Parameter(torch.where(read.bool(), cfg.mhc_pre_bias,
                                              -cfg.mhc_pre_bias if cfg.mhc_bias_others == "minus" else 0.0))
        self.b_post = nn.Parameter(cfg.mhc_post_bias * read.float())
        if mixes:
            self.b_res = nn.Parameter(self.res_bias(cfg))

    def res_bias(self, cfg: Config) -> torch.Tensor:
        return cfg.mhc_res_diag * torch.eye(cfg.expansion)

    def coefficients(self, x):
        """H_pre, H_post (..., n), H_res (..., n, n) and the logits projected, for the streams x (..., n, C)."""
        n, dtype = self.n, torch.promote_types(x.dtype, torch.float32)
        with mixing_autocast(x, self.autocast):
            v = x.flatten(-2).to(dtype)                                          # vec(x), nC per token
            r = torch.rsqrt(v.square().mean(-1, keepdim=True) + self.eps)
            z = F.linear(self.scaled((v * r if self.norm_first else v).unflatten(-1, (n, -1))).flatten(-2),
                         self.phi.weight.to(dtype)) * (1 if self.norm_first else r)
            if self.tanh:               # the public study's: bounded logits before the gates and biases
                z = torch.tanh(z)
            z_pre, z_post, z_res = z.split([n, n, z.shape[-1] - 2 * n], dim=-1)
            H_pre = torch.sigmoid(self.a_pre * z_pre + self.b_pre)
            H_post = 2 * torch.sigmoid(self.a_post * z_post + self.b_post)
            return H_pre, H_post, *self.mixing(z_res)

    def mixing(self, z_res):
        """H_res (..., n, n) and the logits Sinkhorn projected (the probe measures their truncation)."""
        res_logits = self.a_res * z_res.unflatten(-1, (self.n, self.n)) + self.b_res
        return sinkhorn(res_logits, self.iters, self.rows_first), res_logits


def permutation_matrices(n: int) -> torch.Tensor:
    """The n! permutation matrices (n!, n, n), the identity first: P_k[i, j] = 1 where row i takes stream j."""
    return F.one_hot(torch.tensor(list(itertools.permutations(range(n)))), n).float()


def identity_logit(res_diag: float, n: int) -> float:
    """mHC-lite's logit on the identity (all others 0) whose H_res diagonal equals mHC's at b_res = c I: solve
    (e^b + (n-1)! - 1) / (e^b + n! - 1) = e^c / (e^c + n - 1), i.e. e^b = (n-1)! e^c - (n-1)! + 1 (docs/model.md)."""
    m = math.factorial(n - 1)
    return res_diag + math.log(m - (m - 1) * math.exp(-res_diag))      # written so that a large c cannot overflow


class MHCLite(ManifoldHyperConnection):
    """mHC-lite (arXiv 2601.05732): H_res = sum_k w_k P_k over the n! permutation matrices, w a softmax of per-token
    logits: exactly doubly stochastic, no iterations."""
    res_logit_count, arm = staticmethod(math.factorial), "mhc-lite"

    def __init__(self, cfg: Config, sublayer_index: int, kernels: str = "reference"):
        super().__init__(cfg, sublayer_index, kernels)
        self.register_buffer("permutations", permutation_matrices(self.n), persistent=False)     # rebuilt from n

    def res_bias(self, cfg: Config) -> torch.Tensor:
        return F.one_hot(torch.tensor(0), math.factorial(cfg.expansion)) * identity_logit(cfg.mhc_res_diag,
                                                                                           cfg.expansion)

    def mixing(self, z_res):
        # the softmax in fp32 or wider: w >= 0 summing to 1, so every row and column of H_res sums to 1 up to rounding
        w = torch.softmax(self.a_res * z_res + self.b_res, dim=-1)
        return torch.einsum("...k,kij->...ij", w, self.permutations.to(w.dtype)), None


class IdentityHC(ManifoldHyperConnection):
    """Identity-HC: mHC's H_pre and H_post, H_res = I fixed (no mixing): is the mixing needed at all?"""
    arm = "identity-hc"

    @staticmethod
    def res_logit_count(n: int) -> int:
        return 0

    def mixing(self, z_res):
        return torch.eye(self.n, dtype=z_res.dtype, device=z_res.device).expand(*z_res.shape[:-1], self.n, self.n), None


STREAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONNECTIONS = {"baseline": lambda *_: PlainResidual(), "hc": HyperConnection, "mhc": ManifoldHyperConnection,
               "mhc-lite": MHCLite, "identity-hc": IdentityHC}


def kernel_path(cfg: Config, device: torch.device) -> tuple[str, str]:
    """The streams' path a run takes on `device` and why (choice.kernel_path; a self-check builds one connection)."""
    return choice.kernel_path(cfg, device, functools.partial(CONNECTIONS[cfg.residual], cfg, 1))


class Block(nn.Module):
    """Maps the residual state (B, T, n, C) to (B, T, n, C): the streams persist across blocks."""

    def __init__(self, cfg: Config, index: int, use_flash: bool, kernels: str = "reference"):
        super().__init__()
        self.attn = PreNorm(cfg, CausalSelfAttention(cfg, use_flash))
        self.mlp = PreNorm(cfg, MLP(cfg))
        connection = CONNECTIONS[cfg.residual]
        self.attn_conn = connection(cfg, 2 * index, kernels)
        self.mlp_conn = connection(cfg, 2 * index + 1, kernels)
        # what checkpointing recomputes: what would cost n x C per token to keep. The formulas' autograd keeps the
        # normalised state (and a bf16 state's fp32 copy), so their connection is recomputed with its sublayer; the
        # kernels' connections (fused, triton) keep the state itself and per-token coefficients, so they run once
        # and only the sublayer is recomputed, keeping u and y instead (docs/model.md, "Activation checkpointing")
        streams_path = getattr(self.attn_conn, "kernels", "reference")
        self.checkpointed = cfg.activation_checkpointing and ("connection" if streams_path == "reference" else "sublayer")

    def forward(self, x, return_mixing: bool = False, with_states: bool = False):
        # returned, not appended to a caller's list: torch.compile would guard on its length, a graph per block
        mixing, states = [], []
        for conn, sublayer in ((self.attn_conn, self.attn), (self.mlp_conn, self.mlp)):
            if with_states:             # the probe's: what each connection reads, as n x n per token, not n x C
                states.append(stream_gram(x))
            if self.checkpointed == "connection" and torch.is_grad_enabled():
                x, record = checkpoint(conn, x, sublayer, use_reentrant=False)
            else:
                recomputed = self.checkpointed and torch.is_grad_enabled()
                x, record = conn(x, functools.partial(checkpoint, sublayer, use_reentrant=False) if recomputed
                                 else sublayer)
            mixing.append(record)
        return (x, mixing, states) if return_mixing else x


class GPT(nn.Module):
    """kernels: the streams' path, where it has the arm (choice.supports; choice.kernel_path decides it for a run);
    loss: the cross-entropy's (cross_entropy.choose decides it)."""

    def __init__(self, cfg: Config, use_flash: bool = False, kernels: str = "reference", loss: str = "plain"):
        super().__init__()
        self.fused_loss = loss == "fused"
        self.streams = 1 if cfg.residual == "baseline" else cfg.expansion
        self.stream_dtype = STREAM_DTYPES[cfg.stream_dtype]
        self.kernels = kernels if choice.supports(cfg, kernels) else "reference"
        self.collapse_first = cfg.collapse == "first"
        self.wte = nn.Embedding(embedding_rows(cfg), cfg.width)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg, i, use_flash, self.kernels) for i in range(cfg.depth))
        self.ln_f = StreamNorm(cfg.width, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.width, self.wte.num_embeddings, bias=False)
        self.lm_head.weight = self.wte.weight
        # GPT-2: residual output projections scaled by 1/sqrt(number of residual additions); the study's: not
        self._init_weights(0.02 / math.sqrt(2 * cfg.depth) if cfg.proj_init == "scaled" else 0.02, cfg.dynamic_init_std)

    @torch.no_grad()
    def _init_weights(self, proj_std: float, dynamic_init_std: float):
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = proj_std if name.endswith("inner.proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                # the dynamic mixing weights start at 0 or rescaled to dynamic_init_std: drawn all the same, so that
                # a seed gives the body the weights it always gave
                if "_conn." in name and dynamic_init_std:
                    module.weight.mul_(dynamic_init_std / std)
                elif "_conn." in name:
                    module.weight.zero_()

    def forward(self, idx, targets=None, mixing_out: list | None = None, states_out: list | None = None):
        # the state in --stream-dtype in every mode (precision_policy): under FSDP the embeddings are bf16
        h = (self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))).to(self.stream_dtype)
        # expand once, the embedding copied into every stream, in the layout the blocks return (torch.compile
        # specialises on strides): hcstudy/kernels/fused.py's is stream-major
        fused_streams = self.kernels == "fused" and self.streams > 1
        x = fused.expand(h, self.streams) if fused_streams else h.unsqueeze(-2).repeat(1, 1, self.streams, 1)
        for block in self.blocks:
            if mixing_out is None:
                x = block(x)
            else:
                x, mixing, states = block(x, return_mixing=True, with_states=states_out is not None)
                mixing_out.extend(mixing)
                states_out is None or states_out.extend(states)
        if x.requires_grad and fused_streams:
            x.register_hook(fused.stream_major)          # the collapse's gradient comes as one stride-0 view
        x = x.float()                                   # the collapse and the final norm in fp32, as for u
        x = self.ln_f(x[..., 0, :] if self.collapse_first else x.sum(dim=-2))    # collapse once
        if targets is not None and self.fused_loss:    # the loss without the logits; the probe's forward keeps them
            return None, cross_entropy.fused_cross_entropy(x, self.lm_head.weight, targets)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def decay_groups(model: nn.Module, weight_decay: float, decay_mixing: bool = True, everything: bool = False
                 ) -> list[dict]:
    """Weight decay on the weights of linears and embeddings only; the connections' (dynamic mixing) if decay_mixing;
    everything: on every parameter (the study's AdamW(model.parameters()))."""
    decay = {id(p): p for p in model.parameters()} if everything else {
        id(m.weight): m.weight for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) and (decay_mixing or "_conn." not in name)}
    rest = [p for p in model.parameters() if id(p) not in decay]
    return [{"params": list(decay.values()), "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.AdamW:
    # fused: the for-loop AdamW PyTorch picks on the CPU runs ~10 small ops per parameter tensor (benchmarks.md)
    groups = decay_groups(model, cfg.weight_decay, not cfg.no_mixing_decay, cfg.weight_decay_on == "all")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True)


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

def row_gain(M):                    # g_fwd: the largest absolute row sum
    return M.sum(dim=-1).abs().amax(dim=-1)


def col_gain(M):                    # g_bwd: the largest absolute column sum
    return M.sum(dim=-2).abs().amax(dim=-1)


def composites(H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix products P_k = H_k ... H_1 and suffix products S_k = H_L ... H_k of H (L, tokens, n, n)."""
    prefix, suffix = [H[0]], [H[-1]]
    for k in range(1, H.shape[0]):
        prefix.append(H[k] @ prefix[-1])
        suffix.append(suffix[-1] @ H[-1 - k])
    return torch.stack(prefix), torch.stack(suffix[::-1])


def study_gains(H: torch.Tensor) -> torch.Tensor:
    """The public 1.7B study's reading, one value per k: H averaged over the tokens, multiplied as H_1 ... H_k, the
    larger of the largest absolute row and column sums (docs/model.md)."""
    products = list(itertools.accumulate(H.mean(dim=1), torch.matmul))
    return torch.stack([torch.maximum(Q.abs().sum(-1).amax(), Q.abs().sum(-2).amax()) for Q in products])


def batch_mean_mixing(records: list, device: torch.device) -> torch.Tensor:
    """(L, n, n): each sublayer's H_res as a forward recorded it, averaged over its tokens (the plain residual: 1)."""
    if records[0] is None:
        return torch.ones(len(records), 1, 1, device=device)
    return torch.stack([H.float().reshape(-1, *H.shape[-2:]).mean(0) for H, _ in records])


def gain_metrics(H: torch.Tensor) -> dict:
    """Every probe metric of H (L sublayers, tokens, n, n): per-token gains averaged, then the max (min) over L."""
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


def stochastic_errors(H: torch.Tensor) -> torch.Tensor:
    """(2, L): max |row sum - 1| and max |column sum - 1| over the tokens of each sublayer's H (L, tokens, n, n)."""
    return torch.stack([(H.sum(-1) - 1).abs().amax((1, 2)), (H.sum(-2) - 1).abs().amax((1, 2))])


@torch.no_grad()
def sinkhorn_converged(logits: torch.Tensor, tol: float = 1e-6, max_iters: int = 20_000) -> tuple[torch.Tensor, int]:
    """The logits projected in fp64 until every row and column sum is within `tol` of 1, and the iterations that
    took; each round of 20 only on the matrices still off (a few need thousands, most tens: docs/model.md)."""
    n = logits.shape[-1]
    # stored (n, n, matrices): each sum over a matrix axis adds n contiguous rows of matrices
    stored = logits.double().reshape(-1, n, n).movedim(0, -1).contiguous()
    matrices, done = sinkhorn(stored.movedim(-1, 0), 1).movedim(0, -1), 1
    todo = torch.arange(matrices.shape[-1], device=logits.device)
    while done < max_iters:
        off = matrices[..., todo]
        todo = todo[torch.maximum((off.sum(1) - 1).abs().amax(0), (off.sum(0) - 1).abs().amax(0)) > tol]
        if not len(todo):
            break
        matrices[..., todo] = balance(matrices[..., todo].movedim(-1, 0), 20).movedim(0, -1)
        done += 20
    return matrices.movedim(-1, 0).reshape(logits.shape), done


def projection_metrics(H: torch.Tensor, logits: torch.Tensor) -> dict:
    """mHC: the truncation error of the H_res used, and the gains of its logits projected to convergence."""
    converged, iters = sinkhorn_converged(logits)
    exact = gain_metrics(converged)
    layer_row, layer_col = stochastic_errors(H.double()).tolist()
    # non-negative H with column sums within e_k of 1: no suffix product's column sum exceeds prod(1 + e_k)
    bound = math.prod(1 + e for e in layer_col)
    return {"sinkhorn_row_err": max(layer_row), "sinkhorn_col_err": max(layer_col), "layer_sinkhorn_row_err": layer_row,
            "layer_sinkhorn_col_err": layer_col, "sinkhorn_bwd_bound": bound, "amax_fwd_converged": exact["amax_fwd"],
            "amax_bwd_converged": exact["amax_bwd"], "amax_study_converged": exact["amax_study"],
            "sinkhorn_converged_iters": iters, "sinkhorn_converged_err": stochastic_errors(converged).max().item()}


def stream_gram(x: torch.Tensor) -> torch.Tensor:
    """x x^T (B, T, n, n) of the streams x (B, T, n, C), in fp64 a sequence at a time: its eigenvalues are squared
    singular values, so fp32 would put a near-rank-one state's small ones at sqrt(eps), 3e-4 of the largest; a copy
    of the whole state in fp64 would be 0.7 GB a connection at the study's sizes."""
    grams = []
    with mixing_autocast(x):
        for sequence in x.split(1):
            sequence = sequence.double()
            grams.append(sequence @ sequence.transpose(-1, -2))
    return torch.cat(grams)


def spread(p: torch.Tensor) -> torch.Tensor:
    """exp of the entropy of the distributions p (..., n): how many of their n entries count, from 1 to n."""
    return torch.special.entr(p).sum(-1).exp()


def state_metrics(G: torch.Tensor) -> torch.Tensor:
    """(3, L) from the Gram matrices G (L, tokens, n, n) of the states at each connection's input, token means of:
    the largest stream's share of the energy, the effective number of streams, the effective rank (docs/model.md)."""
    energy = G.diagonal(dim1=-2, dim2=-1)
    shares = energy / energy.sum(-1, keepdim=True).clamp_min(torch.finfo(G.dtype).tiny)
    singular = torch.linalg.eigvalsh(G).clamp_min(0).sqrt()
    weights = singular / singular.sum(-1, keepdim=True).clamp_min(torch.finfo(G.dtype).tiny)
    return torch.stack([shares.amax(-1), spread(shares), spread(weights)]).mean(-1)


def permutation_distance(M: torch.Tensor) -> torch.Tensor:
    """sum |M - P| (...) for the permutation P nearest to each M (..., n, n): sum |M| plus, over P's n entries,
    |M_ij - 1| - |M_ij|; linear in P, so one matmul scores all n! of them."""
    gain = ((M - 1).abs() - M.abs()).flatten(-2) @ permutation_matrices(M.shape[-1]).to(M).flatten(1).T
    return M.abs().sum((-2, -1)) + gain.amin(-1)


def stream_metrics(G: torch.Tensor, H: torch.Tensor) -> dict:
    """What the streams carry (G: their Gram matrices) and how far H_res (L, tokens, n, n) and its full-depth
    product sit from I, J/n and a permutation: per token, then averaged (docs/model.md); n >= 2."""
    n, H = H.shape[-1], H.double()
    unit = 2 * (n - 1)          # sum |P - J/n| for every permutation P: J/n and a permutation are 1 apart
    composite = composites(H)[0][-1]            # H_L ... H_1, scaled as a doubly stochastic matrix is: its shape
    composite = composite * n / composite.abs().sum((-2, -1), keepdim=True).clamp_min(torch.finfo(H.dtype).tiny)
    dominance, streams, rank = state_metrics(G)
    to_identity = (H - torch.eye(n, dtype=H.dtype, device=H.device)).abs().sum((-2, -1)).mean(-1) / unit
    # over depth, the connections after the first: its input is the embedding copied n times, rank 1 by construction
    learned = [reading[1:] for reading in (dominance, streams, rank)]
    values = [learned[0].max(), learned[0].mean(), learned[1].mean(), learned[1].min(), learned[2].mean(),
              learned[2].min(), to_identity.max(), to_identity.mean(),
              (composite - 1 / n).abs().sum((-2, -1)).mean() / unit]
    if n <= MHC_LITE_MAX_EXPANSION:     # beyond, n! permutations are too many to score per token
        values.append(permutation_distance(composite).mean() / unit)
    layers = torch.cat([torch.stack(values), dominance, streams, rank, to_identity]).tolist()
    return dict(zip(STREAM_KEYS, layers[:len(values)])) | {
        key: layers[len(values) + i * len(H):len(values) + (i + 1) * len(H)] for i, key in enumerate(STREAM_LAYER_KEYS)}


LAYER_KEYS = ("layer_gain_fwd", "layer_gain_bwd", "layer_sinkhorn_row_err", "layer_sinkhorn_col_err",
              *STREAM_LAYER_KEYS)


@torch.no_grad()
def instability_probe(model: nn.Module, probe_idx: torch.Tensor, autocast_ctx, with_layers: bool) -> dict:
    """Run the fixed probe batch and measure the gains. No RNG, no autograd state; the mode is restored."""
    was_training, mixing, states = model.training, [], []
    model.eval()
    try:
        with autocast_ctx():
            model(probe_idx, mixing_out=mixing, states_out=states)
    finally:
        model.train(was_training)
    if mixing[0] is None:                          # the plain residual: H_res = 1 by definition
        metrics = gain_metrics(torch.ones(len(mixing), 1, 1, 1))
    else:
        n = mixing[0][0].shape[-1]
        H = torch.stack([h.float().reshape(-1, n, n) for h, _ in mixing])
        metrics = gain_metrics(H)
        if n > 1:
            metrics |= stream_metrics(torch.stack([g.reshape(-1, n, n) for g in states]), H)
        if mixing[0][1] is not None:
            metrics |= projection_metrics(H, torch.stack([z.float().reshape(-1, n, n) for _, z in mixing]))
    if not with_layers:
        metrics = {key: value for key, value in metrics.items() if key not in LAYER_KEYS}
    return metrics


# ----------------------------------------------------------------------------------------------
# data: tokenizers, C4 (hub or local shards) and the bundled sample, streamed and exactly resumable (read ahead in
# processes or a thread: hcstudy/readahead.py)

DATA_DIR = ROOT / "data"
# tiktoken's published sha256 of OpenAI's GPT-2 files (tiktoken_ext/openai_public.py)
GPT2_HASHES = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
               "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
C4_HUB = "hf://datasets/allenai/c4/en"
C4_TRAIN_SHARDS, C4_VALIDATION_SHARDS = 1024, 8
HUB_RETRIES, HUB_MAX_BACKOFF_S = 6, 60         # about two minutes of retries before exit 6
# without held-out files, 1 training document in this many is held out: ~3,500 of a C4 shard, more than eval needs
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
    """What a run reads. held_out_slice: no held-out files exist, so validation reads the training files'
    held-out slice (in_held_out_slice), which training skips."""
    train: list[str]
    val: list[str]
    held_out_slice: bool


def resolve_data_files(data: str, val_data: str = "") -> DataFiles:
    """Held out: the files of --val-data, else those of --data named "validation" (C4's convention, never trained
    on), else a slice of the training documents."""
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
    """Decided by a hash of the text alone: the same slice for every run, rank, world size and resume, no state."""
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
    """Virtual stream `rank` of `world`: its documents in an order fixed by the seed, resumable exactly. Lines are
    parsed here, so a malformed line is skipped rather than failing its shard; the shuffle buffer is ours, since
    datasets' own is not in its state_dict."""

    def __init__(self, files: list[str], rank: int, world: int, seed: int | None, buffer_size: int,
                 held_out: bool | None = None):
        """seed None keeps the file order; held_out True reads only the held-out slice, False all but it, None all."""
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
        with dataset_cache(self.remote) as cache:
            stream = datasets.load_dataset("text", data_files=[self.files[i] for i in order], split="train",
                                           streaming=True, encoding_errors="replace", cache_dir=cache)
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
        """Hub errors are retried with exponential backoff and jitter, so that ranks hitting a rate limit together
        do not retry together; local files are not retried."""
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if self.remote and in_hf_cache(error):
            raise hf_cache_refused(cause) from error
        if not self.remote:
            raise ConfigError(f"a data shard is unreadable ({cause}); check the files of --data") from error
        unreachable = contract.hub_unreachable(error)
        if failures > HUB_RETRIES or unreachable or "Offline" in type(error).__name__:
            raise DataUnavailable(("the hub cannot be reached" if unreachable else "C4 could not be streamed from "
                                   f"the hub after {failures} attempt(s)") + f" ({cause}); download shards once with "
                                  "`bash setup.sh --prefetch-c4 N` and pass their glob to --data, or pass another "
                                  "local glob") from error
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


LEGACY_TOKENS = "pending tokens saved by an older checkpoint"


class TokenWindows:
    """Packs a document stream into seq_len + 1 windows, documents joined by the end-of-text token or by nothing
    (separator "none", the study's). Its state is the document stream's state before the documents whose tokens are
    pending, and how many of their tokens were taken: a resume encodes those documents again rather than a checkpoint
    holding their tokens (long documents made that megabytes per stream). Packing ignores the documents per encode."""

    def __init__(self, documents: DocumentStream, tokenizer, seq_len: int, separator: str = "eot",
                 docs_per_encode: int = 64):
        self.documents, self.tokenizer = documents, tokenizer
        self.separator = (tokenizer.eot,) if separator == "eot" else ()
        self.window, self.docs_per_encode = seq_len + 1, docs_per_encode
        self.tokens, self.offset = torch.zeros(0, dtype=torch.long), 0
        self.refills = []            # (the documents' state before a refill whose tokens are pending, its token count)
        self._docs = iter(documents)

    def _refill(self) -> None:
        before = self.documents.state_dict()
        texts = [text for _, text in zip(range(self.docs_per_encode), self._docs)]
        if not texts:
            raise ConfigError("the data stream holds no usable document")
        ids = [token for doc in self.tokenizer.encode_batch(texts) for token in (*doc, *self.separator)]
        self.tokens = torch.cat([self.tokens, torch.tensor(ids, dtype=torch.long)])
        self.refills.append((before, len(ids)))
        if len(self.refills) == 1 and self.offset >= len(self.tokens):     # a saved count is always inside its refill
            raise ConfigError(f"the checkpoint's data position ({self.offset:,} tokens taken) lies past the "
                              f"{len(self.tokens):,} tokens its documents hold; resume from another checkpoint")

    def take(self, count: int) -> torch.Tensor:
        need = count * self.window
        while len(self.tokens) - self.offset < need:
            self._refill()
        windows = self.tokens[self.offset:self.offset + need].view(count, self.window)
        self.offset += need
        while self.refills and self.offset >= self.refills[0][1]:     # a refill wholly taken: its state is spent
            length = self.refills.pop(0)[1]
            self.tokens, self.offset = self.tokens[length:], self.offset - length
        return windows

    def state_dict(self) -> dict:
        """`skipped` counts the malformed lines read so far, the documents' state those before its start."""
        start = self.refills[0][0] if self.refills else self.documents.state_dict()
        skipped = self.documents.skipped
        if start is LEGACY_TOKENS:                # pending tokens that no document state can encode again
            return {"documents": self.documents.state_dict(), "tokens": self.tokens[self.offset:].clone(), "offset": 0,
                    "skipped": skipped}
        return {"documents": start, "taken": self.offset, "skipped": skipped}

    def load_state_dict(self, state: dict) -> None:
        """`taken` tokens are skipped when the documents are encoded again; a checkpoint that holds the pending
        tokens themselves (written before states held `taken`) is read as it was written."""
        self.documents.load_state_dict(state["documents"])
        self.refills, self._docs = [], iter(self.documents)
        if "taken" in state:
            if type(state["taken"]) is not int or state["taken"] < 0:
                raise ValueError(f"a data position of {state['taken']!r} tokens taken")
            self.tokens, self.offset = torch.zeros(0, dtype=torch.long), state["taken"]
        else:
            self.tokens, self.offset = state["tokens"][state["offset"]:], 0
            self.refills = [(LEGACY_TOKENS, len(self.tokens))]


class RankBatches:
    """This rank's share of every global batch, the same sequences whatever the world size: sequence p of a step is
    window p // S of virtual stream p mod S (S = --data-streams), and rank r takes positions r, r + world, ..."""

    def __init__(self, files: list[str], tokenizer, cfg: Config, rank: int, world: int, micro: int,
                 skip_held_out: bool = False):
        self.recipe = (files, tokenizer, cfg, rank, world, micro, skip_held_out)   # a loader process rebuilds it
        self.count, self.batch_size = cfg.data_streams, cfg.batch_size
        self.positions = range(rank, cfg.batch_size, world)
        self.owners = [p % self.count for p in self.positions]
        # streams no position reads (a batch below --data-streams) are kept too: their states go into checkpoints
        read = sorted(set(self.owners) | set(range(rank, self.count, world)))
        held_out = False if skip_held_out else None
        self.streams = {v: TokenWindows(DocumentStream(files, v, self.count, cfg.data_seed, cfg.shuffle_buffer,
                                                       held_out), tokenizer, cfg.seq_len, cfg.doc_separator)
                        for v in read}
        self.micro, self.cursor, self.step = micro, 0, None

    def read_step(self, streams: list[int]) -> tuple[list[int], torch.Tensor]:
        """This rank's slots of the next step that `streams` own, and their windows. A stream shared with other ranks
        (the world size does not divide the streams) is read whole, the others' windows dropped."""
        windows = {v: self.streams[v].take(len(range(v, self.batch_size, self.count))) for v in streams}
        slots = [slot for slot, v in enumerate(self.owners) if v in windows]
        return slots, torch.stack([windows[self.owners[s]][self.positions[s] // self.count] for s in slots])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cursor == 0:
            self.step = self.read_step(sorted(set(self.owners)))[1]
        windows = self.step[self.cursor:self.cursor + self.micro]
        self.cursor = (self.cursor + self.micro) % len(self.owners)
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        """Taken between steps (checkpoints are): a step's streams are read when its first micro-batch is."""
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


def make_loader(batches: RankBatches, cfg: Config, pin_memory: bool) -> Loader:
    steps_ahead = -(-cfg.prefetch * batches.micro // len(batches.owners))       # --prefetch counts micro-batches
    return Loader(batches, cfg.data_workers, cfg.data_timeout, steps_ahead, pin_memory)


def fixed_sequences(data: DataFiles, tokenizer, seq_len: int, count: int, separator: str = "eot"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` windows of the held-out documents in file order, packed as training packs its documents:
    the same for every eval. One document per encode, so that the stream's epoch says whether they ran out."""
    documents = DocumentStream(data.val, rank=0, world=1, seed=None, buffer_size=0,
                               held_out=True if data.held_out_slice else None)
    sequences = TokenWindows(documents, tokenizer, seq_len, separator, docs_per_encode=1).take(count)
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
    """This process's place in the job, and the collectives every rank calls together (no-ops for one process)."""
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            torch.distributed.all_reduce(values)
        return values

    def gather(self, obj) -> list:
        """Every rank's `obj` (small picklable values), in rank order."""
        gathered = [obj] * self.world
        if self.world > 1:
            torch.distributed.all_gather_object(gathered, obj)
        return gathered


# start-up waits for every rank's first documents, a checkpoint's verification and compilation; once steps run,
# ten minutes without progress means a hung rank, better failed and requeued (TRAIN_C4_STEP_TIMEOUT_S: tests)
START_TIMEOUT_S, STEP_TIMEOUT_S = 30 * 60, 10 * 60


def setup_distributed() -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                             timeout=timedelta(seconds=START_TIMEOUT_S))
    return Dist(rank, world, device)


def shorten_timeout(dist: Dist, data_timeout: float) -> None:
    """After the first step (as torchtitan does). 2 minutes above --data-timeout, so that a rank starved of data
    gives up first and says why, instead of its peers timing out without knowing the cause."""
    if dist.world > 1:
        seconds = float(os.environ.get("TRAIN_C4_STEP_TIMEOUT_S", max(STEP_TIMEOUT_S, data_timeout + 120)))
        _set_pg_timeout(timedelta(seconds=seconds))


def end_distributed() -> None:
    """Only when every rank ends together: tearing down a group whose peer is gone can block."""
    if torch.distributed.is_initialized():
        # every rank past its last collective first: gloo aborts a rank whose peer tears its sockets down under it
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def wrap_model(model: GPT, cfg: Config, dist: Dist, dtype: torch.dtype) -> nn.Module:
    """Activation checkpointing lives in the blocks; then compile per block (or the whole model); then DDP or FSDP2.
    Build the optimizer after this: FSDP2 replaces every parameter by its sharded DTensor."""
    if cfg.compile:
        for module in [model] if cfg.compile_scope == "model" else model.blocks:
            module.compile()
    if dist.world == 1:
        return model
    if cfg.parallel == "ddp":
        return DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # FSDP2 shards dim 0 and refuses 0-d parameters (HC's s_a, s_b; mHC's gates): 1-element vectors broadcast alike
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                setattr(module, name, nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))
    # Matmul weights gathered in the compute dtype, gradients reduced in fp32; the connections sharded on their own in
    # fp32, so coefficients come from unrounded weights as under DDP. No input cast: the streams stay fp32.
    policy, mixing_policy = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                                  cast_forward_inputs=False) for param_dtype in (dtype, torch.float32))
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
# checkpointing: what a checkpoint holds (Trainer.save and .restore); how the ranks write, verify and fall back,
# and when a run may continue (check_resumable): hcstudy/run_folder.py

# ----------------------------------------------------------------------------------------------
# logging: what a run announces once (run_record.announce); its files: run_folder.RunLog; its record, pace and W&B:
# run_record, progress, wandb_log

def held_out_source(data: DataFiles, val_data: str) -> str:
    if data.held_out_slice:
        return (f"1 document in {HELD_OUT_EVERY} of the training files (by a hash of its text), never trained on; "
                "the first of them in file order")
    return f"{len(data.val)} file(s) " + (f"of --val-data {val_data!r}" if val_data else "named 'validation'")


# ----------------------------------------------------------------------------------------------
# training loop: AdamW, warm-up + cosine, accumulation, pre-clip gradient norm, eval, probe, checkpoints

def batch_plan(cfg: Config, world: int, on_gpu: bool | None = None, card: float | None = None,
               gpu: str | None = None) -> tuple[int, int, str]:
    """(micro-batch, accumulation steps, why auto chose it): every optimizer step sees --batch-size sequences;
    auto is memory.resolve_micro_batch's, for a GPU (default: where CUDA is; `gpu` its name) or the CPU."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    micro, why = memory.resolve_micro_batch(GPT, cfg, world, on_gpu, card, gpu)
    # the streams each process reads from (ranks share streams when the world size does not divide them)
    read = min(len({p % cfg.data_streams for p in range(rank, cfg.batch_size, world)}) for rank in range(world))
    if cfg.data_workers > read:
        raise ConfigError(f"--data-workers {cfg.data_workers} exceeds the {read} data stream(s) each of {world} "
                          "process(es) reads (a loader process owns whole streams); lower --data-workers, or raise "
                          "--data-streams and --batch-size")
    return micro, cfg.batch_size // (micro * world), why


def lr_at(cfg: Config, step: int) -> float:
    if step < cfg.warmup:       # the study's warm-up trains step 0 at lr 0: only Adam's moments take its gradient
        return cfg.lr * (step + 1 if cfg.warmup_from == "one-step" else step) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def compute_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


class StopRequest:
    """SIGTERM/SIGINT only set a flag: the step in flight finishes, then a checkpoint is saved."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


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
    history: dict = dataclasses.field(default_factory=dict)     # the batch sizes of its steps (history_on)
    wandb_run: object = None
    steady: bool = False        # past the first step: the short collective time-out applies

    def autocast(self):
        return torch.autocast(self.dist.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16)

    def micro_steps(self, stop: StopRequest) -> torch.Tensor:
        """Forward and backward of every micro-batch; the gradient is all-reduced on the last one only. Returns the
        mean loss, the stop votes and the study's reading of the training batch (the H_res of these forwards)."""
        device, loss_sum, mixing_sum = self.dist.device, torch.zeros((), device=self.dist.device), 0.0
        for micro_step in range(self.accum):
            records = []
            x, y = (t.to(device, non_blocking=True) for t in self.loader.next_batch())
            last = micro_step == self.accum - 1
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            with sync:
                with self.autocast():
                    _, loss = self.model(x, y, mixing_out=records)
                (loss / self.accum).backward()
            loss_sum += loss.detach()
            mixing_sum = mixing_sum + batch_mean_mixing(records, device)
        stop_flag = torch.tensor(float(stop.requested), device=device)
        share = 1 / (self.accum * self.dist.world)        # equal micro-batches: the mean of means is the batch's
        summed = self.dist.sum(torch.cat([torch.stack([loss_sum * share, stop_flag]), mixing_sum.flatten() * share]))
        batch_mean = summed[2:].view_as(mixing_sum).double().unsqueeze(1)
        return torch.cat([summed[:2], study_gains(batch_mean)[-1:].float()])     # full depth only

    def optimizer_step(self, stop: StopRequest) -> tuple[float, float, bool, float]:
        lr = lr_at(self.cfg, self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_and_stop = self.micro_steps(stop)
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip or float("inf"))
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm    # FSDP's DTensor
        # the one host synchronisation of a step: divergence must be caught before the update is applied
        loss, stop_votes, study, norm = torch.cat([loss_and_stop, grad_norm.reshape(1).to(loss_and_stop)]).tolist()
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
        return loss, norm, stop_votes > 0, study

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
        loss_sum, count = self.dist.sum(total).tolist()
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
            files["train_state.pt"] = {"step": self.step, "tokens": self.tokens, **self.history,
                                       "config": dataclasses.asdict(self.cfg)}     # config.json may be rewritten
            if sharded is None:
                files |= {"model.pt": unwrap(self.model).state_dict(), "optimizer.pt": self.optimizer.state_dict()}
        write_checkpoint(self.run_dir, self.step, files, self.dist, self.cfg.keep_checkpoints, sharded,
                         self.log.folder)
        self.log.live["last_checkpoint_step"] = self.step
        if self.loader.skipped:
            self.log.info(f"data: {self.loader.skipped} malformed or empty lines skipped so far")

    def restore(self, changed: bool) -> dict:
        """Called after wrapping (FSDP loads its shards in place); returns the settings changed since the checkpoint."""
        found = resume_from(self.run_dir, self.dist, self._load, self.log, self.cfg, changed)
        state = found[1]["train_state.pt"] if found else {"step": 0, "tokens": 0, "batch_sizes": []}
        self.step, self.tokens = state["step"], state["tokens"]
        self.history = history_on(state, self.step, self.cfg.batch_size)
        if found is None:
            return {}
        if self.step > self.cfg.steps:
            raise ConfigError(f"{self.run_dir} has done {self.step} steps, more than --steps {self.cfg.steps}; "
                              f"pass --steps {self.step} or more, or choose another --run-name to start over")
        self.log.live["last_checkpoint_step"] = self.step
        self.log.info(f"resumed from {found[0]} (step {self.step}, {self.tokens:,} tokens)")
        return found[2]

    def _load(self, folder: Path, files: dict, marker: dict) -> str | None:
        """Load a verified checkpoint into the model, optimizer, loader and RNG; what did not fit, or None."""
        sharded = marker.get("format") == "sharded"
        self._check_format(folder, sharded)             # the command's, not the checkpoint's, problem
        try:
            self._load_model_and_optimizer(folder, files, sharded)
            self._load_data_and_rng(files)
        except (torch.OutOfMemoryError, torch.distributed.DistError):
            raise
        except NonFiniteState as damaged:           # DCP's shards: every rank found it together (dcp_load)
            return str(damaged)
        except (TrainerError, RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
            return f"does not fit this run ({first_cause(error)})"
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
            loss, norm, stopping, study = self.optimizer_step(stop)
            self.step += 1
            self.tokens += self.cfg.tokens_per_step
            seconds = time.perf_counter() - started
            measured = self.measurements()
            record = self.record(loss, norm, lr, seconds, self.loader.waited - waited) | measured
            record[contract.STUDY_TRAIN_KEY] = study
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


def preflight(cfg: Config, dist: Dist) -> tuple[int, int, DataFiles]:
    """Every check of a run that needs no model and no data read: (micro-batch, accumulation steps, the files).
    A bad setting ends here with one line, before anything is allocated; only --out is created."""
    if cfg.parallel == "fsdp" and "WORLD_SIZE" not in os.environ:
        raise ConfigError("--parallel fsdp shards over torchrun's processes: start it with torchrun (or plan with "
                          "--estimate --estimate-world-size N)")
    micro, accum, why = batch_plan(cfg, dist.world)
    if why and dist.is_main:
        print(f"micro-batch auto: {micro} ({why})", flush=True)
    memory.check_memory(cfg, embedding_rows(cfg), micro, dist.world, dist.device)
    data = resolve_data_files(cfg.data, cfg.val_data)
    check_writable_folder(Path(cfg.out), "--out")
    return micro, accum, data


def build_trainer(cfg: Config, dist: Dist) -> Trainer:
    micro, accum, data = preflight(cfg, dist)
    run_dir = Path(cfg.out) / cfg.run_name
    log = RunLog(run_dir, dist.is_main)                 # locks the run folder before anything of it is read
    with log.recording_start_failure(lambda error: classify_failure(error, micro)):
        changes = check_resumable(run_dir, cfg, log)
        dtype = compute_dtype(cfg, dist.device)
        use_flash = choice.use_flash_attention(cfg, dist.device, dtype)
        tokenizer = make_tokenizer(cfg.tokenizer)
        val = fixed_sequences(data, tokenizer, cfg.seq_len, cfg.eval_batches * cfg.batch_size, cfg.doc_separator)
        torch.manual_seed(cfg.seed)
        kernels, kernels_reason = kernel_path(cfg, dist.device)
        loss_path = cross_entropy.choose(cfg, device_name(dist.device), contract.load_check(cfg.out))
        model = GPT(cfg, use_flash, kernels, loss_path[0]).to(dist.device)
        wrapped = wrap_model(model, cfg, dist, dtype)        # before the optimizer: FSDP2 replaces the parameters
        optimizer = make_optimizer(model, cfg)
        micro = memory.confirm_micro_batch(cfg, dist, unwrap(wrapped), dtype, micro)     # auto on CUDA: one real step
        accum = cfg.batch_size // (micro * dist.world)
        batches = RankBatches(data.train, tokenizer, cfg, dist.rank, dist.world, micro, data.held_out_slice)
        loader = make_loader(batches, cfg, pin_memory=dist.device.type == "cuda")
        params = count_parameters(cfg)
        peak, flops = gpus.gpu_peak_flops(device_name(dist.device)), gpus.flops_per_token(cfg, params)
        trainer = Trainer(cfg, dist, wrapped, optimizer, loader, val, micro, accum, dtype, log, run_dir, peak, flops)
        trainer.log.record_changes(changes | trainer.restore(changed=bool(changes)), trainer.step)
        record = run_record(cfg, micro, dist, dtype, use_flash, (kernels, kernels_reason), params, loss_path)
        log.write_config(record)
        trainer.wandb_run = start_wandb(cfg, run_dir, record, trainer.log)
        announce(trainer, params, record, held_out_source(data, cfg.val_data), odd_settings(cfg))
        return trainer


def train(cfg: Config) -> None:
    dist = setup_distributed()
    trainer = build_trainer(cfg, dist)
    log, stop = trainer.log, StopRequest()
    try:        # from here every failure is recorded: a full disk may already refuse the first `running` state
        # a fresh start logs its own step-0 probe again, so nothing of an earlier attempt is kept
        log.open_metrics(keep_through_step=trainer.step if trainer.step else -1)
        log.count_restart()
        log.status("running", trainer.step)
        trainer.run(stop)
    except Diverged as error:
        log.status("diverged", trainer.step, EXIT_DIVERGED, str(error))
        raise
    except Interrupted as error:
        log.status("interrupted", trainer.step, EXIT_INTERRUPTED, str(error))
        log.info(str(error), terminal=False)           # main prints it; a run started by hand keeps it in train.log
        raise
    except BaseException as error:
        code, reason, own = failure(error, dist, trainer.micro)
        status = reason if dist.world == 1 or reason.startswith("rank ") else f"rank {dist.rank}: {reason}"
        if dist.world > 1 and not dist.is_main and own:
            # this rank failed first; rank 0 may be killed by torchrun before it can record why
            write_json_atomic(trainer.run_dir / "status.json", {"state": "failed", "step": trainer.step,
                              "exit_code": code, "reason": status, "updated": time.time()})
        reason += log.record_failure(trainer.step, code, status)
        raise RunFailed(code, reason) from error
    finally:
        trainer.loader.close()
    log.status("completed", trainer.step, EXIT_OK)
    log.info(f"completed {trainer.step} steps; run folder {trainer.run_dir}")
    if trainer.wandb_run is not None:
        trainer.wandb_run.finish()


# ----------------------------------------------------------------------------------------------
# main: one line and an exit code for every expected failure (failures classifies; the codes: contract)

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    dist = Dist(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), torch.device("cpu"))
    try:
        if "--consolidate" in argv:
            from hcstudy import consolidate     # the model's code passed in: the package never imports the trainer
            print(consolidate.consolidate(*consolidate.arguments(argv), trainer=sys.modules[__name__]))
            return EXIT_OK
        if argv == [PLAN_JOBS]:
            request = PlanRequest.from_json(json.load(sys.stdin))     # the planner judges with this file's checks
            print(json.dumps(answer_jobs(request, trainer=sys.modules[__name__])))
            return EXIT_OK
        cfg = parse_config(argv)
        if cfg.estimate:
            print_estimate(GPT, cfg, count_parameters(cfg))
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
        label = "" if isinstance(error, Interrupted) else "error: "     # a Ctrl-C or SIGTERM was asked for
        # one write: ranks leave end_distributed's barrier together, and print's text and newline would interleave
        sys.stderr.write(f"{label}{'' if dist.world == 1 else f'rank {dist.rank}: '}{reason}\n")
        if dist.world > 1:
            # torchrun sends SIGTERM to every other rank as soon as one exits non-zero, and Python restores
            # the default handler while it shuts down: a rank a few ms behind would be reported as killed
            # (-15) instead of with its own exit code
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return code


if __name__ == "__main__":
    exit_process(main())
