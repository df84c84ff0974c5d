"""hcstudy/config_flags.py: Config's fields as flags, presets composed in order, one-line errors, every setting
checked against its bounds and its type."""
import dataclasses

import pytest

from hcstudy import config_flags as flags
from hcstudy.config import Config, parse_config
from hcstudy.contract import ConfigError

PRESETS = {"c4": {}, "demo": {"depth": 4, "data": "sample", "shuffle_buffer": 64},
           "seed-study": {"steps": 50, "data": "c4", "shuffle_buffer": 10_000}, "fast": {"steps": 5}}


def test_flags_are_the_field_names_with_dashes():
    assert flags.flag("micro_batch_size") == "--micro-batch-size"


def test_presets_combine_in_order_a_later_one_winning_but_a_size_stays_with_its_data():
    names = flags.preset_names(["demo,seed-study", "FAST"], PRESETS)
    assert names == ["demo", "seed-study", "fast"]
    settings = flags.compose_presets(names, PRESETS, {"shuffle_buffer": "data"})
    assert settings == {"depth": 4, "data": "c4", "shuffle_buffer": 10_000, "steps": 5}
    # the buffer sized for the demo's data is kept where the later preset sets steps only
    assert flags.compose_presets(["seed-study", "demo"], PRESETS, {"shuffle_buffer": "data"})["shuffle_buffer"] == 64


@pytest.mark.parametrize("given, message", [(["nope"], "--preset: invalid choice: 'nope'"),
                                            (["demo,c4"], "c4 is the defaults and combines with no other")])
def test_an_unknown_preset_or_the_defaults_combined_are_refused(given, message):
    with pytest.raises(ConfigError, match=message):
        flags.preset_names(given, PRESETS)


@pytest.mark.parametrize("text", ["1_0", "１０", " 10", "0x10", ""])
def test_numbers_are_plain_ascii_only(text):
    with pytest.raises(ConfigError, match="invalid int value"):
        parse_config(["--depth", text])


def test_a_parser_error_is_one_line_with_its_hint():
    parser = flags.OneLineErrorParser(prog="x", hint=" (try --help)")
    parser.add_argument("--n", type=int)
    with pytest.raises(ConfigError) as error:
        parser.parse_args(["--n", "two"])
    assert "\n" not in str(error.value) and str(error.value).endswith(" (try --help)")


def test_a_setting_for_another_arm_is_refused_naming_the_arms_it_is_for():
    with pytest.raises(ConfigError, match="--sinkhorn-iters has no effect on --residual hc; it applies to mhc"):
        flags.refuse_unused({"sinkhorn_iters": 5}, "hc", {"sinkhorn_iters": ("mhc",)})
    flags.refuse_unused({"sinkhorn_iters": 5}, "mhc", {"sinkhorn_iters": ("mhc",)})


def test_a_config_read_from_a_file_is_checked_for_bounds_and_types():
    cfg = Config()
    flags.check_bounds(cfg), flags.check_types(cfg)
    with pytest.raises(ConfigError, match="--depth must be from"):
        flags.check_bounds(dataclasses.replace(cfg, depth=0))
    with pytest.raises(ConfigError, match="depth is '4', not of the type int"):
        flags.check_types(dataclasses.replace(cfg, depth="4"))
    with pytest.raises(ConfigError, match="residual is 'nope', not one of"):
        flags.check_types(dataclasses.replace(cfg, residual="nope"))
    flags.check_types(dataclasses.replace(cfg, lr=1))         # an int where a float is meant is a number
