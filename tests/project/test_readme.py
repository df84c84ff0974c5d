"""README.md stays true: short, every command as printed works after `bash setup.sh`, the GPU path's state said."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from hcstudy.launcher import options  # noqa: E402
import train_c4  # noqa: E402

README = (ROOT / "README.md").read_text()


def commands():
    """Every command line of the README: the lines of its bash blocks and its inline `code`, comments cut."""
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines + re.findall(r"`([^`\n]+)`", README) if line]


def test_every_python_command_uses_the_venv():
    """Outside the venv `python train_c4.py` fails (no tiktoken); setup.sh puts everything in .venv."""
    bare = [c for c in commands() if re.search(r"(?<![\w/.-])python3?\s", c)]
    assert not bare, bare
    assert "source .venv/bin/activate" in README


def test_every_launcher_command_parses():
    launcher = [c for c in commands() if c.startswith("bash run_experiments.sh")]
    assert len(launcher) >= 8
    for command in launcher:
        words = shlex.split(command.split(">")[0].rstrip("&").strip())[2:]
        words = words[:words.index("--")] if "--" in words else words      # then the trainer's flags
        if words[:1] != ["--check"]:                   # --check is answered by the bash side
            options.build_parser().parse_args(words)


def test_the_gpu_section_says_what_has_run_on_a_gpu_and_which_path_a_run_takes():
    section = README.split("## On a GPU node", 1)[1]
    assert section.lstrip().startswith("The GPU path has run on one H200") and "No H100 has timed it" in section
    assert section.index("bash run_experiments.sh --check") < section.index("train_c4.py --depth")
    assert "result.json" in section and "docs/planning.md" in section      # result.json's format is there
    assert "**Which path a GPU run takes**" in section and "self-check" in section
    planning = (ROOT / "docs" / "planning.md").read_text()
    for key in ("step_seconds", "tokens_per_step", "timings"):
        assert f"`{key}`" in planning


def test_every_command_that_needs_a_gpu_says_so():
    """A depth-32 or 48 run, or a matrix of them, refuses on the CPU (48.2 GiB at depth 48): its comment says so."""
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    lines = [line for block in blocks for line in block.splitlines()]
    gpu = [line for line in lines if re.match(r"\.venv/bin/python train_c4\.py --depth (32|48)", line)
           or re.match(r"bash run_experiments\.sh --(full|quick|stress|check)\b(?!.*--dry-run)", line)]
    assert len(gpu) == 6 and all("# GPU only" in line for line in gpu), gpu


def test_what_the_readmes_commands_write_is_ignored_by_git(tmp_path):
    """Weights consolidated into w/, several nodes' runs in all/, nohup's matrix.out: never untracked files."""
    written = ["runs/mhc_d4_s42/metrics.jsonl", "w/mhc.safetensors", "all/node0/matrix.log", "matrix.out"]
    done = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *written], capture_output=True,
                          text=True, timeout=60)
    if done.returncode == 128:
        pytest.skip("not a git checkout")
    assert done.stdout.split() == written, done.stdout


def test_long_matrices_say_how_to_detach_and_come_back():
    section = README.split("## Long matrices", 1)[1].split("\n## ", 1)[0]
    assert "tmux attach" in section and "nohup" in section and "--summary" in section and "SIGHUP" in section


@pytest.mark.slow
def test_the_export_commands_work_as_printed(tmp_path):
    """--consolidate into a folder a fresh clone does not have, then the loading snippet, saved as a file in a
    folder outside the repository and run there by the printed command."""
    consolidate = shlex.split(next(c for c in commands() if "--consolidate" in c))
    assert consolidate[:2] == [".venv/bin/python", "train_c4.py"]
    run_folder = consolidate[3]
    assert train_c4.main(["--preset", "tiny", "--steps", "2", "--out", str(tmp_path / Path(run_folder).parent),
                          "--run-name", Path(run_folder).name]) == 0
    done = subprocess.run([sys.executable, str(ROOT / "train_c4.py"), *consolidate[2:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    written = [tmp_path / Path(consolidate[4]).with_suffix(suffix) for suffix in (".pt", ".safetensors", ".json")]
    assert done.stdout.startswith(f"{consolidate[4]}, {written[1].name} and {written[2].name}: "), done.stdout
    umask = os.umask(0)
    os.umask(umask)
    assert {oct(path.stat().st_mode & 0o777) for path in written} == {oct(0o666 & ~umask)}
    (tmp_path / "load.py").write_text(re.search(r"```python\n(.*?)```", README, re.S).group(1))
    path, python, script = shlex.split(re.search(r"`(PYTHONPATH=REPO [^`]+)`", README).group(1))
    assert path == "PYTHONPATH=REPO" and python == "REPO/.venv/bin/python"
    loaded = subprocess.run([sys.executable, script], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr


def test_the_trainer_under_a_python_without_the_packages_names_the_venv():
    """-S: no site-packages, as with a system python that setup.sh never touched."""
    done = subprocess.run([sys.executable, "-S", str(ROOT / "train_c4.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "has no torch" in done.stderr and "`.venv/bin/python train_c4.py`" in done.stderr


@pytest.mark.slow
def test_the_printed_plans_of_docs_planning_are_what_the_commands_print():
    """benchmarks/doc_plans.py regenerates them; stale blocks fail here until it is run."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "doc_plans.py"), "--check"], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr


def test_every_file_the_docs_name_exists():
    """A renamed script (gpu_check.sh became gpu_check.py) or a moved module must not live on in the docs: every path
    they name exists, and every bare file name (`plan.py`) is a file of the repository."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    names = {Path(path).name for path in tracked} | {"load.py"}      # load.py: README's snippet, saved by the user
    named = set()
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "tests").glob("README.md")]:
        text = doc.read_text()
        named |= {(doc.name, path) for path in re.findall(
            r"\b((?:benchmarks|tests|slurm|hcstudy)/[\w./-]*\w(?:\.(?:py|sh|sbatch))?)", text)}
        named |= {(doc.name, name) for name in re.findall(r"(?<![\w/.-])(\w+\.py)\b", text) if name not in names}
    missing = sorted((doc, path) for doc, path in named if not (ROOT / path).exists())
    assert not missing, missing
