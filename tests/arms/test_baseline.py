"""hcstudy/arms/baseline.py: the pre-norm residual of one stream, whose every gain is exactly 1."""
import torch

from hcstudy.metrics import instability_probe
from hcstudy.model import GPT
from helpers import tiny_config


def test_baseline_gains_are_exactly_one():
    model = GPT(tiny_config("baseline", depth=2))
    metrics = instability_probe(model, torch.randint(0, 256, (2, 8)), lambda: torch.autocast("cpu", enabled=False),
                                  with_layers=True)
    assert metrics["layer_gain_fwd"] == [1.0] * 4 and metrics["layer_gain_bwd"] == [1.0] * 4
    assert all(metrics[k] == 1.0 for k in ("amax_fwd", "amax_bwd", "amax_fwd_abs", "amax_bwd_abs", "amax_l0_fwd"))
