"""Small builders shared by the tests."""
import dataclasses
import os

import torch

from hcstudy.config import parse_config
from hcstudy.model import GPT


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


NO_AUTOCAST = lambda: torch.autocast("cpu", enabled=False)     # noqa: E731


def train_steps(cfg, steps, lr, seed=0):
    """`steps` AdamW steps of a tiny model on one fixed batch; the model and that batch."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    idx = torch.randint(0, 256, (4, 16))
    for _ in range(steps):
        model(idx, idx)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, idx
