"""hcstudy/optim.py: which parameters AdamW decays, and the learning rate's warm-up and cosine decay."""
import pytest
import torch

from hcstudy.config import parse_config
from hcstudy.model import GPT
from hcstudy.optim import decay_groups, lr_at, make_optimizer
from helpers import tiny_config


def test_the_lr_warms_up_linearly_then_decays_by_a_cosine_to_its_floor():
    cfg = parse_config(["--preset", "tiny", "--lr", "1e-3", "--warmup", "4", "--steps", "14", "--min-lr-ratio", "0.1"])
    assert [lr_at(cfg, step) for step in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])   # one-step
    assert lr_at(cfg, 4) == pytest.approx(1e-3)                                 # the cosine's top
    assert lr_at(cfg, 9) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))            # halfway down
    assert lr_at(cfg, 14) == pytest.approx(1e-4) == lr_at(cfg, 100)            # the floor, and it stays there
    zero = parse_config(["--preset", "tiny", "--warmup", "4", "--warmup-from", "zero"])
    assert lr_at(zero, 0) == 0 and lr_at(zero, 2) == pytest.approx(zero.lr / 2)


def test_decay_falls_on_linear_and_embedding_weights_and_spares_the_mixing_when_asked():
    model = GPT(tiny_config("hc"))
    names = {id(p): name for name, p in model.named_parameters()}

    def decayed(**kw):
        decay, rest = decay_groups(model, 0.1, **kw)
        assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
        assert len(decay["params"]) + len(rest["params"]) == len(names)           # every parameter, once
        return {names[id(p)] for p in decay["params"]}

    default = decayed()
    assert default and all(name.endswith("weight") for name in default)
    assert not any("norm" in name or name.endswith("bias") for name in default)
    assert any("_conn." in name for name in default)
    assert not any("_conn." in name for name in decayed(decay_mixing=False))
    assert decayed(everything=True) == set(names.values())


def test_the_optimizer_takes_the_configs_lr_and_decay():
    cfg = tiny_config("baseline")
    optimizer = make_optimizer(GPT(cfg), cfg)
    assert [group["lr"] for group in optimizer.param_groups] == [cfg.lr, cfg.lr]
    assert [group["weight_decay"] for group in optimizer.param_groups] == [cfg.weight_decay, 0.0]
    assert optimizer.defaults["betas"] == (0.9, 0.95)
    assert all(p.dtype == torch.float32 for group in optimizer.param_groups for p in group["params"])
