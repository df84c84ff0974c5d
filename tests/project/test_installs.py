"""The lock: every requirement pinned to one version per environment, inside the range it allows."""
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def requirements(name):
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            yield Requirement(line)


def test_the_lock_pins_every_requirement_inside_its_range():
    lock = (ROOT / "requirements-lock.txt").read_text()
    assert "uv pip compile requirements-dev.txt" in lock.splitlines()[1]       # how to regenerate it
    pins = {}
    for pin in requirements("requirements-lock.txt"):
        assert len(pin.specifier) == 1 and next(iter(pin.specifier)).operator == "==", pin
        pins.setdefault(canonicalize_name(pin.name), []).append(pin)
    for wanted in [*requirements("requirements.txt"), *requirements("requirements-dev.txt")]:
        pinned = pins.get(canonicalize_name(wanted.name))
        assert pinned, f"{wanted.name} is not in requirements-lock.txt: regenerate it (docs/installs.md)"
        for pin in pinned:
            assert wanted.specifier.contains(next(iter(pin.specifier)).version, prereleases=True), (wanted, pin)
