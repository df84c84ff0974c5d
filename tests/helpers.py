"""Small builders shared by the tests."""
import dataclasses
import os

import torch

from hcstudy.config import parse_config


def tiny_config(residual, **overrides):
    cfg = parse_config(["--preset", "tiny", "--residual", residual])
    return dataclasses.replace(cfg, **overrides)


def randomize_mixing(model, seed=0):
    """Move every mixing parameter away from its identity-like init so that mixing really happens."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_conn." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=generator))


class Exploit:
    """Unpickling it runs a shell command that creates `witness`: it must never happen."""

    def __init__(self, witness):
        self.witness = witness

    def __reduce__(self):
        return (os.system, (f"touch {self.witness}",))
