"""contract.py: what the trainer, the launcher and the report agree on, written once.

train_c4.py exits with these codes and names its runs this way; matrix.py (behind run_experiments.sh) acts on
the codes and builds the same names; report.py parses them. The errors below carry those codes: the trainer
raises them, and so can a module beside it without importing train_c4. Standard library only: the launcher
imports it without torch.
"""
import importlib.util, re, sys

# The trainer's exit codes (the table in README.md, "Exit codes").
EXIT_OK, EXIT_BAD_CONFIG, EXIT_DIVERGED, EXIT_OOM, EXIT_DEVICE, EXIT_DATA, EXIT_INTERRUPTED = 0, 2, 3, 4, 5, 6, 75
TRAINER_EXIT_CODES = frozenset({EXIT_OK, EXIT_BAD_CONFIG, EXIT_DIVERGED, EXIT_OOM, EXIT_DEVICE, EXIT_DATA,
                                EXIT_INTERRUPTED})


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
RUN_NAME_SUFFIX = {"stress": "_stress", "seed-study": "_seed-study"}

# The residual arms and the two settings only some of them have: the launcher multiplies a setting's list only for
# the methods that have it (no duplicate jobs), and a run name carries a setting only where it differs from its
# default, so the run folders of the main matrix keep their names.
METHODS = ("baseline", "hc", "mhc", "mhc-lite", "identity-hc")
SINKHORN_METHODS = frozenset({"mhc"})                               # mhc-lite and identity-hc have no Sinkhorn
COEFFICIENT_METHODS = frozenset({"hc", "mhc", "mhc-lite", "identity-hc"})
ARM_DEFAULTS = {"sinkhorn_iters": 20, "coefficients": "token"}
PRESET_ARM_DEFAULTS = {"seed-study": {"coefficients": "sequence"}}  # the public study's per-sequence model
COEFFICIENT_SUFFIX = {"token": "_tok", "sequence": "_seq"}

RUN_NAME = re.compile(r"^(?P<method>[A-Za-z]+(?:-[A-Za-z]+)*)_d(?P<depth>\d+)_s(?P<seed>\d+)"
                      r"(?:_it(?P<sinkhorn_iters>\d+))?(?:_(?P<coefficients>tok|seq))?(?P<suffix>_[a-z][a-z-]*)?$")


def arm_settings(method, preset=None, sinkhorn_iters=None, coefficients=None):
    """(sinkhorn_iters, coefficients) as they apply to `method`: None where it has no such setting, the preset's
    default where not given."""
    defaults = {**ARM_DEFAULTS, **PRESET_ARM_DEFAULTS.get(preset, {})}
    iters = (sinkhorn_iters or defaults["sinkhorn_iters"]) if method in SINKHORN_METHODS else None
    coefficients = (coefficients or defaults["coefficients"]) if method in COEFFICIENT_METHODS else None
    return iters, coefficients


def run_name(method, depth, seed, preset=None, sinkhorn_iters=None, coefficients=None):
    """`{method}_d{depth}_s{seed}`, then `_it{N}` and `_seq`/`_tok` where they differ from the preset's defaults,
    then the preset's suffix: `hc_d48_s123`, `mhc_d32_s42_it100`, `hc_d32_s42_seq`, `hc_d32_s42_seed-study`."""
    defaults = {**ARM_DEFAULTS, **PRESET_ARM_DEFAULTS.get(preset, {})}
    iters, coefficients = arm_settings(method, preset, sinkhorn_iters, coefficients)
    arm = f"_it{iters}" if iters not in (None, defaults["sinkhorn_iters"]) else ""
    arm += COEFFICIENT_SUFFIX[coefficients] if coefficients not in (None, defaults["coefficients"]) else ""
    return f"{method}_d{depth}_s{seed}{arm}{RUN_NAME_SUFFIX.get(preset, '')}"
