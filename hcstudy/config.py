"""Every setting of a run, resolved once into a frozen Config: its flags and --help (config_flags), the presets, and
every check that can fail before a run starts.

Config holds the body's settings (RunSettings below: the model's size and precision, optimisation, data,
measurement, the run folder, parallelism, planning) and, after them, each residual arm's own settings as its file
in hcstudy/arms/ declares them (a --help group per arm). A run's Config is made once, by parse_config, and never
changed: data flows one way, from the command line to the model, the loader, the optimizer and the run folder.
"""
from __future__ import annotations

import dataclasses
import re

from hcstudy import arms, contract
from hcstudy import config_flags as flags
from hcstudy.config_flags import COUNT, NATURAL, option
from hcstudy.contract import ConfigError
from hcstudy.kernels import choice, cross_entropy
from hcstudy.planner import memory
from hcstudy.wandb_log import WANDB_MODES

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


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Every flag but the arms' own, with its facts: a new flag is one more line here. The bounds, far beyond any
    real run, keep --estimate, the planner and the loader from allocating without end, and initial values far inside
    float32."""
    # the defaults are the study's 1.73B model (docs/model.md, "Baseline and the transformer body")
    preset: str = option("c4", MODEL, None, "named sets of defaults, applied in order (demo,seed-study or repeated "
        "--preset); explicit flags win", repeated=True)
    residual: str = option("mhc", MODEL, arms.METHODS, "the residual path: " + "; ".join(
        f"{arm.name}, {arm.summary}" for arm in arms.ARMS.values()))
    coefficients: str = option("token", MODEL, ("token", "sequence"), "the mixing coefficients from each token's "
        "streams (causal), or from the streams averaged over the whole sequence (the public study's; not causal)")
    depth: int = option(32, MODEL, (1, 512), "number of transformer blocks (each has an attention and an MLP sublayer)")
    width: int = option(2048, MODEL, (1, 2 ** 16), "model width C")
    heads: int = option(32, MODEL, (1, 256), "attention heads (width must divide by it)")
    expansion: int = option(4, MODEL, (1, 64), "number of residual streams n for HC and mHC")
    seq_len: int = option(1024, MODEL, (1, 2 ** 16), "context length in tokens")
    read_stream: str = option("rotate", MODEL, ("rotate", "first"), "the stream each sublayer reads at init (HC's "
        "one-hot A_m, mHC's b_pre): stream k mod n for sublayer k, or stream 0 for all")
    dynamic_init_std: float = option(0.0, MODEL, (0, 1e6), "std of the initial dynamic mixing weights (HC's W_m, W_r, "
        "W_b; mHC's phi): 0 starts them at zero (the study's: 0.02, its 0.01 re-drawn by its init)")
    collapse: str = option("sum", MODEL, ("sum", "first"), "the n streams to one after the last block: their sum, or "
        "stream 0")
    mixing_norm: str = option("plain", MODEL, ("plain", "scaled"), "the connections' norm of the streams: no weight, "
        "--norm-eps; or with a learnable scale per entry, eps 1e-8 (the study's RMSNorm)")
    mixing_precision: str = option("fp32", MODEL, ("fp32", "autocast"), "the coefficients and the stream mixing in "
        "fp32, or under the run's autocast (bf16 on CUDA; the study's)")
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


def arm_fields() -> list:
    """Each arm's own settings (its declaration's `settings`) as Config fields, in a --help group of the arm's."""
    return [(name, type(default).__name__,
             option(default, f"the {arm.label} arm (--residual {arm.name})", allowed, text))
            for arm in arms.ARMS.values() for name, (default, allowed, text) in arm.settings.items()]


Config = dataclasses.make_dataclass("Config", arm_fields(), bases=(RunSettings,), frozen=True)
Config.__module__, Config.__doc__ = __name__, "A run's every setting: RunSettings, then each arm's own."
CHOICES = flags.choices(Config)


def build_parser():
    epilog = (flags.presets_text(PRESETS) + "\n\npython train_c4.py --consolidate CHECKPOINT OUT.pt writes one file "
              "with the weights of a checkpoint\n(FSDP's sharded ones included), loadable without a process group.")
    return flags.build_parser(Config, "Train baseline / HC / mHC transformers on C4.", epilog)


def parse_config(argv: list[str] | None = None) -> Config:
    """Defaults, then the presets in order, then explicit flags; every check that can fail before a run starts.
    The run's name comes from its settings, however they were asked for (contract.run_name)."""
    explicit = vars(build_parser().parse_args(argv))
    given = flags.preset_names(explicit.pop("preset", ["c4"]), PRESETS)
    # the study's arms bring the study's body and recipe (their declared preset), under any preset given
    names = contract.with_arm_preset(explicit.get("residual", RunSettings.residual), ",".join(given)).split(",")
    composed = Config(**flags.compose_presets(names, PRESETS, {"shuffle_buffer": "data"}), preset=",".join(names))
    try:                # what the presets alone make impossible is theirs to answer for, not the flags'
        validate(composed)
        micro = composed.micro_batch_size
        memory.check_batch_split(composed, 1, None if micro == "auto" else int(micro))
    except (ConfigError, memory.PlanError) as error:
        raise ConfigError(f"--preset {composed.preset} cannot compose: {error}") from None
    cfg = dataclasses.replace(composed, **explicit)
    flags.refuse_unused(explicit, cfg.residual, arms.arms_of())
    validate(cfg)
    if not cfg.run_name:
        cfg = dataclasses.replace(cfg, run_name=contract.run_name(cfg.residual, cfg.depth, cfg.seed, cfg.preset,
                                                                  cfg.sinkhorn_iters, cfg.coefficients,
                                                                  dataclasses.asdict(cfg)))
    return cfg


def validate(cfg: Config) -> None:
    """Refuses, in one line, what cannot run or would be nonsense; nothing is built or read here."""
    flags.check_bounds(cfg)
    arm_checks = getattr(arms.formulas(cfg.residual), "validate", None)     # what only the arm knows it cannot do
    if arm_checks:
        arm_checks(cfg)
    if cfg.kernels in ("fused", "triton") and cfg.residual != "baseline" and choice.study_variants(cfg):
        raise ConfigError(f"--kernels {cfg.kernels} has the papers' streams only, not the study's "
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
