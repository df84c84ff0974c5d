"""The residual arms, one file each, and the one registry every part reads them from.

An arm's file holds its paper's formulas (a `Connection` module: H_pre, H_post, H_res and how the coefficients are
made) and, at its top, its declaration: a literal `ARM = dict(...)` with its name, its own settings and their
defaults, whether it has a Sinkhorn projection, the kernel paths it registers, and how the report labels and
draws it. The declaration is read here with `ast`, without importing the file: the launcher and the report know
every arm without torch, and the formulas are imported only where a model is built (`formulas`).

Adding an arm is one new file in this folder. Arms kept elsewhere (a test's throw-away arm, a user's trial) are
read from the folders named in $HCSTUDY_ARMS (separated by os.pathsep) the same way, by every process that
inherits it: the trainer, the launcher, the planner and the report.

Field of the declaration (the defaults of Arm below apply where one is left out):
  name, label, summary, paper   --residual's value, the report's label, one line for --help, its source
  order                         where it sorts in the CLI's choices, the matrix and the tables
  streams                       False for the plain residual alone: no streams, no coefficients, gain 1
  sinkhorn                      it projects H_res by Sinkhorn (takes --sinkhorn-iters, names runs _it{N})
  pilot                         run_experiments.sh --pilot runs it (docs/pilot.md)
  preset                        the --preset its source trained it with (the public study's arms: seed-study),
                                applied first: any --preset given and every flag still win
  kernels                       the fast paths its file registers in KERNEL_PATHS: "fused", "triton"
  settings                      its own flags: {name: (default, allowed, help)}, allowed the inclusive bounds
                                of a number, the choices of a name, None for a switch
  uses                          settings declared by another arm that it reads too (mHC's gates, say)
  style                         its line in the figures (matplotlib: color, ls, marker, zorder)
"""
import ast
import dataclasses
import functools
import importlib
import importlib.util
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXTRA_ARMS = "HCSTUDY_ARMS"


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    label: str
    summary: str
    paper: str
    file: Path
    order: int = 100
    streams: bool = True
    sinkhorn: bool = False
    pilot: bool = True
    preset: str = ""
    kernels: tuple = ()
    settings: dict = dataclasses.field(default_factory=dict)
    uses: tuple = ()
    style: dict = dataclasses.field(default_factory=dict)

    @property
    def paths(self) -> tuple:
        """Every --kernels path it has: the formulas, then what it registers."""
        return ("reference", *self.kernels)


class ArmError(Exception):
    """A declaration that cannot be read, or two arms that clash: one line naming the file."""


def declaration(path: Path) -> Arm:
    """The `ARM = dict(...)` literal at the top level of `path`."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["ARM"]:
            call = node.value
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "dict" and not call.args):
                raise ArmError(f"{path}: ARM must be dict(...) of literals")
            try:
                fields = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
                return Arm(file=path, **{k: tuple(v) if k in ("kernels", "uses") else v for k, v in fields.items()})
            except (ValueError, TypeError) as error:
                raise ArmError(f"{path}: ARM is not a declaration of literals ({error})") from None
    raise ArmError(f"{path}: no ARM = dict(...) declaration")


def arm_files() -> list[Path]:
    folders = [HERE, *(Path(p) for p in os.environ.get(EXTRA_ARMS, "").split(os.pathsep) if p)]
    return [path for folder in folders for path in sorted(folder.glob("[!_]*.py"))]


def load() -> dict:
    """{name: Arm} of every arm, in their order; a name or a setting declared twice is refused."""
    arms = sorted((declaration(path) for path in arm_files()), key=lambda arm: (arm.order, arm.name))
    names, owners = {}, {}
    for arm in arms:
        if arm.name in names:
            raise ArmError(f"{arm.file}: the arm {arm.name!r} is declared by {names[arm.name].file} too")
        names[arm.name] = arm
        for setting in arm.settings:
            if setting in owners:
                raise ArmError(f"{arm.file}: the setting {setting!r} is declared by the arm {owners[setting]} too")
            owners[setting] = arm.name
    return names


ARMS = load()
METHODS = tuple(ARMS)
# the settings every arm with streams reads (declared by the config: the body's, not an arm's)
STREAM_SETTINGS = ("coefficients", "expansion", "read_stream", "collapse", "dynamic_init_std", "kernels",
                   "no_mixing_decay", "mixing_norm", "mixing_precision")


def arms_of() -> dict:
    """{setting: the arms that read it, in order}: what a flag given for another arm would leave unchanged."""
    streams = tuple(name for name, arm in ARMS.items() if arm.streams)
    readers = {setting: streams for setting in STREAM_SETTINGS}
    for arm in ARMS.values():
        for setting in (*arm.settings, *arm.uses):
            readers.setdefault(setting, ())
            readers[setting] += (arm.name,)
    return readers


def declared_settings() -> tuple:
    """Every arm's own settings (the model's, like its width), in the arms' order."""
    return tuple(setting for arm in ARMS.values() for setting in arm.settings)


def with_sinkhorn() -> frozenset:
    return frozenset(name for name, arm in ARMS.items() if arm.sinkhorn)


def with_streams() -> frozenset:
    return frozenset(name for name, arm in ARMS.items() if arm.streams)


@functools.cache
def in_pilot() -> tuple:
    return tuple(name for name, arm in ARMS.items() if arm.pilot)


@functools.cache
def formulas(name: str):
    """The arm's module (torch): its Connection, and where it has them its validate(cfg) and res_logit_count(n)."""
    arm = ARMS[name]
    if arm.file.parent == HERE:
        return importlib.import_module(f"{__name__}.{arm.file.stem}")
    spec = importlib.util.spec_from_file_location(f"{__name__}._extra_{arm.file.stem}", arm.file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def connection(name: str) -> type:
    """The arm's connection module class: Connection(cfg, sublayer_index, path="reference")."""
    return formulas(name).Connection


def res_logit_count(name: str, n: int) -> int:
    """The logits a token's H_res is made from, as the arm's file counts them (0 where it has none)."""
    return getattr(formulas(name), "res_logit_count", lambda n: 0)(n)
