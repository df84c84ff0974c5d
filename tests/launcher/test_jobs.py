"""hcstudy/launcher/jobs.py: the matrix's jobs, the GPUs each gets, the nodes they are split over, each job's trainer
flags. run_experiments.sh runs tests/support/fake_trainer.py and fake_probe.py on pretend GPUs: no GPU, no torch."""
import re
import shutil
import subprocess
from pathlib import Path

from launcher_harness import PY, invocations, launch, launcher_env, launches, needs_bash, start, status


ROOT = Path(__file__).resolve().parents[2]
pytestmark = needs_bash


def test_gpus_per_run_gives_each_job_its_gpus_and_fsdp(tmp_path):
    out = tmp_path / "runs"
    r = launch(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1",
               "--gpus", "0,1,2,3", "--gpus-per-run", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    seen = set()
    for run in ("hc_d2_s1", "mhc_d2_s1"):
        (inv,) = invocations(out, run)
        seen.add(inv["cuda_visible_devices"])
        assert inv["argv"][inv["argv"].index("--parallel") + 1] == "fsdp"
    assert seen == {"0,1", "2,3"}


def test_exclude_gpus(tmp_path):
    out = tmp_path / "runs"
    r = launch(tmp_path, "--methods", "baseline,hc,mhc", "--depths", "2", "--seeds", "1",
               "--gpus", "0,1,2", "--exclude-gpus", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert {gpus for _, _, gpus in launches(out)} <= {"0", "2"}


def test_matrix_split_over_two_nodes_runs_each_job_once(tmp_path):
    """Two launchers on one shared out folder, --nodes 2 with ranks 0 and 1, side by side: each runs every other
    job of the queue, with its own lock and matrix log, and together they run the whole matrix once."""
    out = tmp_path / "runs"
    matrix = ["--methods", "baseline,hc,mhc", "--depths", "2,3", "--seeds", "1", "--gpus", "0,1", "--nodes", "2"]
    nodes = [start(tmp_path, *matrix, "--node-rank", str(i), env=launcher_env(tmp_path)) for i in (0, 1)]
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    ran = [[run for _, run, _ in launches(out, log=f"matrix.node{i}.log")] for i in (0, 1)]
    assert ran == [["baseline_d3_s1", "mhc_d3_s1", "hc_d2_s1"], ["hc_d3_s1", "baseline_d2_s1", "mhc_d2_s1"]]
    for run in ran[0] + ran[1]:
        assert status(out, run)["state"] == "completed" and len(invocations(out, run)) == 1
    assert not (out / "matrix.log").exists()
    r = launch(tmp_path, "--summary")                     # from any shell: both nodes' shares as one matrix
    assert r.returncode == 0 and "6 done, 0 running, 0 queued, 0 failed" in r.stdout, r.stdout + r.stderr
    # nodes without a shared file system: each node's folder copied back, the report merges them
    for i in (0, 1):
        for run in ran[i]:
            shutil.copytree(out / run, tmp_path / "all" / f"node{i}" / run)
    tables = [subprocess.run([PY, str(ROOT / "report.py"), *folders, "--no-plots", "--report-dir", str(tmp_path / name)],
                             capture_output=True, text=True, cwd=ROOT) for name, folders in
              (("merged", [tmp_path / "all" / "node0", tmp_path / "all" / "node1"]), ("shared", [out]))]
    assert [t.returncode for t in tables] == [0, 0], tables
    assert (tmp_path / "merged" / "runs.csv").read_text() == (tmp_path / "shared" / "runs.csv").read_text()
    r = launch(tmp_path, "--dry-run", *matrix, "--node-rank", "1", out=tmp_path / "elsewhere")
    assert r.returncode == 0 and re.search(r"^hc_d3_s1 +node 1 GPU 0 ", r.stdout, re.MULTILINE), r.stdout
    assert re.search(r"^mhc_d2_s1 +node 1 next free slot ", r.stdout, re.MULTILINE)
    r = launch(tmp_path, "--dry-run", *matrix, "--node-rank", "1")
    assert r.returncode == 0 and re.search(r"^baseline_d3_s1 +skip \(completed\)", r.stdout, re.MULTILINE)


def test_stress_arm_and_data_order_varied_with_the_seed(tmp_path):
    r = launch(tmp_path, "--stress", "--dry-run", "--vary-data-seed", "--seeds", "42,7")
    assert r.returncode == 0, r.stderr
    names = {f"{m}_d{d}_s{s}_stress" for m in ("hc", "mhc") for d in (32, 48, 64) for s in (42, 7)}
    assert names <= set(r.stdout.split()) and "baseline_" not in r.stdout
    assert r.stdout.count("--preset stress") == 12
    assert r.stdout.count("--seed 7 ") == r.stdout.count("--data-seed 7 ") == 6
    r = launch(tmp_path, "--quick", "--dry-run", "--vary-data-seed", "--", "--data-seed", "3")
    assert r.returncode == 2 and "--vary-data-seed sets --data-seed for each run" in r.stderr
    r = launch(tmp_path, "--stress", "--dry-run", "--", "--preset", "tiny")
    assert r.returncode == 2 and "--stress sets --preset stress" in r.stderr
