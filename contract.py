"""contract.py: what the trainer, the launcher and the report agree on, written once.

train_c4.py exits with these codes and names its runs this way; matrix.py (behind run_experiments.sh) acts on
the codes and builds the same names; report.py parses them. The errors below carry those codes: the trainer
raises them, and so can a module beside it without importing train_c4. Standard library only: the launcher
imports it without torch.
"""
import re

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


# A preset that changes the recipe gets its own run names, so its runs share an out folder with the main matrix.
RUN_NAME_SUFFIX = {"stress": "_stress"}
RUN_NAME = re.compile(r"^(?P<method>[A-Za-z]+)_d(?P<depth>\d+)_s(?P<seed>\d+)(?P<suffix>_[a-z]+)?$")


def run_name(method, depth, seed, preset=None):
    """`{method}_d{depth}_s{seed}`, plus the preset's suffix (`hc_d48_s123`, `mhc_d32_s42_stress`)."""
    return f"{method}_d{depth}_s{seed}{RUN_NAME_SUFFIX.get(preset, '')}"
