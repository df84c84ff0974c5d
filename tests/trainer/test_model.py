"""The residual variants and the instability metrics of docs/model.md, on tiny CPU models."""

import pytest
import torch

from hcstudy.config import parse_config
from hcstudy.model import GPT, count_parameters
from hcstudy.optim import decay_groups


from helpers import randomize_mixing, tiny_config  # noqa: E402


@pytest.mark.parametrize("residual", ["hc", "mhc"])
def test_streams_persist_and_mixing_composes_across_depth(residual):
    torch.manual_seed(0)
    cfg = tiny_config(residual, depth=3, width=16, heads=2)
    model = GPT(cfg)
    randomize_mixing(model)
    x = torch.randn(2, 5, cfg.expansion, cfg.width)
    for block in model.blocks:
        assert block(x).shape == x.shape                  # every block maps (B, T, n, C) to (B, T, n, C)

    def run_from_block(state):
        for block in model.blocks:
            state = block(state)
        return state

    perturbed = x.clone()
    perturbed[..., 1, :] += 1.0                           # stream j = 1 entering sublayer k = 0
    with torch.no_grad():
        changed = (run_from_block(perturbed) - run_from_block(x)).abs().amax(dim=(0, 1, 3))
    assert (changed > 1e-4).sum() > 1, f"only stream(s) {changed.nonzero().flatten().tolist()} changed"


def test_forward_expands_once_and_collapses_once():
    cfg = tiny_config("hc", depth=2)
    model = GPT(cfg)
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: seen.append((args[0].shape, out.shape)))
    model(torch.randint(0, 256, (2, 8)))
    assert all(inp[-2] == cfg.expansion and out[-2] == cfg.expansion for inp, out in seen)


@pytest.mark.parametrize("residual", ["hc", "mhc"])
def test_the_state_stays_stream_major_through_every_block(residual):
    """(B, T, n, C) stored as (n, B, T, C): each stream one contiguous slab, which hcstudy/kernels/fused.py's speed relies on."""
    model = GPT(tiny_config(residual, depth=2), kernels="fused")
    layouts = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: layouts.extend(
            t.movedim(-2, 0).is_contiguous() for t in (args[0], out)))
    model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))[1].backward()
    assert layouts == [True] * 4


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
@pytest.mark.parametrize("depth, expected", [(32, 1.73e9), (48, 2.54e9)])
def test_parameter_counts_of_the_c4_models(residual, depth, expected):
    cfg = parse_config(["--residual", residual, "--depth", str(depth)])
    assert (cfg.width, cfg.heads, cfg.seq_len) == (2048, 32, 1024)
    total = count_parameters(cfg)["total"]
    assert abs(total - expected) / expected < 0.02, f"{total:,}"


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
def test_meta_count_equals_the_real_model(residual):
    cfg = tiny_config(residual, depth=3, width=32, heads=4)
    assert count_parameters(cfg)["total"] == sum(p.numel() for p in GPT(cfg).parameters())


def test_weight_decay_only_on_weight_matrices():
    model = GPT(tiny_config("hc", depth=1))
    decay, rest = decay_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert "blocks.0.attn_conn.dynamic.weight" in decayed and "wte.weight" in decayed
    assert not any(k in n for n in decayed for k in ("static", "s_a", "s_b", "norm", "ln_f"))
    mhc = GPT(tiny_config("mhc", depth=1))
    names = {id(p): n for n, p in mhc.named_parameters()}
    decayed = {names[id(p)] for p in decay_groups(mhc, 0.1)[0]["params"]}
    assert "blocks.0.mlp_conn.phi.weight" in decayed
    assert not any(k in n for n in decayed for k in ("a_pre", "b_pre", "b_res", "b_post", "a_res"))
    for residual, dynamic in (("hc", "dynamic.weight"), ("mhc", "phi.weight")):       # --no-mixing-decay
        model = GPT(tiny_config(residual, depth=1))
        names = {id(p): n for n, p in model.named_parameters()}
        decay, rest = decay_groups(model, 0.1, decay_mixing=False)
        decayed, kept = {names[id(p)] for p in decay["params"]}, {names[id(p)] for p in rest["params"]}
        assert "wte.weight" in decayed and not any("_conn." in n for n in decayed)
        assert f"blocks.0.attn_conn.{dynamic}" in kept and len(decayed) + len(kept) == len(names)


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
def test_activation_checkpointing_gives_identical_gradients(residual):
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = GPT(tiny_config(residual, activation_checkpointing=checkpointing))
        randomize_mixing(model)
        model(idx, idx)[1].backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
def test_bf16_autocast_agrees_with_fp32(residual):
    torch.manual_seed(0)
    model = GPT(tiny_config(residual))
    idx = torch.randint(0, 256, (2, 16))
    full = model(idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = model(idx)
        _, _, H_res, _ = model.blocks[0].attn_conn.coefficients(torch.randn(1, 1, 4, 16)) if residual != "baseline" \
            else (None, None, torch.zeros(1, dtype=torch.float32), None)
    assert H_res.dtype == torch.float32                    # mixing coefficients stay fp32 under autocast
    torch.testing.assert_close(half.float(), full, rtol=0.05, atol=0.05)


def test_collapse_first_reads_stream_zero_only():
    torch.manual_seed(0)
    model = GPT(tiny_config("hc", depth=1, collapse="first"))
    randomize_mixing(model)
    last = []
    model.blocks[-1].register_forward_hook(lambda module, args, out: last.append(out) or out.retain_grad())
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    assert last[0].grad[..., 1:, :].abs().max() == 0 and last[0].grad[..., 0, :].abs().max() > 0
