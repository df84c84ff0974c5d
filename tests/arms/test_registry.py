"""hcstudy/arms: one file an arm, one registry every part reads. A throw-away arm in a folder of the test's own,
named by $HCSTUDY_ARMS, is seen by the CLI, the trainer, the launcher's dry run, the planner and the report without
an edit of the package."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hcstudy import arms, contract
from hcstudy.config import Config, parse_config
from hcstudy.report.runs import METHOD_LABEL

ROOT = Path(__file__).resolve().parents[2]
TRIAL = '''"""A throw-away arm for the registry's test: mHC's read and write, H_res = I."""
import torch

from hcstudy.arms import mhc

ARM = dict(
    name="trial", label="Trial-HC", order=50,
    summary="a test's arm", paper="none",
    uses=("mhc_gate_init", "mhc_pre_bias", "mhc_post_bias"),
    settings={"trial_knob": (3, (0, 10), "a setting only this arm has")},
    style={"color": "tab:olive", "ls": "-", "marker": "*", "zorder": 3},
)


class Connection(mhc.Connection):
    res_logit_count = staticmethod(lambda n: 0)
    KERNEL_PATHS = {}

    def mixing(self, z_res):
        return torch.eye(self.n, dtype=z_res.dtype).expand(*z_res.shape[:-1], self.n, self.n), None
'''


def test_every_arm_file_declares_what_it_registers():
    for name, arm in arms.ARMS.items():
        module = arms.formulas(name)
        assert arm.file.name == name.replace("-", "_") + ".py" and arm.label and arm.summary and arm.paper
        assert set(getattr(module.Connection, "KERNEL_PATHS", {})) == set(arm.kernels), name
        fields = {field.name for field in dataclasses.fields(Config)}
        assert set(arm.settings) | set(arm.uses) <= fields, name
        assert METHOD_LABEL[name] == arm.label
    assert len({arm.label for arm in arms.ARMS.values()}) == len(arms.ARMS)
    assert contract.METHODS[:3] == ("baseline", "hc", "mhc")          # the order the tables and the matrix keep


def test_a_setting_given_for_an_arm_without_it_is_refused_naming_those_that_have_it():
    from hcstudy.contract import ConfigError
    with pytest.raises(ConfigError, match="--sinkhorn-iters has no effect on --residual kromhc; it applies to mhc"):
        parse_config(["--preset", "tiny", "--residual", "kromhc", "--sinkhorn-iters", "5"])


@pytest.mark.parametrize("second, message", [
    ("ARM = dict(name='mhc', label='x', summary='x', paper='x')\n", "the arm 'mhc' is declared by"),
    ("ARM = dict(name='other', label='x', summary='x', paper='x', settings={'sinkhorn_iters': (1, (1, 2), 'x')})\n",
     "the setting 'sinkhorn_iters' is declared by the arm mhc too"),
    ("ARM = dict(name=NAME, label='x', summary='x', paper='x')\n", "ARM is not a declaration of literals"),
    ("ARM = {'name': 'x'}\n", "ARM must be dict(...) of literals"),
    ("X = 1\n", "no ARM = dict(...) declaration"),
])
def test_a_clashing_or_unreadable_declaration_is_one_line_naming_its_file(tmp_path, second, message):
    (tmp_path / "bad.py").write_text(second)
    done = subprocess.run([sys.executable, "-c", "import hcstudy.arms"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, arms.EXTRA_ARMS: str(tmp_path)})
    assert done.returncode != 0 and message in done.stderr and "bad.py" in done.stderr


def test_a_throw_away_arm_is_seen_by_the_cli_the_trainer_the_dry_run_the_planner_and_the_report(tmp_path):
    folder = tmp_path / "arms"
    folder.mkdir()
    (folder / "trial.py").write_text(TRIAL)
    env = {**os.environ, arms.EXTRA_ARMS: str(folder), "RUN_EXPERIMENTS_NVIDIA_SMI": "false"}

    def run(*command, **kwargs):
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, **kwargs)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout

    python = sys.executable
    help_text = run(python, "train_c4.py", "--help")
    assert "trial," in help_text and "--trial-knob" in help_text and "the Trial-HC arm" in help_text
    out = tmp_path / "runs"
    run(python, "train_c4.py", "--preset", "tiny", "--residual", "trial", "--steps", "4", "--out", str(out))
    last = json.loads((out / "trial_d2_s42" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["amax_fwd"] == last["amax_bwd"] == 1.0 and "res_to_identity" in last
    assert json.loads((out / "trial_d2_s42" / "config.json").read_text())["config"]["trial_knob"] == 3
    estimate = run(python, "train_c4.py", "--residual", "trial", "--depth", "4", "--estimate")
    assert "trial depth 4" in estimate
    dry = run("bash", "run_experiments.sh", "--demo", "--residual", "trial,mhc", "--dry-run",
              "--out", str(tmp_path / "d"))
    assert "trial_d4_s42" in dry and "mhc_d4_s42" in dry and "min (modelled)" in dry
    run(python, "report.py", str(out))
    assert "Trial-HC" in (out / "report" / "results.md").read_text()
