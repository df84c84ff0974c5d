"""README.md and docs/ stay true by what they show, not by how they say it: every command of their bash blocks is
accepted by the program it calls, and says `# GPU only` exactly when it needs a GPU; every path they name exists,
every relative link and anchor resolves, the README's python is the venv's, its arms are the registry's, and what
the commands write stays out of git. No test here reads a sentence or a section header."""
import dataclasses
import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from hcstudy import arms, consolidate, gpu_check  # noqa: E402
from hcstudy.config import parse_config  # noqa: E402
from hcstudy.contract import ConfigError  # noqa: E402
from hcstudy.launcher import jobs, options  # noqa: E402
from hcstudy.model import count_parameters  # noqa: E402
from hcstudy.report import command as report_command  # noqa: E402
import train_c4  # noqa: E402

README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]
PYTHONS = {"python", "python3", ".venv/bin/python"}
GPU_ONLY = "GPU only"
STUDY_SIZE = 100e6      # parameters from which a run trains only on a GPU (the study's are 1.7B and 2.5B)
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.M | re.S)


def split_comment(line: str) -> tuple[str, str]:
    """(the command, its comment): the comment starts at the first # outside quotes that opens a word."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip(), line[i + 1:].strip()
    return line.strip(), ""


@functools.cache
def commands(doc: Path) -> list[tuple[str, str]]:
    """(command, comment) for every command line of the doc's bash blocks, continuation lines joined."""
    found = []
    for indent, language, body in FENCE.findall(doc.read_text()):
        if language not in ("bash", "sh"):
            continue
        lines = [line[len(indent):] for line in body.splitlines()]
        joined = "\n".join(lines).replace("\\\n", " ")
        for line in joined.splitlines():
            command, comment = split_comment(line)
            if command:
                found.append((command, comment))
    return found


def simple_commands(command: str) -> list[list[str]]:
    """The programs a command line runs, as words: `A && B` is two; environment assignments, `nohup`, a trailing `&`
    and redirections are the shell's; `tmux new ... 'CMD'` runs CMD."""
    found = []
    for part in re.split(r"\s&&\s", command):
        words = shlex.split(part)
        while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):
            words = words[1:]
        if words[:1] == ["nohup"]:
            words = words[1:]
        cut = next((i for i, word in enumerate(words) if word == "&" or re.fullmatch(r"\d?>>?(&\d)?|\|", word)), None)
        words = words[:cut]
        if words[:2] == ["tmux", "new"]:
            found += simple_commands(words[-1])
        elif words:
            found.append(words)
    return found


# ---------------------------------------------------------------------------------------------------------------
# What each program says of its command line. Every check returns whether the command needs a GPU.

PARAMETERS = {}


def trains_the_study_size(cfg) -> bool:
    """A model of the study's size: counted on the meta device, once per model (seeds and run names aside)."""
    model = json.dumps({key: value for key, value in dataclasses.asdict(cfg).items()
                        if key not in ("seed", "run_name", "out", "data_seed")}, sort_keys=True, default=str)
    if model not in PARAMETERS:
        PARAMETERS[model] = count_parameters(cfg)["total"]
    return PARAMETERS[model] >= STUDY_SIZE


def check_trainer(args: list[str], where: Path) -> bool:
    """train_c4.py's own parser and checks; --consolidate with its source folder made where the command runs."""
    if "--consolidate" in args:
        source = where / args[args.index("--consolidate") + 1]
        source.mkdir(parents=True, exist_ok=True)
        consolidate.arguments(args)
        return False
    try:
        cfg = parse_config(args)
    except SystemExit as done:              # --help
        assert done.code in (0, None), f"train_c4.py {shlex.join(args)}: exit {done.code}"
        return False
    return not cfg.estimate and trains_the_study_size(cfg)


def check_launcher(args: list[str], where: Path) -> bool:
    """--check's flags go to the GPU check; everything else to the launcher, and every job it would run to the
    trainer's checks, with the flags the launcher gives it."""
    if "--check" in args:
        rest = [arg for arg in args if arg != "--check"]
        return not gpu_check.parse_args(rest).dry_run
    opt = options.parse_options(args)
    needs = False
    for job in jobs.matrix_jobs(opt):
        cfg = parse_config(jobs.trainer_flags(opt, job))
        needs |= trains_the_study_size(cfg)
    runs_here = not (opt.dry_run and not opt.calibrate) and not opt.summary and not opt.slurm
    return runs_here and needs


def check_setup(args: list[str], where: Path) -> bool:
    """setup.sh reads its flags in order before it does anything: a --help after them exits 0 only if each is known."""
    done = subprocess.run(["bash", "setup.sh", *args, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"bash setup.sh {shlex.join(args)}: {done.stderr.strip()}"
    return False


def check_report(args: list[str], where: Path) -> bool:
    report_command.parse_args(args)
    return False


def check_torchrun(args: list[str], where: Path) -> bool:
    from torch.distributed.run import parse_args
    parsed = parse_args(args)
    assert parsed.training_script == "train_c4.py", parsed.training_script
    return check_trainer(parsed.training_script_args, where)


def check_sbatch(args: list[str], where: Path) -> bool:
    """sbatch's own options, then the script and what it passes to the trainer (slurm/run.sbatch: every flag)."""
    script = next(arg for arg in args if arg.endswith(".sbatch"))
    assert (ROOT / script).is_file(), script
    rest = args[args.index(script) + 1:]
    if script == "slurm/run.sbatch" and rest[:1] != ["--matrix"]:
        return check_trainer(rest, where)
    return False


def check_pytest(args: list[str], where: Path) -> bool:
    """The command's own flags, collecting one test file; a marker expression must leave some tests out."""
    done = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-p", "no:cacheprovider",
                           str(Path(__file__).relative_to(ROOT))], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"pytest {shlex.join(args)}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    if "-m" in args:
        assert "deselected" in done.stdout, done.stdout[-2000:]
    return False


def check_benchmark(args: list[str], where: Path) -> bool:
    """A benchmark is a script of benchmarks/ that starts: its --help exits 0."""
    script = ROOT / args[0]
    assert script.is_file(), args[0]
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{args[0]} --help: {done.stderr[-2000:]}"
    return False


def lock_header() -> str:
    return "".join(line for line in (ROOT / "requirements-lock.txt").read_text().splitlines(True)
                   if line.startswith("#"))


def check_uv(args: list[str], where: Path) -> bool:
    """The lock is made by the command the docs show: its header holds it."""
    assert shlex.join(["uv", *args]) in lock_header(), shlex.join(["uv", *args])
    return False


def check_pip(args: list[str], where: Path) -> bool:
    """`pip install uv==X`: the uv the lock was made with."""
    (wanted,) = [arg for arg in args if arg.startswith("uv==")]
    assert args[0] == "install" and f"uv {wanted.split('==')[1]}" in lock_header(), args
    return False


def check(words: list[str], where: Path) -> bool:
    """Whether the command needs a GPU, after its program accepted it; a program no check knows fails."""
    if words[0] == "bash" and words[1:2] == ["setup.sh"]:
        return check_setup(words[2:], where)
    if words[0] == "bash" and words[1:2] == ["run_experiments.sh"]:
        return check_launcher(words[2:], where)
    if words[0] == "sbatch":
        return check_sbatch(words[1:], where)
    if words[0] in ("uv", "pip"):
        return {"uv": check_uv, "pip": check_pip}[words[0]](words[1:], where)
    if words[0] in PYTHONS and len(words) > 1:
        script, args = words[1], words[2:]
        handlers = {"train_c4.py": check_trainer, "report.py": check_report, "torchrun.py": check_torchrun}
        if script in handlers:
            return handlers[script](args, where)
        if script == "-m" and args[:1] == ["pytest"]:
            return check_pytest(args[1:], where)
        if script.startswith("benchmarks/"):
            return check_benchmark(words[1:], where)
    raise AssertionError(f"no check knows this command: {shlex.join(words)} (add one to {Path(__file__).name})")


def accepted(words: list[str], where: Path) -> bool:
    """check(), with a refusal (argparse's exit, the trainer's or launcher's one line) as the assertion it is."""
    try:
        return check(words, where)
    except SystemExit as done:
        raise AssertionError(f"{shlex.join(words)}: exit {done.code}") from None
    except (ConfigError, options.UsageError, ValueError) as error:
        raise AssertionError(f"{shlex.join(words)}: {error}") from None


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_every_command_the_docs_show_is_accepted_and_says_gpu_only_where_it_needs_one(doc, tmp_path, monkeypatch):
    """Each program's own parser and checks (the launcher's, with every job's flags as the trainer gets them);
    `# GPU only` exactly on the commands that train a model of the study's size or run the GPU check."""
    monkeypatch.chdir(tmp_path)             # relative --out and --consolidate folders land here
    wrong = []
    for command, comment in commands(doc):
        try:
            needs = any([accepted(words, tmp_path) for words in simple_commands(command)])
        except AssertionError as refused:
            wrong.append(str(refused))
            continue
        if needs != (GPU_ONLY in comment):
            wrong.append(f"{command} ({'needs a GPU' if needs else 'runs without a GPU'}; comment: {comment!r})")
    assert not wrong, wrong


def test_the_readme_shows_commands_and_ci_runs_exactly_its_set_up_and_test_commands():
    """.ci/run's commands (after its cd) are the README's: what CI proves is what a newcomer types."""
    shown = {command for command, _ in commands(README)}
    assert shown, "README.md shows no command in a bash block"
    lines = [split_comment(line)[0] for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci = [line for line in lines if line and not line.startswith(("set ", "cd "))]
    assert ci and all(line in shown for line in ci), (ci, sorted(shown))


def test_every_python_command_of_the_readme_uses_the_venv():
    """Outside the venv `python train_c4.py` fails (no torch); setup.sh puts everything in .venv."""
    words = [words for command, _ in commands(README) for words in simple_commands(command)]
    inline = re.findall(r"`([^`\n]+)`", FENCE.sub("", README.read_text()))
    words += [shlex.split(span) for span in inline if re.match(r"(python3?|\S*/python)\s", span)]
    assert words
    bare = [shlex.join(w) for w in words if w[0] in ("python", "python3") or w[0].endswith("/python")
            and w[0] != ".venv/bin/python"]
    assert not bare, bare


def test_the_readmes_arms_are_the_registrys():
    """The README's table of arms holds every registered arm, in the registry's order, each with its paper's arXiv
    number where its declaration names one."""
    text = README.read_text()
    own = {name: arm for name, arm in arms.load().items() if arm.file.parent == arms.HERE}     # not $HCSTUDY_ARMS'
    names = list(own)
    table = next(block for block in re.findall(r"(?:^\|.*\n)+", text, re.M)
                 if any(f"| `{name}` |" in block for name in names))
    rows = {re.match(r"\| `([^`]+)` \|", row).group(1): row for row in table.splitlines() if row.startswith("| `")}
    assert list(rows) == names, (list(rows), names)
    for name, row in rows.items():
        for number in re.findall(r"\d{4}\.\d{4,5}", own[name].paper):
            assert number in row, (name, number)


def test_what_the_docs_commands_write_is_ignored_by_git(tmp_path):
    """Weights consolidated into w/, several nodes' runs in all/, nohup's matrix.out: never untracked files."""
    written = ["runs/mhc_d4_s42/metrics.jsonl", "w/mhc.safetensors", "all/node0/matrix.log", "matrix.out"]
    done = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *written], capture_output=True,
                          text=True, timeout=60)
    if done.returncode == 128:
        pytest.skip("not a git checkout")
    assert done.stdout.split() == written, done.stdout


@pytest.mark.slow
def test_the_export_commands_work_as_printed(tmp_path):
    """The doc that shows the safetensors loading snippet: its --consolidate command into a folder a fresh clone does
    not have, then the snippet, saved as a file in a folder outside the repository and run by the printed command."""
    doc = next(doc for doc in DOCS if "PYTHONPATH=REPO" in doc.read_text())
    text = doc.read_text()
    snippet = next(body for _, language, body in FENCE.findall(text) if language == "python" and "safetensors" in body)
    consolidate_commands = [shlex.split(command) for command, _ in commands(doc) if "--consolidate" in command]
    consolidate_args = next(words for words in consolidate_commands if str(Path(words[4]).with_suffix(".json"))
                            in snippet)
    assert consolidate_args[:2] == [".venv/bin/python", "train_c4.py"]
    run_folder = consolidate_args[3]
    assert train_c4.main(["--preset", "tiny", "--steps", "2", "--out", str(tmp_path / Path(run_folder).parent),
                          "--run-name", Path(run_folder).name]) == 0
    done = subprocess.run([sys.executable, str(ROOT / "train_c4.py"), *consolidate_args[2:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    written = [tmp_path / Path(consolidate_args[4]).with_suffix(suffix) for suffix in (".pt", ".safetensors", ".json")]
    assert done.stdout.startswith(f"{consolidate_args[4]}, {written[1].name} and {written[2].name}: "), done.stdout
    umask = os.umask(0)
    os.umask(umask)
    assert {oct(path.stat().st_mode & 0o777) for path in written} == {oct(0o666 & ~umask)}
    (tmp_path / "load.py").write_text(snippet)
    path, python, script = shlex.split(re.search(r"`(PYTHONPATH=REPO [^`]+)`", text).group(1))
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
    """A renamed script (gpu_check.sh became gpu_check.py) or a moved module or page must not live on in the docs:
    every path they name exists, unless git ignores it (what a command writes, e.g. data/c4), and every bare file
    name (`plan.py`) is a file of the repository."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    names = {Path(path).name for path in tracked} | {"load.py"}      # load.py: a snippet the user saves
    named = set()
    for doc in DOCS:
        text = doc.read_text()
        named |= {(doc.name, path) for path in re.findall(
            r"\b((?:benchmarks|tests|slurm|hcstudy|docs|data)/[\w./-]*\w(?:\.(?:py|sh|sbatch))?)", text)}
        named |= {(doc.name, name) for name in re.findall(r"(?<![\w/.-])(\w+\.py)\b", text) if name not in names}
    missing = sorted((doc, path) for doc, path in named if not (ROOT / path).exists())
    if missing:
        asked = sorted({form for _, path in missing for form in (path, path + "/")})    # data/c4/: a folder's rule
        ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *asked], capture_output=True,
                                 text=True, timeout=60).stdout.split()
        missing = [(doc, path) for doc, path in missing if path not in ignored and path + "/" not in ignored]
    assert not missing, missing


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, code marks and punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen, found = {}, set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", FENCE.sub("", doc.read_text()), re.M):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def test_every_relative_link_of_the_docs_resolves():
    """[text](path) and ![image](path) point to a file of the repository, and #anchor to a heading of it."""
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):             # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append((doc.name, target, "no such file"))
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
                broken.append((doc.name, target, "no such heading"))
    assert not broken, broken


def test_the_link_check_sees_a_broken_link_and_anchor(tmp_path):
    """The checks above can fail: a missing page and a missing heading are seen."""
    page = tmp_path / "page.md"
    page.write_text("# A page: with `code`\n\n## Two words\n\n## Two words\n")
    assert anchors(page) == {"a-page-with-code", "two-words", "two-words-1"}
    assert slug("The demo on a 2-core CPU: measured against the planner") == \
        "the-demo-on-a-2-core-cpu-measured-against-the-planner"
