"""hcstudy/contract.py: what the trainer, the launcher and the report agree on, written once.

train_c4.py exits with these codes and names its runs this way; hcstudy/launcher (behind run_experiments.sh) acts on
the codes and builds the same names; report.py parses them. The errors below carry those codes: the trainer
raises them, and so can a module beside it without importing train_c4. Standard library only: the launcher
imports it without torch.
"""
import contextlib
import importlib.util
import re
import sys

# The trainer's exit codes (the table in README.md, "Exit codes").
EXIT_OK, EXIT_BAD_CONFIG, EXIT_DIVERGED, EXIT_OOM, EXIT_DEVICE, EXIT_DATA, EXIT_INTERRUPTED = 0, 2, 3, 4, 5, 6, 75
TRAINER_EXIT_CODES = frozenset({EXIT_OK, EXIT_BAD_CONFIG, EXIT_DIVERGED, EXIT_OOM, EXIT_DEVICE, EXIT_DATA,
                                EXIT_INTERRUPTED})


# A checkpoint folder `checkpoints/step-N` is complete once it holds this marker (with its files' checksums): the
# trainer resumes from the newest, and the launcher says so when it launches the job.
CHECKPOINT_MARKER = "COMPLETE.json"


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
    """A failure already classified (by train_c4's `failure`) and recorded in status.json; the cause is chained."""

    def __init__(self, exit_code: int, reason: str):
        super().__init__(reason)
        self.exit_code = exit_code


def exit_without_packages(script: str, *names: str) -> None:
    """A script started by a python without this project's packages (the system one, not setup.sh's .venv) says
    which python to use in one line, instead of a ModuleNotFoundError traceback."""
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"{script}: {sys.executable} has no {', '.join(missing)}; run `bash setup.sh` once, then "
                 f"`.venv/bin/python {script}` (or `source .venv/bin/activate` first)")


# What a failed name lookup says (glibc, macOS, Windows): the hub cannot be reached at all, which a retry within
# minutes does not change, unlike a rate limit or a dropped connection
NAME_LOOKUP_FAILED = ("Name or service not known", "name resolution", "nodename nor servname", "getaddrinfo failed")


def hub_unreachable(error) -> bool:
    """Whether an error, or one it was raised from, is a failed name lookup (the libraries wrap it two deep)."""
    for _ in range(10):          # a bounded walk: a chain can loop
        if error is None:
            return False
        if any(text in str(error) for text in NAME_LOOKUP_FAILED):
            return True
        error = error.__cause__ or error.__context__
    return False


# A preset that changes the recipe gets its own run names, so its runs share an out folder with the main matrix.
RUN_NAME_SUFFIX = {"stress": "_stress", "seed-study": "_seed-study", "seed-study,stress": "_seed-study-stress"}

# The public study's model (docs/model.md, "The public study's model"): a run whose settings are all these is named
# after it however it was asked (--preset seed-study or the flags one by one). Its per-sequence coefficients are an
# arm setting (PRESET_ARM_DEFAULTS), so that its token arm is named `_tok_seed-study`.
SEED_STUDY_MODEL = dict(coefficient_norm="flat", read_stream="first", mhc_tanh=True, collapse="first",
                        hc_dynamic="state", hc_write_init="first", mhc_res_diag=2.0, mhc_pre_bias=2.0,
                        mhc_bias_others="zero", mhc_post_bias=2.0, dynamic_init_std=0.02, proj_init="flat",
                        sinkhorn_order="rows-first", mixing_norm="scaled", weight_decay_on="all",
                        mixing_precision="autocast")

# config keys whose change makes a different model: resuming over them would mix two experiments
MODEL_KEYS = ("residual", "depth", "width", "heads", "expansion", "seq_len", "tokenizer", "sinkhorn_iters",
              "hc_scale_init", "mhc_gate_init", "mhc_res_diag", "mhc_pre_bias", "norm_eps", "coefficients",
              "read_stream", "coefficient_norm", "dynamic_init_std", "mhc_tanh", "collapse", "hc_dynamic",
              "hc_write_init", "mhc_bias_others", "mhc_post_bias", "proj_init", "sinkhorn_order", "mixing_norm",
              "mixing_precision", "vocab")
# keys whose change makes the rest of a run a different experiment (schedule, batches, data): resuming over
# them needs --allow-changed-settings. The micro-batch, world size and loader count are not among them: the
# batches and the maths stay the same.
TRAINING_KEYS = ("lr", "steps", "batch_size", "warmup", "min_lr_ratio", "weight_decay", "grad_clip",
                 "no_mixing_decay", "weight_decay_on", "seed", "data", "val_data", "data_seed", "data_streams",
                 "shuffle_buffer")

# The metrics.jsonl key of the study's own reading of each training batch (train_c4's Trainer.micro_steps)
STUDY_TRAIN_KEY = "amax_study_train"

# The residual arms and the two settings only some of them have: the launcher multiplies a setting's list only for
# the methods that have it (no duplicate jobs), and a run name carries a setting only where it differs from its
# default, so the run folders of the main matrix keep their names.
METHODS = ("baseline", "hc", "mhc", "mhc-lite", "identity-hc")
SINKHORN_METHODS = frozenset({"mhc"})                               # mhc-lite and identity-hc have no Sinkhorn
COEFFICIENT_METHODS = frozenset({"hc", "mhc", "mhc-lite", "identity-hc"})
# the settings only some arms have, and those arms: the trainer refuses such a flag given for another arm
MIXING_METHODS = METHODS[1:]
MHC_FAMILY = ("mhc", "mhc-lite", "identity-hc")
ARMS_OF = {"sinkhorn_iters": ("mhc",), "sinkhorn_order": ("mhc",), "hc_scale_init": ("hc",),
           "coefficient_norm": ("hc",), "hc_dynamic": ("hc",), "hc_write_init": ("hc",),
           "mhc_gate_init": MHC_FAMILY, "mhc_pre_bias": MHC_FAMILY, "mhc_tanh": MHC_FAMILY,
           "mhc_post_bias": MHC_FAMILY, "mhc_bias_others": MHC_FAMILY, "mhc_res_diag": ("mhc", "mhc-lite"),
           **dict.fromkeys(("coefficients", "expansion", "read_stream", "collapse", "dynamic_init_std", "kernels",
                            "no_mixing_decay", "mixing_norm", "mixing_precision"), MIXING_METHODS)}
ARM_DEFAULTS = {"sinkhorn_iters": 20, "coefficients": "token"}
PRESET_ARM_DEFAULTS = {"seed-study": {"coefficients": "sequence"}}  # the public study's per-sequence model
COEFFICIENT_SUFFIX = {"token": "_tok", "sequence": "_seq"}

RUN_NAME = re.compile(r"^(?P<method>[A-Za-z]+(?:-[A-Za-z]+)*)_d(?P<depth>\d+)_s(?P<seed>\d+)"
                      r"(?:_it(?P<sinkhorn_iters>\d+))?(?:_(?P<coefficients>tok|seq))?(?P<suffix>_[a-z][a-z-]*)?$")


def named_arm(presets: str | None, settings: dict | None = None) -> str | None:
    """The key of RUN_NAME_SUFFIX a run is named after: "seed-study" where the settings (else the presets, comma
    separated, as the launcher knows them) are the study's model in every setting its arm has, "stress" where the
    stress preset is among them."""
    names = (presets or "").split(",")
    arm = (settings or {}).get("residual")
    study = all(settings.get(k) == v for k, v in SEED_STUDY_MODEL.items() if arm in ARMS_OF.get(k, (arm,))) \
        if settings else "seed-study" in names
    return ",".join(name for name, applies in (("seed-study", study), ("stress", "stress" in names)) if applies) or None


def launcher_settings(method: str, presets: str | None, flags: list[str]) -> dict:
    """The settings named_arm reads, as far as the launcher knows them before any trainer runs: the study's where
    the presets include seed-study (else unknown), then each trainer flag after `--` that sets one (`--no-mhc-tanh`,
    `--hc-write-init all`, `--mhc-post-bias=0`), so that the launcher names a run as the trainer would."""
    study = "seed-study" in (presets or "").split(",")
    settings = {"residual": method, **{key: value if study else None for key, value in SEED_STUDY_MODEL.items()}}
    for i, arg in enumerate(flags):
        flag, has_value, inline = arg.partition("=")
        key = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        switch = key.removeprefix("no_")
        if isinstance(SEED_STUDY_MODEL.get(switch), bool):
            settings[switch] = key == switch
        elif key in SEED_STUDY_MODEL:
            value = inline if has_value else (flags[i + 1] if i + 1 < len(flags) else "")
            with contextlib.suppress(ValueError):       # a bad number: the trainer refuses it before any launch
                settings[key] = float(value) if isinstance(SEED_STUDY_MODEL[key], float) else value.lower()
    return settings


def _arm_defaults(preset):
    return {**ARM_DEFAULTS, **(PRESET_ARM_DEFAULTS["seed-study"] if "seed-study" in (preset or "") else {})}


def arm_settings(method, preset=None, sinkhorn_iters=None, coefficients=None):
    """(sinkhorn_iters, coefficients) as they apply to `method`: None where it has no such setting, the preset's
    default where not given."""
    defaults = _arm_defaults(preset)
    iters = (sinkhorn_iters or defaults["sinkhorn_iters"]) if method in SINKHORN_METHODS else None
    coefficients = (coefficients or defaults["coefficients"]) if method in COEFFICIENT_METHODS else None
    return iters, coefficients


def run_name(method, depth, seed, preset=None, sinkhorn_iters=None, coefficients=None, settings=None):
    """`{method}_d{depth}_s{seed}`, then `_it{N}` and `_seq`/`_tok` where they differ from the arm's defaults,
    then the named arm's suffix (named_arm: from `settings` where given, else the presets `preset` names):
    `hc_d48_s123`, `mhc_d32_s42_it100`, `hc_d32_s42_seq`, `hc_d32_s42_seed-study`."""
    iters, coefficients = arm_settings(method, preset, sinkhorn_iters, coefficients)     # what the run trains
    preset = named_arm(preset, settings)
    defaults = _arm_defaults(preset)                                    # what its name is told apart from
    arm = f"_it{iters}" if iters not in (None, defaults["sinkhorn_iters"]) else ""
    arm += COEFFICIENT_SUFFIX[coefficients] if coefficients not in (None, defaults["coefficients"]) else ""
    return f"{method}_d{depth}_s{seed}{arm}{RUN_NAME_SUFFIX.get(preset, '')}"
