"""hcstudy/planner/memory.py: parameter counts, the memory plan against the real tensors and the bytes autograd
saves, the depth 32 / 48 plans behind the public reproduction's out-of-memory story, --micro-batch-size auto."""
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from hcstudy.kernels import triton_library
from hcstudy.planner import gpus
from hcstudy.planner import memory as memory_module
from hcstudy.config import parse_config
from hcstudy.model import GPT, count_parameters
from hcstudy.optim import decay_groups
from hcstudy.planner.memory import batch_plan


ROOT = Path(__file__).resolve().parents[2]
CARD = 80 * memory_module.GiB


SMALL_CONFIGS = ([], ["--width", "48", "--heads", "3", "--depth", "3", "--expansion", "3"],     # --expansion last
                 ["--tokenizer", "gpt2", "--width", "32", "--heads", "4", "--seq-len", "64", "--expansion", "2"])


def nbytes(tensors) -> int:
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
@pytest.mark.parametrize("flags", SMALL_CONFIGS)
def test_parameter_counts_equal_the_real_model(residual, flags):
    flags = flags[:-2] if residual == "baseline" and flags else flags    # no --expansion: the baseline has no streams
    cfg = parse_config(["--preset", "tiny", "--residual", residual, *flags])
    model = GPT(cfg)
    counts, numels = count_parameters(cfg), memory_module.parameter_numels(GPT, cfg)
    assert counts["total"] == numels["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embedding"] == model.wte.weight.numel() + model.wpe.weight.numel()
    assert counts["streams"] == sum(p.numel() for name, p in model.named_parameters() if "_conn." in name)
    assert numels["tensors"] == len(list(model.parameters()))
    assert numels["block"] == sum(p.numel() for p in model.blocks[-1].parameters())


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
def test_weight_gradient_optimizer_and_cast_terms_equal_the_real_tensors(residual):
    flags = ["--preset", "tiny", "--residual", residual, "--tokenizer", "gpt2"]
    cfg = parse_config(flags)
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(decay_groups(model, cfg.weight_decay), lr=1e-3)
    idx = torch.randint(0, model.wte.num_embeddings, (2, cfg.seq_len))
    model(idx, idx)[1].backward()
    optimizer.step()
    params = list(model.parameters())
    memory = memory_module.memory_plan(GPT, cfg, micro=2)
    assert memory.terms["weights"] == nbytes(params)
    assert memory.terms["gradients"] == nbytes(p.grad for p in params)
    assert memory.terms["optimizer"] == nbytes(v for state in optimizer.state.values() for v in state.values())
    # autocast copies exactly the matmul weights outside the fp32 mixing code (the tied head is the embedding)
    matmul = [m.weight for name, m in model.named_modules() if isinstance(m, nn.Linear) and "_conn" not in name]
    assert memory.terms["autocast weight cache"] == nbytes(matmul) // 2
    P = sum(p.numel() for p in params)
    fsdp = memory_module.memory_plan(GPT, parse_config([*flags, "--parallel", "fsdp"]), 2, world=2)
    assert fsdp.terms["weights"] == 4 * P / 2 and "autocast weight cache" not in fsdp.terms
    assert memory_module.memory_plan(GPT, cfg, 2, world=2).terms["ddp buckets"] == 4 * P


@pytest.mark.parametrize("residual", ["baseline", "mhc"])
def test_bf16_streams_plan_no_more_memory_than_fp32_and_less_under_checkpointing(residual):
    """The formulas widen a bf16 state once a connection (the profile's path): the fp32 copy autograd keeps weighs
    what an fp32 state does. Checkpointing holds the blocks' inputs in the stored dtype: half of fp32's on the
    formulas; on the triton path (auto's on a GPU) the same bytes less, beside u and y, whose dtypes do not change."""
    def plan(dtype, *flags):
        kernels = ["--kernels", flags[0]] if flags and residual != "baseline" else []
        cfg = parse_config(["--depth", "32", "--residual", residual, "--stream-dtype", dtype, *flags[1:], *kernels])
        return memory_module.memory_plan(GPT, cfg, micro=4)

    assert plan("bf16").allocated <= plan("fp32").allocated
    held, plans = "act: checkpointed inputs", {}
    for kernels in ("reference", "auto"):
        plans[kernels] = fp32, bf16 = [plan(dtype, kernels, "--activation-checkpointing") for dtype in ("fp32", "bf16")]
        assert bf16.allocated < fp32.allocated
    (fp32, bf16), (fp32_auto, bf16_auto) = plans["reference"], plans["auto"]
    assert bf16.terms[held] == fp32.terms[held] / 2
    assert fp32_auto.terms[held] - bf16_auto.terms[held] == fp32.terms[held] - bf16.terms[held]


def autograd_saved_bytes(model: GPT, idx: torch.Tensor, bf16: bool) -> int:
    """Ground truth, counted independently of the planner: every storage one forward saves for the backward,
    once, less the parameters and autocast's bf16 copies of them (2-D tensors shaped like a weight); with
    activation checkpointing also the inputs the checkpoints hold (captured as the connections start on the
    formulas, as the sublayers start on the kernels' paths). The triton path's operators allocate their outputs
    and run no kernel (the sizes are the launches', the values do not matter here)."""
    params = list(model.parameters())
    param_storage = {p.untyped_storage().data_ptr() for p in params}
    weight_shapes = {tuple(p.shape) for p in params} | {tuple(p.shape)[::-1] for p in params}
    storages = {}

    def keep(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storage and not (t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes):
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    def held_by_checkpoint(module, args):
        keep(args[0])

    hooks, checkpointed = [], model.blocks[0].checkpointed
    for block in model.blocks if checkpointed else ():
        held = (block.attn_conn, block.mlp_conn) if checkpointed == "connection" else (block.attn, block.mlp)
        hooks += [module.register_forward_pre_hook(held_by_checkpoint) for module in held]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), \
            memory_module._CudaAutocastOnCpu() if bf16 else torch.autocast("cpu", enabled=False), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
            triton_library.without_kernels() if model.kernels == "triton" else contextlib.nullcontext():
        model(idx, idx)
    for hook in hooks:
        hook.remove()
    return sum(storages.values())


@pytest.mark.parametrize("residual,dtype,tokenizer,checkpointing,kernels", [
    ("mhc", "bf16", "gpt2", False, "auto"), ("hc", "bf16", "byte", False, "auto"), ("mhc", "fp32", "byte", False,
                                                                                    "reference"),
    ("baseline", "fp32", "gpt2", False, "auto"), ("mhc", "fp32", "byte", False, "auto"),
    ("mhc", "bf16", "gpt2", True, "auto"), ("hc", "bf16", "byte", True, "auto"), ("mhc", "fp32", "byte", True, "fused"),
    ("mhc-lite", "bf16", "byte", True, "auto"), ("mhc", "bf16", "gpt2", True, "reference")])
def test_activation_term_is_within_15_percent_of_what_autograd_saves(residual, dtype, tokenizer, checkpointing,
                                                                     kernels):
    """The plan measures the path a GPU run takes (auto: triton), with and without checkpointing: the kernels' paths
    keep less than the formulas (no n x C copies), and under checkpointing their connections are not recomputed."""
    # fitted at widths 8 and 16 (2 and 4 x the 4 heads), depths 2 and 3, 2 x 16 tokens; checked elsewhere
    flags = ["--residual", residual, "--dtype", dtype, "--tokenizer", tokenizer, "--width", "40", "--heads", "4",
             "--depth", "5", "--seq-len", "24"] + (["--activation-checkpointing"] if checkpointing else []) + \
            (["--kernels", kernels] if residual != "baseline" else [])
    cfg = parse_config(flags)
    memory = memory_module.memory_plan(GPT, cfg, micro=3)
    predicted = sum(v for k, v in memory.terms.items() if k.startswith("act:") and k != "act: backward peak")
    torch.manual_seed(0)
    path = {"auto": "triton"}.get(kernels, kernels) if residual != "baseline" else "reference"
    model = GPT(cfg, kernels=path)
    assert model.kernels == path
    measured = autograd_saved_bytes(model, torch.randint(0, model.wte.num_embeddings, (3, 24)), dtype == "bf16")
    error = predicted / measured - 1
    print(f"{residual} {dtype} {tokenizer} checkpointing={checkpointing}: planned {predicted:,.0f} B, autograd saves "
          f"{measured:,} B, error {error:+.2%}")
    assert abs(error) < 0.15


def test_the_fit_is_linear_in_width_and_depth_and_per_token():
    """A third width, a fourth depth and other token counts land on the fitted lines (to the byte, up to the
    per-sequence position indices)."""
    cfg = parse_config(["--residual", "mhc", "--heads", "4", "--tokenizer", "byte", "--dtype", "bf16"])
    profiled = memory_module.profile_key(cfg, False)
    fit = memory_module.activation_profile(GPT, profiled)
    per_token = lambda k, C: fit[k][0] * C + fit[k][1]  # noqa: E731
    for width, depth, micro, seq in ((24, 4, 3, 20), (32, 2, 1, 40)):
        measured = memory_module._saved_per_token(GPT, profiled, width, depth, True, micro, seq)
        total = sum(v for k, v in measured.items() if k != "weight_casts")
        planned = depth * per_token("block", width) + per_token("rest", width) + per_token("loss", width)
        assert total == pytest.approx(planned, rel=2e-3)


def plan_for(depth: int, micro: int) -> memory_module.MemoryPlan:
    return memory_module.memory_plan(GPT, parse_config(["--depth", str(depth), "--dtype", "bf16"]), micro, card=CARD)


def test_depth_32_fits_80_gb_at_micro_batch_8_and_depth_48_does_not(capsys):
    """The public reproduction (1.7B, 4 streams): micro-batches 32 and 16 died on an 80 GB card, 8 barely fit;
    depth 48 needed 4. The plan explains it: per parameter 18 bytes (fp32 weights, gradients, 2 AdamW states,
    bf16 copies) are the same at any micro-batch, and the activations grow with micro-batch x depth."""
    plans = {(d, m): plan_for(d, m) for d, m in ((32, 32), (32, 16), (32, 8), (48, 8), (48, 4))}
    with capsys.disabled():
        print()
        for (depth, micro), memory in plans.items():
            acts = sum(v for k, v in memory.terms.items() if k.startswith("act:"))
            print(f"depth {depth} micro-batch {micro:2d}: total {memory.total / memory_module.GiB:6.1f} GiB of 80 "
                  f"(parameters, gradients, optimizer, bf16 copies {(memory.allocated - acts) / memory_module.GiB:5.1f}, "
                  f"activations {acts / memory_module.GiB:5.1f}, overhead {(memory.total - memory.allocated) / memory_module.GiB:4.1f})")
    assert plans[32, 8].total <= CARD < plans[48, 8].total
    assert plans[32, 16].total > CARD and plans[32, 32].total > CARD
    assert plans[48, 4].total < plans[48, 8].total


@pytest.mark.parametrize("residual,path", [("baseline", []), ("mhc", ["--kernels", "reference"])])
def test_the_fused_loss_plans_no_logits_and_lets_auto_take_a_larger_micro_batch_at_depth_32(residual, path, tmp_path):
    """--cross-entropy fused: no log-probabilities saved, and the backward's loss peak is one chunk's logits and the
    head's gradients (fused_loss_peak) instead of two fp32 buffers of the whole logits; every other term the same.
    auto (no --check timings in --out) plans plain; with the check's timings for this card, the faster one."""
    flags = ["--depth", "32", "--residual", residual, "--dtype", "bf16", "--out", str(tmp_path), *path]
    plain, fused = (parse_config([*flags, "--cross-entropy", loss]) for loss in ("plain", "fused"))
    plans = {cfg.cross_entropy: memory_module.memory_plan(GPT, cfg, 8, card=CARD) for cfg in (plain, fused)}
    logits = 8 * 1024 * 50304 * 4                                  # fp32 (tokens x vocabulary)
    assert plans["plain"].terms["act: log-probabilities"] == pytest.approx(logits, rel=1e-3)
    assert plans["plain"].terms["act: backward peak"] == pytest.approx(2 * logits, rel=1e-3)
    assert plans["fused"].terms["act: log-probabilities"] == 0
    peak = memory_module.fused_loss_peak(8 * 1024, 2048, 50304, 2)
    assert plans["fused"].terms["act: backward peak"] == peak and peak < 0.25 * logits      # 0.36 of 1.5 GiB
    same = {k for k in plans["plain"].terms if not k.startswith(("act: log", "act: backward", "overhead: frag"))}
    assert all(plans["plain"].terms[k] == plans["fused"].terms[k] for k in same)
    micro = {cfg.cross_entropy: memory_module.auto_micro_batch(GPT, cfg, 1, CARD)[0] for cfg in (plain, fused)}
    assert micro["fused"] > micro["plain"]
    assert memory_module.memory_floor(fused, 50304, 8, 1, "fused") < memory_module.memory_floor(plain, 50304, 8, 1)
    auto = parse_config(flags)
    assert memory_module.planned_loss(auto)[0] == "plain"
    (tmp_path / "gpu_check").mkdir()
    (tmp_path / "gpu_check" / "result.json").write_text(json.dumps(
        {"gpu": gpus.ASSUMED_GPU, "cross_entropy": {"plain": {"step_s": 0.5}, "fused": {"step_s": 0.45}}}))
    assert memory_module.planned_loss(auto)[0] == "fused"
    assert memory_module.memory_plan(GPT, auto, 8, card=CARD).terms == plans["fused"].terms


def test_auto_picks_the_largest_micro_batch_within_the_margin_and_less_for_deeper_models():
    picked = {}
    for depth in (32, 48):
        cfg = parse_config(["--depth", str(depth), "--dtype", "bf16"])
        micro, memory = memory_module.auto_micro_batch(GPT, cfg, 1, CARD)
        assert memory.total <= (1 - memory_module.AUTO_MARGIN) * CARD and 32 % micro == 0
        larger = [d for d in memory_module.divisors_descending(32) if d > micro]
        assert all(memory_module.memory_plan(GPT, cfg, d, 1, CARD).total > (1 - memory_module.AUTO_MARGIN) * CARD for d in larger)
        picked[depth] = micro
    assert picked[48] < picked[32]
    with pytest.raises(memory_module.PlanError, match="micro-batch 1 already needs"):
        memory_module.auto_micro_batch(GPT, parse_config(["--depth", "48"]), 1, 40 * memory_module.GiB)


def test_batch_plan_resolves_auto_on_cuda_from_the_plan_and_on_the_cpu_by_a_cap():
    cfg = parse_config(["--depth", "48", "--gpu-memory-gb", "80"])
    assert cfg.micro_batch_size == "auto"                  # the c4 preset's default
    micro, accum, why = batch_plan(cfg, 1, on_gpu=False)
    assert (micro, accum) == (8, 4) and "CPU" in why
    assert batch_plan(parse_config(["--batch-size", "12"]), 1, on_gpu=False)[:2] == (6, 2)
    micro, accum, why = batch_plan(cfg, 1, on_gpu=True)
    assert micro * accum == 32 and micro == memory_module.auto_micro_batch(GPT, cfg, 1)[0] and "planned" in why
    assert parse_config(["--preset", "demo"]).micro_batch_size == "16"     # presets keep their numbers


@pytest.mark.slow
def test_auto_writes_the_resolved_micro_batch_to_config_json(tmp_path):
    command = [sys.executable, str(ROOT / "train_c4.py"), "--preset", "tiny", "--steps", "2", "--out", str(tmp_path),
               "--micro-batch-size", "auto", "--batch-size", "4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "micro-batch auto: 4 (CPU" in result.stdout
    config = json.loads((tmp_path / "mhc_d2_s42" / "config.json").read_text())
    assert config["config"]["micro_batch_size"] == 4             # an integer the launcher can halve
