"""What the trainer, the launcher, the GPU check and the report agree on, written once.

train_c4.py exits with these codes and names its runs this way; the launcher (behind run_experiments.sh) acts on
the codes and builds the same names; report.py parses them. The errors below carry those codes: the trainer
raises them, and so can a module beside it without importing train_c4. Every file two processes share is defined
here, with its writer and its reader: a run folder's files and their atomic JSON, matrix.log's lines, the
`--plan-jobs` request and answer, and the GPU check's result.json. Standard library only: the launcher imports it
without torch.
"""
import contextlib
import dataclasses
import errno
import fcntl
import importlib.util
import json
import os
import re
import socket
import stat
import sys
import time
from datetime import datetime
from pathlib import Path

from hcstudy import arms

# The trainer's exit codes (their table: docs/reliability.md).
EXIT_OK, EXIT_BAD_CONFIG, EXIT_DIVERGED, EXIT_OOM, EXIT_DEVICE, EXIT_DATA, EXIT_INTERRUPTED = 0, 2, 3, 4, 5, 6, 75
TRAINER_EXIT_CODES = frozenset({EXIT_OK, EXIT_BAD_CONFIG, EXIT_DIVERGED, EXIT_OOM, EXIT_DEVICE, EXIT_DATA,
                                EXIT_INTERRUPTED})


# A run folder's files (docs/reliability.md, "A run's folder"), written by the trainer, read by the launcher and the
# report; the launcher adds its own record of a halved micro-batch.
CONFIG_FILE, METRICS_FILE, STATUS_FILE, TRAIN_LOG = "config.json", "metrics.jsonl", "status.json", "train.log"
CHECKPOINTS, LAUNCHER_FILE = "checkpoints", "launcher.json"
# A checkpoint folder `checkpoints/step-N` is complete once it holds this marker (with its files' checksums): the
# trainer resumes from the newest, and the launcher says so when it launches the job.
CHECKPOINT_MARKER = "COMPLETE.json"
# RUN/.lock: an exclusive flock held by the running trainer (rank 0) for its life, which the kernel drops when the
# process dies (kill -9 included); status.json's `host` names the machine it runs on. The report tells a run killed
# without recording its end from a live one by the lock where it runs on the report's own host (run_lock_free).
RUN_LOCK = ".lock"
LOCK_PROBE_GRACE_S = 0.5     # how long a trainer that finds the lock taken tries again: run_lock_free holds it that briefly


def this_host() -> str:
    return socket.gethostname()


def run_lock_free(run_dir: Path) -> bool | None:
    """Whether no process holds RUN/.lock: a shared flock tried without waiting and let go at once (never on a link,
    a FIFO or a device); None where it cannot be told (no lock file, unreadable, a file system without flock). Told
    for the processes of this host only: a network file system may not show another node's locks."""
    try:
        fd = os.open(run_dir / RUN_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True                         # closing the file lets go of it
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)


def error_line(error: BaseException) -> str:
    """'TypeName: first line of its message': an unexpected error as one line, for a log, a verdict or a row."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


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

# The public study's body and recipe, the choices that are not sizes (docs/model.md, "The public study's model"):
# its HC and mHC are arms of their own (study-hc, study-mhc), whose declarations apply the seed-study preset that
# holds these. Another arm with all of them (--residual hc --preset seed-study: the paper's HC in the study's
# body) is named after them, `_seed-study`, however it was asked. Its per-sequence coefficients are an arm setting
# (PRESET_ARM_DEFAULTS), so that its token arm is named `_tok`.
SEED_STUDY_MODEL = dict(read_stream="first", collapse="first", mhc_res_diag=2.0, mhc_pre_bias=2.0, mhc_post_bias=2.0,
                        dynamic_init_std=0.02, proj_init="flat", mixing_norm="scaled", weight_decay_on="all",
                        mixing_precision="autocast", warmup_from="zero", doc_separator="none")

# Settings of hc and mhc (and mHC's family) that made the public study's HC and mHC before those had arms of their
# own, {arm: {setting: (the paper's value, the study's)}}: a config.json written then records them (upgraded_config)
RETIRED_STUDY_SETTINGS = {
    "hc": {"coefficient_norm": ("stream", "flat"), "hc_dynamic": ("stream", "state"), "hc_write_init": ("all", "first")},
    "mhc": {"mhc_tanh": (False, True), "mhc_norm_order": ("project-first", "norm-first"),
            "sinkhorn_order": ("columns-first", "rows-first"), "mhc_bias_others": ("minus", "zero")}}


def upgraded_config(recorded: dict) -> dict:
    """A config.json's settings as this version names them: a run of hc or mhc recorded with all the retired
    settings at the study's values is one of study-hc or study-mhc, and the retired settings go; a mix of the two
    (say an hc run with the study's norm only) is a model this version cannot build, refused."""
    arm = recorded.get("residual")
    retired = RETIRED_STUDY_SETTINGS.get(arm, {} if arm == "baseline" else RETIRED_STUDY_SETTINGS["mhc"])
    values = {key: recorded[key] for key in retired if key in recorded}
    settings = {key: value for key, value in recorded.items()
                if not any(key in keys for keys in RETIRED_STUDY_SETTINGS.values())}
    if arm in RETIRED_STUDY_SETTINGS and values and all(values.get(key) == study for key, (_, study) in retired.items()):
        return {**settings, "residual": f"study-{arm}"}
    for key, value in values.items():
        if value != retired[key][0]:
            raise ConfigError(f"the run records --{key.replace('_', '-')} {value}, a setting this version no longer "
                              f"has (the public study's HC and mHC are the arms study-hc and study-mhc)")
    return settings


# config keys whose change makes a different model: resuming over them would mix two experiments
MODEL_KEYS = ("residual", "depth", "width", "heads", "expansion", "seq_len", "tokenizer", "norm_eps", "coefficients",
              "read_stream", "dynamic_init_std", "collapse", "proj_init", "mixing_norm", "mixing_precision", "vocab",
              "stream_dtype", *arms.declared_settings())
# keys whose change makes the rest of a run a different experiment (schedule, batches, data): resuming over
# them needs --allow-changed-settings. The micro-batch, world size and loader count are not among them: the
# batches and the maths stay the same.
TRAINING_KEYS = ("lr", "steps", "batch_size", "warmup", "warmup_from", "min_lr_ratio", "weight_decay", "grad_clip",
                 "no_mixing_decay", "weight_decay_on", "seed", "data", "val_data", "data_seed", "data_streams",
                 "shuffle_buffer", "doc_separator")

# The metrics.jsonl key of the study's own reading of each training batch (train_c4's Trainer.micro_steps)
STUDY_TRAIN_KEY = "amax_study_train"
# how the streams share the state and how far H_res and their full-depth product lie from I, J/n and the
# permutations: logged at each probe by the arms with streams (not the baseline); the lists per sublayer at
# --layer-metrics-every (train_c4.stream_metrics, docs/model.md)
STREAM_KEYS = ("stream_dominance", "stream_dominance_mean", "effective_streams", "effective_streams_min",
               "effective_rank", "effective_rank_min", "res_to_identity", "res_to_identity_mean",
               "composite_to_uniform", "composite_to_permutation")
STREAM_LAYER_KEYS = ("layer_stream_dominance", "layer_effective_streams", "layer_effective_rank",
                     "layer_res_to_identity")

# The residual arms (hcstudy/arms/: one file each, its declaration read without torch) and the two settings only
# some of them have: the launcher multiplies a setting's list only for the arms that have it (no duplicate jobs),
# and a run name carries a setting only where it differs from its default, so the run folders of the main matrix
# keep their names.
METHODS = arms.METHODS
SINKHORN_METHODS = arms.with_sinkhorn()
COEFFICIENT_METHODS = arms.with_streams()
# the settings only some arms have, and those arms: the trainer refuses such a flag given for another arm
ARMS_OF = arms.arms_of()
ARM_PRESET = {name: arm.preset for name, arm in arms.ARMS.items() if arm.preset}
ARM_DEFAULTS = {"sinkhorn_iters": 20, "coefficients": "token"}
PRESET_ARM_DEFAULTS = {"seed-study": {"coefficients": "sequence"}}  # the public study's per-sequence model
COEFFICIENT_SUFFIX = {"token": "_tok", "sequence": "_seq"}

RUN_NAME = re.compile(r"^(?P<method>[A-Za-z]+(?:-[A-Za-z]+)*)_d(?P<depth>\d+)_s(?P<seed>\d+)"
                      r"(?:_it(?P<sinkhorn_iters>\d+))?(?:_(?P<coefficients>tok|seq))?(?P<suffix>_[a-z][a-z-]*)?$")


def with_arm_preset(method: str, presets: str | None) -> str:
    """The presets, comma separated, a run of `method` composes: its arm's own first (the study's arms: seed-study)
    where not named already, then those given (c4, the defaults, only where nothing else is)."""
    names = [name for name in (presets or "").split(",") if name]
    own = ARM_PRESET.get(method, "")
    if own and own not in names:
        names = [own, *(name for name in names if name != "c4")]
    return ",".join(names)


def named_arm(method: str, presets: str | None, settings: dict | None = None) -> str | None:
    """The key of RUN_NAME_SUFFIX a run is named after: "seed-study" where the settings (else the presets, comma
    separated, as the launcher knows them) are the study's in every setting its arm has, unless its arm is the
    study's own (`method` study-hc: the name says it); "stress" where the stress preset is among them."""
    names = (presets or "").split(",")
    study = all(settings.get(k) == v for k, v in SEED_STUDY_MODEL.items() if method in ARMS_OF.get(k, (method,))) \
        if settings else "seed-study" in names
    study = study and ARM_PRESET.get(method) != "seed-study"
    return ",".join(name for name, applies in (("seed-study", study), ("stress", "stress" in names)) if applies) or None


def launcher_settings(method: str, presets: str | None, flags: list[str]) -> dict:
    """The settings named_arm reads, as far as the launcher knows them before any trainer runs: the study's where
    the presets (the arm's own among them) include seed-study (else unknown), then each trainer flag after `--` that
    sets one (`--read-stream rotate`, `--mhc-post-bias=0`), so that the launcher names a run as the trainer would."""
    study = "seed-study" in with_arm_preset(method, presets).split(",")
    settings = {"residual": method, **{key: value if study else None for key, value in SEED_STUDY_MODEL.items()}}
    for i, arg in enumerate(flags):
        flag, has_value, inline = arg.partition("=")
        key = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        if key in SEED_STUDY_MODEL:
            value = inline if has_value else (flags[i + 1] if i + 1 < len(flags) else "")
            with contextlib.suppress(ValueError):       # a bad number: the trainer refuses it before any launch
                settings[key] = float(value) if isinstance(SEED_STUDY_MODEL[key], float) else value.lower()
    return settings


def _arm_defaults(preset):
    return {**ARM_DEFAULTS, **(PRESET_ARM_DEFAULTS["seed-study"] if "seed-study" in (preset or "") else {})}


def arm_settings(method, preset=None, sinkhorn_iters=None, coefficients=None):
    """(sinkhorn_iters, coefficients) as they apply to `method`: None where it has no such setting, the preset's
    (or the arm's own preset's) default where not given."""
    defaults = _arm_defaults(with_arm_preset(method, preset))
    iters = (sinkhorn_iters or defaults["sinkhorn_iters"]) if method in SINKHORN_METHODS else None
    coefficients = (coefficients or defaults["coefficients"]) if method in COEFFICIENT_METHODS else None
    return iters, coefficients


def run_name(method, depth, seed, preset=None, sinkhorn_iters=None, coefficients=None, settings=None):
    """`{method}_d{depth}_s{seed}`, then `_it{N}` and `_seq`/`_tok` where they differ from the arm's defaults,
    then the named arm's suffix (named_arm: from `settings` where given, else the presets `preset` names):
    `hc_d48_s123`, `mhc_d32_s42_it100`, `hc_d32_s42_seq`, `hc_d32_s42_seed-study`."""
    iters, coefficients = arm_settings(method, preset, sinkhorn_iters, coefficients)     # what the run trains
    preset = named_arm(method, with_arm_preset(method, preset), settings)
    defaults = _arm_defaults(with_arm_preset(method, preset))           # what its name is told apart from
    arm = f"_it{iters}" if iters not in (None, defaults["sinkhorn_iters"]) else ""
    arm += COEFFICIENT_SUFFIX[coefficients] if coefficients not in (None, defaults["coefficients"]) else ""
    return f"{method}_d{depth}_s{seed}{arm}{RUN_NAME_SUFFIX.get(preset, '')}"


# ----------------------------------------------------------------------------------------------
# JSON files: written whole or not at all, read without trusting them

def write_atomically(path: Path, write) -> None:
    """write(temp file), then rename it over `path`: readers see the old file or the new one, never half of one,
    and a failed write (full disk, quota, read-only, permission) leaves no temp file behind."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.unlink(missing_ok=True)             # a link left under the temp name would take the write elsewhere
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: dict) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1)))


def open_regular(path):
    """`path` opened for reading when it is a regular file: a FIFO would block (O_NONBLOCK: not even the open
    waits), a device may never end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return os.fdopen(fd, "rb")


def read_json(path, default=None, warn=None, newer_than: float | None = None):
    """The JSON object in a small file, else `default`: where it is missing, older than `newer_than` (left from
    before), unreadable, half-written, nested too deeply or not an object. `warn(message)` hears of every reason but
    a missing or older file."""
    try:
        if newer_than is not None and os.path.getmtime(path) < newer_than:
            return default
        with open_regular(path) as f:
            obj = json.loads(f.read())
    except FileNotFoundError:
        return default
    except (OSError, ValueError, RecursionError) as error:
        if warn:
            warn(f"cannot read {path}: {type(error).__name__ if isinstance(error, RecursionError) else error}")
        return default
    return obj if isinstance(obj, dict) else default


# ----------------------------------------------------------------------------------------------
# matrix.log: every decision of the launcher, one line each, read back by report.py --watch and --summary
#
#     STAMP EVENT [RUN] [key=value ...] [text]
#
# STAMP is local time to the millisecond with its UTC offset; RUN a run name (the third word where it holds no
# `=`); the fields run up to the first word that is not key=value, and the text is free. The QUEUE line opens an
# invocation's queue: its fields QUEUE_FIELDS; the job events of JOB_STATES then move each run.

MATRIX_LOG = "matrix.log"
QUEUE_FIELDS = ("slots", "gpus_per_run", "gpus", "price_per_gpu_hour", "runs", "planned_s")
JOB_STATES = {"LAUNCH": "running", "DONE": "done", "DIVERGED": "done", "SKIP": "done", "FAILED": "failed",
              "RETRY": "queued", "REQUEUE": "queued"}
LOG_STAMP = "%Y-%m-%dT%H:%M:%S"
FIELD = re.compile(r"[a-z_]+=\S*")


def matrix_log_name(nodes: int, node_rank: int) -> str:
    """matrix.log, or with --nodes each node's share matrix.node{i}.log."""
    return MATRIX_LOG if nodes == 1 else f"matrix.node{node_rank}.log"


def log_stamp(now: float) -> str:
    local = time.localtime(now)
    return time.strftime(LOG_STAMP, local) + f".{int(now * 1000) % 1000:03d}" + time.strftime("%z", local)


def log_time(stamp: str) -> float:
    return datetime.strptime(stamp, LOG_STAMP + ".%f%z").timestamp()


def log_line(event: str, run: str | None = None, text: str = "", now: float | None = None, **fields) -> str:
    """One line of matrix.log; a field's value must hold no space."""
    words = [log_stamp(time.time() if now is None else now), event, *([run] if run else []),
             *(f"{key}={value}" for key, value in fields.items()), *([text] if text else [])]
    return " ".join(words)


@dataclasses.dataclass(frozen=True)
class LogLine:
    stamp: str
    event: str
    run: str | None
    fields: dict
    text: str


def read_log_line(line: str) -> LogLine | None:
    """A line of matrix.log split as log_line wrote it; None for a line too short to be one."""
    words = line.split(" ")
    if len(words) < 2:
        return None
    stamp, event, rest = words[0], words[1], words[2:]
    run = rest.pop(0) if rest and "=" not in rest[0] else None
    fields = {}
    while rest and FIELD.fullmatch(rest[0]):
        key, _, value = rest.pop(0).partition("=")
        fields[key] = value
    return LogLine(stamp, event, run, fields, " ".join(rest))


# ----------------------------------------------------------------------------------------------
# --plan-jobs: the launcher's request on the trainer's stdin, its answer the last line of the trainer's stdout
# (docs/planning.md). The launcher never imports the trainer: every job is judged by the trainer's own checks.

PLAN_JOBS = "--plan-jobs"


@dataclasses.dataclass(frozen=True)
class PlanJob:
    flags: list                         # the job's trainer flags, as it will be launched
    done_steps: int = 0                 # its status.json's step: the plan is for the steps left
    finished: bool = False              # completed or diverged: checked for changed settings only
    check: dict | None = None           # the GPU check's result.json, if any (load_check)
    tokens_per_s: float | None = None   # --calibrate's timing of its method and depth


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    gpu: str                            # as nvidia-smi names it; "cpu"; "": the documented node's
    world: int                          # GPUs per run
    card_gib: float | None              # one card's memory, where nvidia-smi said it
    jobs: list                          # of PlanJob

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, obj: dict) -> "PlanRequest":
        return cls(obj["gpu"], obj["world"], obj.get("card_gib"), [PlanJob(**job) for job in obj["jobs"]])


@dataclasses.dataclass(frozen=True)
class JobAnswer:
    """The trainer's answer for one job: refused (error), finished with its settings unchanged, or planned."""
    error: str | None = None
    finished: bool = False
    micro: int | None = None            # the micro-batch it will run (auto: planned)
    auto: bool = False                  # the micro-batch was --micro-batch-size auto
    batch: int | None = None            # its global batch
    memory: str | None = None           # "12.3 of 80 GiB": the plan of one GPU (None on the CPU)
    path: str | None = None             # the streams' kernel path
    seconds: list | None = None         # the remaining run, [low, high]; None where unknown
    step_seconds: list | None = None    # one optimizer step, [low, high]
    basis: str | None = None            # where the step time comes from; its first word: measured, scaled, ...
    step_point: float | None = None     # a measured step's median (step_seconds: its fastest and slowest)
    changes: str = ""                   # settings changed since a finished run (--allow-changed-settings)


def plan_answer(gpu: str, assumptions: list, jobs: list) -> dict:
    """The trainer's answer: the GPU planned for, the assumptions behind every time, a JobAnswer per job."""
    return {"gpu": gpu, "assumptions": assumptions, "jobs": [dataclasses.asdict(job) for job in jobs]}


def read_plan_answer(stdout: str, names: list) -> dict:
    """The answer on the trainer's last line of output, its jobs {name: JobAnswer as a dict} in the request's order;
    ValueError, KeyError, TypeError or IndexError where it is not one."""
    answer = json.loads(stdout.strip().splitlines()[-1])
    jobs = [dataclasses.asdict(JobAnswer(**job)) for job in answer["jobs"]]
    return {"gpu": answer["gpu"], "assumptions": list(answer["assumptions"]),
            "jobs": dict(zip(names, jobs, strict=True))}


# ----------------------------------------------------------------------------------------------
# The GPU check's result.json (`run_experiments.sh --check`, docs/planning.md): written by hcstudy.gpu_check, read
# by the kernel choice (auto takes the fastest path timed), the planner and the launcher.

CHECK_FORMAT = 3                    # 2: the rehearsals at the real sizes beside the timings; 3: `kernels`
# result.json's `kernels` (format 3; older files have none, and their triton timings count as proven): per arm with a
# triton path, {"tests": PASS | FAIL, "cases", "failed", "reason" (the first failure's line, or why none ran), "path",
# "why" (choice.kernel_path's with --kernels triton on the card: its self-check), "fallback" (for an arm that failed:
# the path it falls back to and what that costs the --full matrix, one line; "" otherwise)} (hcstudy/check_kernels.py)


def check_path(out) -> Path:
    return Path(out) / "gpu_check" / "result.json"


def load_check(out) -> dict:
    """The GPU check's result.json in this --out, {} where there is none or it cannot be read."""
    return read_json(check_path(out), {})


def check_result(device: dict, flags: list, tokens_per_step: int, parts: dict, table: dict, methods: dict,
                 modelled: dict, rehearsals: list = (), kernels: dict | None = None) -> dict:
    """result.json. `table`: {method: {"path/mode": {"step_s", "tokens_per_s", "mfu", "mem_peak_gb"} or None}}, every
    run timed; `methods`: {method: {"path", "step_s", "flops_per_token"}}, its fastest, with the FLOPs per token of the
    timed configuration the planner scales it by; `modelled`: the planner's step range beside each timing;
    `rehearsals`: rehearsal_row's, one per job shape trained at the real sizes; `kernels`: per arm its kernel tests
    and self-check (above)."""
    return {"format": CHECK_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **device,
            "trainer_flags": flags, "tokens_per_step": tokens_per_step, "parts": parts,
            "methods": {m: {"step_seconds": s["step_s"], "tokens_per_step": tokens_per_step, "gpus": 1,
                            "flops_per_token": s["flops_per_token"]} for m, s in methods.items()},
            "step_seconds": {m: s["step_s"] for m, s in methods.items()},
            "paths": {m: s["path"] for m, s in methods.items()}, "timings": table, "modelled": modelled,
            "rehearsals": list(rehearsals), "kernels": dict(kernels or {})}


def timed_steps(check: dict, method: str, gpu: str) -> dict:
    """{(path, mode): seconds per step} of every run of `method` the check timed on this GPU, but for a triton path
    whose kernel tests failed there (kernels_failed): no run takes it for its speed; {} for another GPU or a
    result.json that is not one."""
    try:
        if check.get("gpu") != gpu:
            return {}
        failed = kernels_failed(check, method)
        return {tuple(key.split("/", 1)): stats["step_s"] for key, stats in check["timings"][method].items()
                if stats and "/" in key and isinstance(stats.get("step_s"), (int, float))
                and not (failed and key.startswith("triton/"))}
    except (KeyError, TypeError, AttributeError):
        return {}


def kernels_failed(check: dict, method: str) -> bool:
    """Whether the check's kernel tests of `method`'s triton path failed on its card (`kernels`, from format 3)."""
    kernels = check.get("kernels")
    record = kernels.get(method) if isinstance(kernels, dict) else None
    return isinstance(record, dict) and record.get("tests") == "FAIL"


def timed_losses(check: dict, gpu: str) -> dict:
    """{'plain' or 'fused': seconds per step} of the two cross-entropy paths the check timed against each other on
    this GPU (result.json's "cross_entropy": {path: {"step_s": s}}, one model and micro-batch for both; a path that did
    not run is null); {} for another GPU or a result.json without them."""
    try:
        if check.get("gpu") != gpu:
            return {}
        return {path: stats["step_s"] for path, stats in check["cross_entropy"].items()
                if path in ("plain", "fused") and stats and isinstance(stats.get("step_s"), (int, float))}
    except (KeyError, TypeError, AttributeError):
        return {}


def timed_work(check: dict, method: str) -> tuple[float, int] | None:
    """(FLOPs of one timed step, GPUs it ran on) of `method`'s timed configuration, None where not recorded."""
    timing = (check.get("methods") or {}).get(method) or {}
    try:
        return timing["tokens_per_step"] * timing["flops_per_token"], timing.get("gpus", 1)
    except (KeyError, TypeError):
        return None


# result.json's `rehearsals`: one row per job shape the check trained on one GPU at the study's real sizes
# (hcstudy/check_parts.py writes them, hcstudy/planner/rehearsed.py reads them back). A row's keys:
#   gpu                 torch.cuda.get_device_name(): rows price and limit jobs planned for this GPU type only
#   method, depth, width, seq_len, batch_size, micro_batch, activation_checkpointing, stream_dtype, compile
#                       the shape, as the trainer's settings of those names (micro_batch: the one it ran)
#   kernels             the streams' path it ran (reference, fused, triton): the planner's choice for this card
#   variant             the extra trainer flags a lever added to the shape ([] for none: check_parts.VARIANTS)
#   config              every setting the step depends on (rehearsed.step_config): a job is priced from the row
#                       only if its own config equals it, its micro-batch and path equal the row's, on one GPU
#   over_plan           true for the micro-batch one above the planned one (where the card's limit lies)
#   status, reason      ok | oom (torch.cuda.OutOfMemoryError: caught, the memory freed, the check went on) |
#                       failed (any other error: its first line) | out-of-time (not run: no budget left); reason ""
#                       when ok
#   step_s, step_s_spread, steps_timed
#                       the median seconds of one optimizer step (every micro-batch of batch_size, the trainer's
#                       Trainer.optimizer_step) after the warm-up, [min, max] of the timed steps, and how many
#   tokens_per_s, mfu   batch_size x seq_len over step_s; its training FLOPs over the card's bf16 peak (null unknown)
#   peak_alloc_gib, planned_alloc_gib
#                       torch.cuda.max_memory_allocated over the steps (null off CUDA, or before any step ran);
#                       the memory plan's allocated peak for the shape (memory.memory_plan)
#   modelled_step_s     [low, high]: the planner's step on the card's rates (run_time.step_seconds), null unknown
# Numbers are null where the status is not ok (peak_alloc_gib: what was reached before the failure, if anything).
REHEARSAL_STATUSES = ("ok", "oom", "failed", "out-of-time")
REHEARSAL_KEYS = ("gpu", "method", "depth", "width", "seq_len", "batch_size", "micro_batch", "activation_checkpointing",
                  "stream_dtype", "compile", "kernels", "variant", "config", "over_plan", "status", "reason", "step_s",
                  "step_s_spread", "steps_timed", "tokens_per_s", "mfu", "peak_alloc_gib", "planned_alloc_gib",
                  "modelled_step_s")


def rehearsal_row(**fields) -> dict:
    """One row of `rehearsals`, its keys exactly REHEARSAL_KEYS (a missing or unknown one is a bug: ValueError)."""
    if set(fields) != set(REHEARSAL_KEYS) or fields["status"] not in REHEARSAL_STATUSES:
        raise ValueError(f"a rehearsal row needs exactly {REHEARSAL_KEYS} and a status of {REHEARSAL_STATUSES}: got "
                         f"{sorted(fields)}, status {fields.get('status')!r}")
    return {key: fields[key] for key in REHEARSAL_KEYS}


def rehearsals_on(check: dict, gpu: str) -> list:
    """The rows of result.json's `rehearsals` rehearsed on this GPU type, each a dict with every key; [] for another
    GPU, an older result.json or a file that is not one."""
    rows = check.get("rehearsals") if isinstance(check, dict) else None
    if not isinstance(rows, list):
        return []
    return [row for row in rows if isinstance(row, dict) and set(REHEARSAL_KEYS) <= row.keys() and row["gpu"] == gpu]
