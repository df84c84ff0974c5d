"""README.md stays true: short, every command as printed works after `bash setup.sh`, the GPU path's state said."""
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import matrix  # noqa: E402

README = (ROOT / "README.md").read_text()


def commands():
    """Every command line of the README: the lines of its bash blocks and its inline `code`, comments cut."""
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines + re.findall(r"`([^`\n]+)`", README) if line]


def test_readme_is_at_most_15_kb():
    assert len(README.encode()) <= 15_000


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
            matrix.build_parser().parse_args(words)


def test_the_gpu_section_says_what_has_run_on_a_gpu_and_which_path_a_run_takes():
    section = README.split("## On a GPU node", 1)[1]
    assert section.lstrip().startswith("The GPU path has run on one H200") and "No H100 has timed it" in section
    assert section.index("bash run_experiments.sh --check") < section.index("train_c4.py --depth")
    assert "result.json" in section and "docs/planning.md" in section      # result.json's format is there
    assert "**Which path a GPU run takes**" in section and "self-check" in section
    planning = (ROOT / "docs" / "planning.md").read_text()
    for key in ("step_seconds", "tokens_per_step", "timings"):
        assert f"`{key}`" in planning


def test_long_matrices_say_how_to_detach_and_come_back():
    section = README.split("## Long matrices", 1)[1].split("\n## ", 1)[0]
    assert "tmux attach" in section and "nohup" in section and "--summary" in section and "SIGHUP" in section
