"""The planner of train_c4.py: parameter counts, the memory plan against the real tensors and the bytes autograd
saves, the depth 32 / 48 plans behind the public reproduction's out-of-memory story, --micro-batch-size auto,
and the launcher's queue-based time and cost estimate."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import matrix
import train_c4 as T

ROOT = Path(__file__).resolve().parent.parent
CARD = 80 * T.GiB
SMALL_CONFIGS = ([], ["--width", "48", "--heads", "3", "--depth", "3", "--expansion", "3"],
                 ["--tokenizer", "gpt2", "--width", "32", "--heads", "4", "--expansion", "2", "--seq-len", "64"])


def nbytes(tensors) -> int:
    unique = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
@pytest.mark.parametrize("flags", SMALL_CONFIGS)
def test_parameter_counts_equal_the_real_model(residual, flags):
    cfg = T.parse_config(["--preset", "tiny", "--residual", residual, *flags])
    model = T.GPT(cfg)
    counts, numels = T.count_parameters(cfg), T.parameter_numels(cfg)
    assert counts["total"] == numels["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embedding"] == model.wte.weight.numel() + model.wpe.weight.numel()
    assert counts["streams"] == sum(p.numel() for name, p in model.named_parameters() if "_conn." in name)
    assert numels["tensors"] == len(list(model.parameters()))
    assert numels["block"] == sum(p.numel() for p in model.blocks[-1].parameters())


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
def test_weight_gradient_optimizer_and_cast_terms_equal_the_real_tensors(residual):
    flags = ["--preset", "tiny", "--residual", residual, "--tokenizer", "gpt2"]
    cfg = T.parse_config(flags)
    torch.manual_seed(0)
    model = T.GPT(cfg)
    optimizer = torch.optim.AdamW(T.decay_groups(model, cfg.weight_decay), lr=1e-3)
    idx = torch.randint(0, model.wte.num_embeddings, (2, cfg.seq_len))
    model(idx, idx)[1].backward()
    optimizer.step()
    params = list(model.parameters())
    plan = T.memory_plan(cfg, micro=2)
    assert plan.terms["weights"] == nbytes(params)
    assert plan.terms["gradients"] == nbytes(p.grad for p in params)
    assert plan.terms["optimizer"] == nbytes(v for state in optimizer.state.values() for v in state.values())
    # autocast copies exactly the matmul weights outside the fp32 mixing code (the tied head is the embedding)
    matmul = [m.weight for name, m in model.named_modules() if isinstance(m, nn.Linear) and "_conn" not in name]
    assert plan.terms["autocast weight cache"] == nbytes(matmul) // 2
    P = sum(p.numel() for p in params)
    fsdp = T.memory_plan(T.parse_config([*flags, "--parallel", "fsdp"]), 2, world=2)
    assert fsdp.terms["weights"] == 4 * P / 2 and "autocast weight cache" not in fsdp.terms
    assert T.memory_plan(cfg, 2, world=2).terms["ddp buckets"] == 4 * P


def autograd_saved_bytes(model: T.GPT, idx: torch.Tensor, bf16: bool) -> int:
    """Ground truth, counted independently of the planner: every storage one forward saves for the backward,
    once, less the parameters and autocast's bf16 copies of them (2-D tensors shaped like a weight); with
    activation checkpointing also the sublayer inputs the checkpoints hold (captured as the sublayers start)."""
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

    hooks = []
    if model.blocks[0].activation_checkpointing:
        for block in model.blocks:
            hooks += [conn.register_forward_pre_hook(held_by_checkpoint) for conn in (block.attn_conn, block.mlp_conn)]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), \
            T._CudaAutocastOnCpu() if bf16 else torch.autocast("cpu", enabled=False), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model(idx, idx)
    for hook in hooks:
        hook.remove()
    return sum(storages.values())


@pytest.mark.parametrize("residual,dtype,tokenizer,checkpointing", [
    ("mhc", "bf16", "gpt2", False), ("hc", "bf16", "byte", False), ("baseline", "fp32", "gpt2", False),
    ("mhc", "fp32", "byte", False), ("mhc", "bf16", "gpt2", True), ("hc", "bf16", "byte", True)])
def test_activation_term_is_within_15_percent_of_what_autograd_saves(residual, dtype, tokenizer, checkpointing):
    # fitted at widths 8 and 16 (2 and 4 x the 4 heads), depths 2 and 3, 2 x 16 tokens; checked elsewhere
    flags = ["--residual", residual, "--dtype", dtype, "--tokenizer", tokenizer, "--width", "40", "--heads", "4",
             "--depth", "5", "--seq-len", "24"] + (["--activation-checkpointing"] if checkpointing else [])
    cfg = T.parse_config(flags)
    plan = T.memory_plan(cfg, micro=3)
    predicted = sum(v for k, v in plan.terms.items() if k.startswith("act:") and k != "act: backward peak")
    torch.manual_seed(0)
    model = T.GPT(cfg)
    measured = autograd_saved_bytes(model, torch.randint(0, model.wte.num_embeddings, (3, 24)), dtype == "bf16")
    error = predicted / measured - 1
    print(f"{residual} {dtype} {tokenizer} checkpointing={checkpointing}: planned {predicted:,.0f} B, autograd saves "
          f"{measured:,} B, error {error:+.2%}")
    assert abs(error) < 0.15


def test_the_fit_is_linear_in_width_and_depth_and_per_token():
    """A third width, a fourth depth and other token counts land on the fitted lines (to the byte, up to the
    per-sequence position indices)."""
    cfg = T.parse_config(["--residual", "mhc", "--heads", "4", "--tokenizer", "byte", "--dtype", "bf16"])
    fit = T.activation_profile("mhc", 4, 4, "byte", cfg.sinkhorn_iters, True, False)
    per_token = lambda k, C: fit[k][0] * C + fit[k][1]  # noqa: E731
    for width, depth, micro, seq in ((24, 4, 3, 20), (32, 2, 1, 40)):
        measured = T._saved_per_token(cfg, width, depth, True, micro, seq)
        total = sum(v for k, v in measured.items() if k != "weight_casts")
        planned = depth * per_token("block", width) + per_token("rest", width) + per_token("loss", width)
        assert total == pytest.approx(planned, rel=2e-3)


def plan_for(depth: int, micro: int) -> T.MemoryPlan:
    return T.memory_plan(T.parse_config(["--depth", str(depth), "--dtype", "bf16"]), micro, card=CARD)


def test_depth_32_fits_80_gb_at_micro_batch_8_and_depth_48_does_not(capsys):
    """The public reproduction (1.7B, 4 streams): micro-batches 32 and 16 died on an 80 GB card, 8 barely fit;
    depth 48 needed 4. The plan explains it: per parameter 18 bytes (fp32 weights, gradients, 2 AdamW states,
    bf16 copies) are the same at any micro-batch, and the activations grow with micro-batch x depth."""
    plans = {(d, m): plan_for(d, m) for d, m in ((32, 32), (32, 16), (32, 8), (48, 8), (48, 4))}
    with capsys.disabled():
        print()
        for (depth, micro), plan in plans.items():
            acts = sum(v for k, v in plan.terms.items() if k.startswith("act:"))
            print(f"depth {depth} micro-batch {micro:2d}: total {plan.total / T.GiB:6.1f} GiB of 80 "
                  f"(parameters, gradients, optimizer, bf16 copies {(plan.allocated - acts) / T.GiB:5.1f}, "
                  f"activations {acts / T.GiB:5.1f}, overhead {(plan.total - plan.allocated) / T.GiB:4.1f})")
    assert plans[32, 8].total <= CARD < plans[48, 8].total
    assert plans[32, 16].total > CARD and plans[32, 32].total > CARD
    assert plans[48, 4].total < plans[48, 8].total


def test_auto_picks_the_largest_micro_batch_within_the_margin_and_less_for_deeper_models():
    picked = {}
    for depth in (32, 48):
        cfg = T.parse_config(["--depth", str(depth), "--dtype", "bf16"])
        micro, plan = T.auto_micro_batch(cfg, 1, CARD)
        assert plan.total <= (1 - T.AUTO_MARGIN) * CARD and 32 % micro == 0
        larger = [d for d in T.divisors_descending(32) if d > micro]
        assert all(T.memory_plan(cfg, d, 1, CARD).total > (1 - T.AUTO_MARGIN) * CARD for d in larger)
        picked[depth] = micro
    assert picked[48] < picked[32]
    with pytest.raises(T.ConfigError, match="micro-batch 1 already needs"):
        T.auto_micro_batch(T.parse_config(["--depth", "48"]), 1, 40 * T.GiB)


def test_batch_plan_resolves_auto_on_cuda_from_the_plan_and_on_the_cpu_by_a_cap(monkeypatch, capsys):
    cfg = T.parse_config(["--depth", "48", "--gpu-memory-gb", "80"])
    assert cfg.micro_batch_size == "auto"                  # the c4 preset's default
    assert T.batch_plan(cfg, 1) == (8, 4) and "CPU" in capsys.readouterr().out
    assert T.batch_plan(T.parse_config(["--batch-size", "12"]), 1) == (6, 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    micro, accum = T.batch_plan(cfg, 1)
    assert micro * accum == 32 and micro == T.auto_micro_batch(cfg, 1)[0]
    assert "planned" in capsys.readouterr().out
    assert T.parse_config(["--preset", "demo"]).micro_batch_size == "16"     # presets keep their numbers


def test_auto_writes_the_resolved_micro_batch_to_config_json(tmp_path):
    command = [sys.executable, str(ROOT / "train_c4.py"), "--preset", "tiny", "--steps", "2", "--out", str(tmp_path),
               "--micro-batch-size", "auto", "--batch-size", "4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "micro-batch auto: 4 (CPU" in result.stdout
    config = json.loads((tmp_path / "mhc_d2_s42" / "config.json").read_text())
    assert config["config"]["micro_batch_size"] == 4             # an integer the launcher can halve


def test_estimate_prints_the_plan_without_building_the_model(capsys):
    assert T.main(["--estimate", "--depth", "48", "--micro-batch-size", "8", "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    for words in ("2,540,313,120 parameters", "non-embedding", "in the residual connections", "FLOPs per token",
                  "tokens per step", "weights", "gradients", "optimizer", "autocast weight cache", "act: blocks",
                  "act: log-probabilities", "overhead: CUDA context", "does NOT fit", "--micro-batch-size auto: 2"):
        assert words in out
    assert T.main(["--estimate", "--depth", "48", "--parallel", "fsdp", "--estimate-world-size", "8",
                   "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "8 processes, FSDP" in out and "/ 8 ranks" in out and "fsdp all-gathered" in out


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12),
                                        ("NVIDIA A100-SXM4-40GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
                                        ("NVIDIA H100 80GB HBM3e", None), ("NVIDIA GeForce RTX 4090", None),
                                        ("cpu", None)])
def test_gpu_peak_is_the_exact_device_names_and_unknown_devices_get_none(name, peak):
    """A PCIe H100 is not credited with the SXM's peak; a name not listed gets no MFU rather than a wrong one."""
    assert T.gpu_peak_flops(name) == peak


def test_time_estimate_names_the_assumed_gpu_or_says_why_there_is_none(capsys, monkeypatch):
    T.main(["--estimate", "--depth", "32"])
    assert "40% MFU on 1 x NVIDIA H100 80GB HBM3 (assumed: no CUDA device here)" in capsys.readouterr().out
    monkeypatch.setattr(T.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(T.torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX A6000")
    T._print_time_estimate(T.parse_config([]), world=1, flops=1e10)
    assert "no estimate, the dense bf16 peak of NVIDIA RTX A6000 is not known" in capsys.readouterr().out


def test_queue_schedule_of_18_jobs_on_8_gpus_by_hand():
    # the --full queue order: seed-major, depth 48 before 32, baseline/hc/mhc; depth 48 takes 3 h, 32 takes 2 h
    hours = [3, 3, 3, 2, 2, 2] * 3
    # t=0: jobs 1-8 start (slots end at 3,3,3,2,2,2,3,3); t=2: jobs 9-11 on the three free slots (9 ends at 5,
    # 10-11 at 4); t=3: jobs 12-16 on the five slots freed (12 and 16 end at 5, 13-15 at 6); t=4: jobs 17-18 end
    # at 6. Wall time 6 h; the naive sum over 8 GPUs would say 45 / 8 = 5.6 h.
    assert matrix.queue_schedule(hours, 8) == 6
    assert matrix.queue_schedule([1.0] * 3, 8, stagger=0.25) == 1.5          # launches a quarter apart
    assert matrix.queue_schedule([2, 1, 1, 1], 2) == 3 and matrix.queue_schedule([], 8) == 0


def launcher(tmp_path, *args, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("RUN_EXPERIMENTS_", "FAKE_"))}
    environment.update(RUN_EXPERIMENTS_NVIDIA_SMI="false", **env)
    return subprocess.run(["bash", str(ROOT / "run_experiments.sh"), "--out", str(tmp_path / "runs"), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environment)


def test_dry_run_estimates_wall_time_and_cost_from_flops(tmp_path):
    r = launcher(tmp_path, "--dry-run", "--gpus", "0,1,2,3,4,5,6,7", "--methods", "mhc", "--seeds", "42,123,456",
                 "--price-per-gpu-hour", "3")
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith("mhc_d")}
    assert "micro-batch 4 (trainer default)" in lines["mhc_d32_s42"]          # auto, planned for 80 GiB
    assert "micro-batch 2 (trainer default)" in lines["mhc_d48_s42"]
    assert lines["mhc_d48_s42"].endswith(" h") and "40% MFU" in r.stdout and "H100, assumed" in r.stdout
    assert "Wall time: 6 job(s) on 8 slot(s)" in r.stdout and "Cost at $3.00 per GPU-hour: 8 GPU(s)" in r.stdout
    assert not (tmp_path / "runs").exists()
    assert "goes with --dry-run" in launcher(tmp_path, "--calibrate").stderr


@pytest.mark.slow
def test_demo_dry_run_calibrates_on_the_cpu(tmp_path):
    r = launcher(tmp_path, "--demo", "--dry-run", "--calibrate", "--methods", "mhc", "--stagger", "0",
                 RUN_EXPERIMENTS_CALIBRATE_STEPS="4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Calibrating mhc_d4 on the CPU: 4 steps" in r.stdout
    assert "Times from --calibrate" in r.stdout and "mhc_d4: " in r.stdout and " tokens/s" in r.stdout
    assert "Wall time: 1 job(s) on 1 slot(s)" in r.stdout and "no GPU-hours" in r.stdout
    assert not (tmp_path / "runs").exists()
