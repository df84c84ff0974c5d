"""A frozen dataclass's fields as command-line flags, each flag's facts stated once, in its field.

train_c4.Config declares every setting with option(default, group, allowed, help); here that table becomes argparse
(--help grouped in field order), numbers parse as plain ASCII only, bounds (inclusive) and choices are checked, and
every refusal is one line (contract.ConfigError: exit 2).
"""
import argparse
import dataclasses
import re
import textwrap

from hcstudy.contract import ConfigError

INT64_MAX = 2 ** 63 - 1                         # torch.manual_seed and tensor sizes take int64
COUNT, NATURAL = (1, INT64_MAX), (0, INT64_MAX)  # the bounds of a count, and of a seed or a count that may be 0


def option(default, group: str, allowed: tuple | None, help: str, repeated: bool = False):
    """A flag's facts: default, --help group and line, what it allows (number: inclusive bounds, name: choices);
    a repeated flag is parsed as the list of its values (each may be comma separated)."""
    return dataclasses.field(default=default, metadata=dict(group=group, allowed=allowed, help=help, repeated=repeated))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def choices(config_class) -> dict:
    """{field: its allowed names} of every text field that has them."""
    return {f.name: f.metadata["allowed"] for f in dataclasses.fields(config_class) if f.type == "str"}


def _plain(convert, pattern: str):
    """int() and float() also take '1_0', full-width digits and spaces around the number: plain ASCII only."""
    def parse(text: str):
        return convert(text if re.fullmatch(pattern, text) else "")     # convert("") raises ValueError
    parse.__name__ = convert.__name__           # argparse's message: "invalid int value: '1_0'"
    return parse


NUMBER = r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?"
PARSE = {"int": _plain(int, r"[+-]?[0-9]+"), "float": _plain(float, NUMBER)}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose own checks raise `error_type` with one line instead of printing the usage block: the trainer,
    the launcher and the GPU check each turn it into their one line and exit 2. `usage_title` begins --help."""

    def __init__(self, *args, error_type: type[Exception] = ConfigError, hint: str = " (see --help)",
                 usage_title: str = "usage: ", **kwargs):
        super().__init__(*args, **kwargs)
        self.error_type, self.hint, self.usage_title = error_type, hint, usage_title

    def error(self, message):
        raise self.error_type(f"{message}{self.hint}")

    def format_help(self):
        return self.usage_title + super().format_help().removeprefix("usage: ")


def preset_names(given: list[str], presets: dict) -> list[str]:
    """The presets named by repeated and comma-separated --preset values, in order; an unknown one is refused."""
    names = [name.strip().lower() for value in given for name in value.split(",")]
    unknown = [name for name in names if name not in presets]
    if unknown:
        raise ConfigError(f"--preset: invalid choice: {unknown[0]!r} (choose from {', '.join(presets)}; combine "
                          "them as demo,seed-study)")
    defaults = [name for name in names if not presets[name]]
    if len(names) > 1 and defaults:         # "demo,c4" cannot mean both the demo and the defaults
        raise ConfigError(f"--preset {','.join(names)}: {defaults[0]} is the defaults and combines with no other")
    return names


def compose_presets(names: list[str], presets: dict, sized_for: dict) -> dict:
    """The settings of the presets `names`, in order, a later preset winning; but a setting sized for another
    (`sized_for`: {setting: the setting it is sized for}) stays that of the last preset that sets both, so that a
    buffer sized for one preset's small data is not replaced by a later preset's, sized for other data."""
    settings = {key: value for name in names for key, value in presets[name].items()}
    for preset in (presets[name] for name in names):
        settings |= {key: preset[key] for key, other in sized_for.items() if {key, other} <= preset.keys()}
    return settings


def presets_text(presets: dict) -> str:
    """The presets and what each one sets, for --help."""
    return "presets (applied in order: --preset demo,seed-study; explicit flags win):\n" + "\n".join(textwrap.fill(
        f"{name}: " + (", ".join(f"{flag(k)} {v}" for k, v in values.items()) or "the defaults above"),
        width=100, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False)
        for name, values in presets.items())


def build_parser(config_class, description: str, epilog: str) -> argparse.ArgumentParser:
    """One flag per field, in --help groups in field order; a flag not given stays out of the parsed namespace."""
    parser = OneLineErrorParser(description=description, epilog=epilog, argument_default=argparse.SUPPRESS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # argparse reads "-1e6" as a flag (it knows only "-1" and "-.5" as numbers): every plain number is a value
    parser._negative_number_matcher = re.compile(NUMBER.replace("[+-]?", "-", 1) + "$")
    fields, allowed_names = dataclasses.fields(config_class), choices(config_class)
    groups = {title: parser.add_argument_group(title) for title in dict.fromkeys(f.metadata["group"] for f in fields)}
    for field in fields:
        facts, group = field.metadata, groups[field.metadata["group"]]
        if field.type == "bool":        # --no-X too, so that a preset's switch can be turned back (not --no-no-X)
            negatable = not field.name.startswith("no_")
            group.add_argument(flag(field.name), action=argparse.BooleanOptionalAction if negatable else "store_true",
                               help=facts["help"])
        elif facts["repeated"]:
            group.add_argument(flag(field.name), action="append", help=facts["help"] + f" (default {field.default!r})")
        else:
            # every name a flag allows is lower case: --residual HC means hc
            parse = str.lower if allowed_names.get(field.name) else PARSE.get(field.type, str)
            group.add_argument(flag(field.name), type=parse, choices=allowed_names.get(field.name),
                               help=facts["help"] + f" (default {field.default!r}, or the preset's)")
    return parser


def refuse_unused(explicit: dict, arm: str, arms_of: dict) -> None:
    """A flag given for a setting the chosen arm does not have would change nothing: refused, naming the arms it
    is for (`arms_of`: {field: those arms, in order}). A preset's own fields are not given, so they stay silent."""
    for name, arms in arms_of.items():
        if name in explicit and arm not in arms:
            raise ConfigError(f"{flag(name)} has no effect on --residual {arm}; it applies to "
                              f"{', '.join(arms)}")


def check_bounds(cfg) -> None:
    """Every number within its field's inclusive bounds."""
    for field in dataclasses.fields(cfg):
        value, allowed = getattr(cfg, field.name), field.metadata["allowed"]
        if field.type in ("int", "float") and not allowed[0] <= value <= allowed[1]:
            low, high = ("2**63 - 1" if x == INT64_MAX else f"{x:,}" if isinstance(x, int) else f"{x:g}"
                         for x in allowed)
            raise ConfigError(f"{flag(field.name)} must be from {low} to {high}, got {value}")


def check_types(cfg) -> None:
    """Every field of the type of its default (an int where a float is meant) and, for names, one of its choices:
    what a command line guarantees, checked for a config read from a file."""
    allowed_names = choices(type(cfg))
    for field in dataclasses.fields(cfg):
        value, allowed = getattr(cfg, field.name), allowed_names.get(field.name)
        if not (type(value) is type(field.default) or type(field.default) is float and type(value) is int):
            raise ConfigError(f"{field.name} is {value!r}, not of the type {type(field.default).__name__}")
        if allowed and value not in allowed:
            raise ConfigError(f"{field.name} is {value!r}, not one of {', '.join(allowed)}")
