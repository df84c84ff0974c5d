"""The multi-node command of docs/distributed.md on one machine: two torchrun "nodes" of 2 CPU processes each (gloo), joined
by a c10d rendezvous on 127.0.0.1, to completion under DDP and FSDP; a SIGTERM to one node's torchrun makes
every rank of both nodes save and exit 75, and the same command run again resumes to the losses of one process."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# 4 processes x micro-batch 1 = the tiny preset's global batch of 4; 4 streams so that each rank reads one
ARGS = ["--preset", "tiny", "--residual", "hc", "--steps", "12", "--data-streams", "4", "--micro-batch-size", "1"]
RUN = "hc_d2_s42"
LOSS_RTOL = 1e-5        # as in test_distributed.py: only the order of the gradient sums differs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(out: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(out / "hf_home"), "WANDB_MODE": "disabled", "TRAIN_C4_INJECT_NAN": ""}


def start_nodes(out: Path, parallel: str, port: int, *extra: str) -> list[subprocess.Popen]:
    """Both nodes' torchrun with the documented flags; node 0 hosts the rendezvous."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={RUN}",
               "--shutdown-timeout=60", str(ROOT / "train_c4.py"), *ARGS, "--parallel", parallel, "--out", str(out),
               *extra]
    out.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=out,
                             env=environment(out)) for _ in range(2)]


def finish(nodes: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    outputs = [node.communicate(timeout=300) for node in nodes]
    return [(node.returncode, *output) for node, output in zip(nodes, outputs)]


def losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    done = subprocess.run([sys.executable, str(ROOT / "train_c4.py"), *ARGS, "--out", str(out)], cwd=out,
                          capture_output=True, text=True, timeout=300, env=environment(out))
    assert done.returncode == 0, done.stderr
    return losses(out / RUN)


def assert_same_losses(run_dir: Path, reference: dict) -> None:
    got = losses(run_dir)
    assert got.keys() == reference.keys()
    assert max(abs(got[s] - reference[s]) / abs(reference[s]) for s in got) < LOSS_RTOL


@pytest.mark.slow
def test_two_nodes_train_to_completion_under_ddp(tmp_path, single):
    results = finish(start_nodes(tmp_path, "ddp", free_port()))
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-2000:]
    assert "micro-batch 1 x 1 accumulation steps x 4 process(es)" in results[0][1] + results[1][1]
    assert json.loads((tmp_path / RUN / "status.json").read_text())["state"] == "completed"
    assert_same_losses(tmp_path / RUN, single)


@pytest.mark.slow
def test_sigterm_to_one_node_saves_everywhere_and_the_rerun_resumes_under_fsdp(tmp_path, single):
    nodes = start_nodes(tmp_path, "fsdp", free_port())
    status_path = tmp_path / RUN / "status.json"
    while nodes[0].poll() is None and not (status_path.exists() and json.loads(status_path.read_text())["step"]):
        time.sleep(0.05)
    nodes[0].send_signal(signal.SIGTERM)                      # one node's scheduler stops it, not the other's
    results = finish(nodes)
    status = json.loads(status_path.read_text())
    assert status["state"] == "interrupted" and status["exit_code"] == 75, results[0][2][-2000:]
    assert 0 < status["step"] < 12, "the run finished before it could be stopped"
    stderr = results[0][2] + results[1][2]
    for rank in range(4):                                     # every rank of both nodes saved and exited 75
        assert f"\nrank {rank}: stopped by a signal at step {status['step']}" in stderr
    assert "exitcode  : 75" in stderr and all(code != 0 for code, _, _ in results)    # torchrun: 1, ranks: 75
    results = finish(start_nodes(tmp_path, "fsdp", free_port()))
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-2000:]
    assert f"resumed from {tmp_path / RUN / 'checkpoints' / ('step-' + str(status['step']))}" in results[0][1]
    assert_same_losses(tmp_path / RUN, single)


@pytest.mark.slow
def test_slurm_script_requeues_after_the_time_limit_signal_and_resumes(tmp_path, single):
    """slurm/run.sbatch under a fake SLURM (tests/support/fake_slurm: sbatch runs the script here on two "nodes", srun one
    task per node, --signal's SIGTERM delivered at step 4, scontrol requeue runs the job again)."""
    state = tmp_path / "slurm"
    state.mkdir()
    env = {**environment(tmp_path), "PATH": f"{ROOT / 'tests' / 'support' / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}",
           "PYTHON": sys.executable, "GPUS_PER_NODE": "2", "FAKE_SLURM_STATE": str(state),
           "FAKE_SLURM_TERM_AT_STEP": "4", "FAKE_SLURM_STATUS": str(tmp_path / "runs" / RUN / "status.json")}
    done = subprocess.run(["sbatch", "slurm/run.sbatch", *ARGS, "--parallel", "ddp", "--log-every", "1", "--out",
                           str(tmp_path / "runs")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (state / "log").read_text().splitlines() == ["requeued 1"]
    assert "the run's status: interrupted 75" in done.stdout and "the run's status: completed 0" in done.stdout
    assert "(restart 1) on 2 node(s), rendezvous on 127.0.0.1" in done.stdout
    assert_same_losses(tmp_path / "runs" / RUN, single)


@pytest.mark.slow
def test_the_matrix_as_a_slurm_job_array_then_the_report(tmp_path):
    """run_experiments.sh --slurm under the fake SLURM: one array task per run not yet finished (slurm/run.sbatch
    --matrix, one node, --gpus-per-run GPUs, --time from the plan), then the report job after the array; a second
    submission of the finished matrix submits nothing."""
    state, out = tmp_path / "slurm", tmp_path / "runs"
    state.mkdir()
    env = {**environment(tmp_path), "PATH": f"{ROOT / 'tests' / 'support' / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}",
           "PYTHON": sys.executable, "FAKE_SLURM_STATE": str(state), "RUN_EXPERIMENTS_NVIDIA_SMI": "false"}
    command = ["bash", str(ROOT / "run_experiments.sh"), "--slurm", "--residual", "hc,mhc", "--depth", "2", "--seed",
               "1", "--steps", "4", "--out", str(out), "--", "--preset", "tiny"]
    (out / "hc_d2_s1").mkdir(parents=True)        # finished before: not submitted (and one run less to train here)
    (out / "hc_d2_s1" / "status.json").write_text('{"state": "completed", "step": 4}')
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    array, report = (state / "submitted").read_text().splitlines()
    # tiny: its plan is mostly start-up (at most 5 min on a GPU node), x 1.25 + 10 min
    assert re.match(r"--parsable --array=0-0 --nodes=1 --gpus-per-node=1 --time=0:1[0-6]:\d\d ", array), array
    assert f"slurm/run.sbatch --matrix {out}/slurm-matrix-" in array
    assert report.startswith("--parsable --dependency=afterany:4243 ") and report.endswith(f"report.sbatch {out}")
    assert json.loads((out / "mhc_d2_s1" / "status.json").read_text())["state"] == "completed"
    assert (out / "report" / "results.md").is_file()
    assert "hc_d2_s1          skip (completed)" in done.stdout and "mhc_d2_s1         task 4243_0" in done.stdout
    assert "The report: job 4244" in done.stdout
    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "Nothing to submit" in again.stdout
    assert len((state / "submitted").read_text().splitlines()) == 2
