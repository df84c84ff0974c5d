"""The GPU check's context at its tiny sizes, shared by the check's tests."""
import pytest

from hcstudy import check_parts


H100 = "NVIDIA H100 80GB HBM3"
MODELLED = [0.01, 0.02]         # the tests' step model: the planner's own is counted by tests/planner/test_step_work.py


@pytest.fixture(scope="module")
def tiny():
    """A --cpu-tiny context and plan for three arms (baseline and mhc required, hc optional), the planner's step model
    replaced by a fixed range: the plan's logic, not the model's counts (seconds per arm on this CPU)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(check_parts, "METHODS", ("baseline", "hc", "mhc"))
        patch.setattr(check_parts, "REQUIRED_ARMS", ("baseline", "mhc"))
        patch.setattr(check_parts.Context, "modelled", lambda self, cfg, micro, path: list(MODELLED))
        ctx = check_parts.Context(tiny=True, plan_only=False)
        yield ctx, check_parts.plan_parts(ctx, 1000.0)


def by_name(parts):
    return {part.name: part for part in parts}
