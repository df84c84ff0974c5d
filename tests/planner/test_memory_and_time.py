"""The planner (hcstudy/planner, beside train_c4.py): parameter counts, the memory plan against the real tensors and the
bytes autograd saves, the depth 32 / 48 plans behind the public reproduction's out-of-memory story,
--micro-batch-size auto, and the launcher's plan: the check of every job before the first launch, the time and
cost ranges of the documented node, the GPU check's timings."""
import contextlib
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import illustrative_check
from hcstudy.kernels import triton_library
from hcstudy.launcher import dry_run
from hcstudy.planner import estimate, gpus
from hcstudy.planner import memory as memory_module
from hcstudy.planner import run_time
import train_c4 as T
from hcstudy.config import parse_config
from hcstudy.kernels import choice
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


@pytest.mark.slow
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
    assert gpus.gpu_peak_flops(name) == peak


def test_the_levers_are_priced_and_named_the_fused_loss_with_its_recomputed_logits():
    """The fused loss adds its backward's second pass over the head (2 x vocabulary x width FLOPs a token); compiling
    the blocks or the whole model is priced as eager until --check times it, each under its own key."""
    flags = ["--depth", "32", "--residual", "baseline", "--micro-batch-size", "8", "--tokenizer", "byte"]
    plain, fused = (parse_config([*flags, "--cross-entropy", loss]) for loss in ("plain", "fused"))
    params, rates = count_parameters(plain), run_time.gpu_rates(gpus.ASSUMED_GPU)
    costs = [run_time.step_cost(GPT, cfg, params, "reference", 8, 1, rates) for cfg in (plain, fused)]
    assert costs[1].flops - costs[0].flops == 32 * 1024 * 2 * 256 * 2048 and costs[1].bytes == costs[0].bytes
    for scope, mode in (("blocks", "compile"), ("model", "compile-model")):
        cfg = parse_config([*flags, "--compile", "--compile-scope", scope])
        assert choice.timed_mode(cfg) == mode
        _, basis = run_time.step_seconds(GPT, cfg, params, 8, 1, gpus.ASSUMED_GPU, "reference")
        assert basis.endswith(f"as eager (compile of the {scope} not modelled)")
    assert choice.timed_mode(plain) == "eager"
    lever = parse_config([*flags, "--cross-entropy", "fused", "--compile", "--compile-scope", "model"])
    assert estimate.levers_line(lever) == ("planned for: the fused cross-entropy (--cross-entropy fused); torch.compile "
                                           "of the whole model (its step priced as eager until --check times it)")
    assert estimate.levers_line(plain).endswith("; no torch.compile (eager)")


def test_time_estimate_names_the_assumed_gpu_or_says_why_there_is_none(capsys, monkeypatch):
    T.main(["--estimate", "--depth", "32"])
    assert "on 1 x NVIDIA H100 80GB HBM3 (assumed: no CUDA device here)" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX A6000")
    T.main(["--estimate", "--depth", "32", "--gpu-memory-gb", "48"])
    assert "no estimate, its bf16 peak or bandwidth is not known" in capsys.readouterr().out


def without_triton(tmp_path: Path) -> dict:
    """The environment of setup.sh without --dev, where the CPU torch brings no triton: a package named triton first
    on the path whose import fails as a missing module's does (this venv has the real one)."""
    (tmp_path / "no_triton" / "triton").mkdir(parents=True, exist_ok=True)
    (tmp_path / "no_triton" / "triton" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'triton'\", name='triton')\n")
    return {"PYTHONPATH": str(tmp_path / "no_triton")}


@pytest.mark.slow
def test_the_plan_and_the_dry_run_need_no_triton(tmp_path):
    """The README's set-up installs the runtime alone: the planner counts the triton path's kernels by their own
    byte counts, and triton is imported only where its kernels run."""
    env = {**os.environ, **without_triton(tmp_path)}
    assert subprocess.run([sys.executable, "-c", "import triton"], env=env, capture_output=True).returncode == 1
    done = subprocess.run([sys.executable, str(ROOT / "train_c4.py"), "--estimate", "--depth", "48"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "triton path" in done.stdout and "the run on this CPU" in done.stdout
    r = launcher(tmp_path, "--dry-run", "--full", **without_triton(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Wall time: 18 job(s)" in r.stdout and "triton path" in r.stdout


def test_the_cpu_model_prices_the_trainers_threads_at_the_share_of_a_core_the_other_work_leaves():
    """One thread's timed rates (a core's own speed) become the trainer's: fast, its threads side by side at the share
    a thread gets; slow, one thread's share at two thirds; the host's ops on one thread either way."""
    quiet = run_time.cpu_rates_at(60e9, 100e9, 4e-6, cores=2, share=1.0)
    slow = run_time.CPU_SLOW_SHARE
    assert quiet.flops == (120e9, 60e9 * slow) and quiet.bandwidth == (200e9, 100e9 * slow)
    assert quiet.host == (4e-6, 4e-6 / slow) and not quiet.overlapped
    loaded = run_time.cpu_rates_at(60e9, 100e9, 4e-6, cores=2, share=0.4)     # a load of about 4 on 2 cores
    assert loaded.flops == pytest.approx((48e9, 24e9 * slow)) and loaded.host == pytest.approx((1e-5, 1e-5 / slow))
    work = run_time.StepCost("fused", 12e9, 2e9, 600, quiet)
    quiet_s, loaded_s = work.seconds, dataclasses.replace(work, rates=loaded).seconds
    assert loaded_s == pytest.approx(tuple(s / 0.4 for s in quiet_s))     # the step, at both ends, over the share
    assert run_time.cpu_rates_at(60e9, 100e9, 4e-6, 2, share=0.0).flops[1] > 0     # a timing that got no CPU at all


def test_the_cpu_rates_are_timed_on_one_thread_on_a_slice_of_a_large_shape(monkeypatch):
    """--estimate --width 65536 timed the MLP's matmul on its own (65536 x 262144) weight: 64 GiB. Never more than
    a slice, one thread, the caller's thread count kept."""
    randn, set_threads, threads, asked = torch.randn, torch.set_num_threads, torch.get_num_threads(), []

    def small_randn(*size, **kwargs):
        assert math.prod(size) <= 2 ** 24, f"the CPU timing allocates {size}"
        return randn(*size, **kwargs)

    def recorded_set_threads(n):
        asked.append(n)
        set_threads(n)
    monkeypatch.setattr(torch, "randn", small_randn)
    monkeypatch.setattr(torch, "set_num_threads", recorded_set_threads)
    rates = run_time.cpu_rates.__wrapped__(16 * 65536, 65536, 4)
    assert asked == [1, threads] and torch.get_num_threads() == threads
    assert 0 < rates.flops[1] < rates.flops[0] and 0 < rates.bandwidth[1] < rates.bandwidth[0]
    assert rates.host[0] < rates.host[1]


@pytest.mark.slow
def test_the_widest_model_in_bounds_is_planned(capsys):
    assert T.main(["--estimate", "--width", "65536", "--depth", "1", "--heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "the run on this CPU" in out and "h for 10,000 steps" in out


def test_queue_schedule_of_18_jobs_on_8_gpus_by_hand():
    # the --full queue order: seed-major, depth 48 before 32, baseline/hc/mhc; depth 48 takes 3 h, 32 takes 2 h
    hours = [3, 3, 3, 2, 2, 2] * 3
    # t=0: jobs 1-8 start (slots end at 3,3,3,2,2,2,3,3); t=2: jobs 9-11 on the three free slots (9 ends at 5,
    # 10-11 at 4); t=3: jobs 12-16 on the five slots freed (12 and 16 end at 5, 13-15 at 6); t=4: jobs 17-18 end
    # at 6. Wall time 6 h; the naive sum over 8 GPUs would say 45 / 8 = 5.6 h.
    assert dry_run.queue_schedule(hours, 8) == 6
    assert dry_run.queue_schedule([1.0] * 3, 8, stagger=0.25) == 1.5          # launches a quarter apart
    assert dry_run.queue_schedule([2, 1, 1, 1], 2) == 3 and dry_run.queue_schedule([], 8) == 0


def launcher(tmp_path, *args, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("RUN_EXPERIMENTS_", "FAKE_"))}
    environment.update(RUN_EXPERIMENTS_NVIDIA_SMI="false", **env)
    return subprocess.run(["bash", str(ROOT / "run_experiments.sh"), "--out", str(tmp_path / "runs"), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environment)


def hours(line: str) -> tuple[float, float]:
    low, high = re.search(r"([\d.]+)-([\d.]+) h", line).groups()
    return float(low), float(high)


@pytest.mark.slow
def test_dry_run_without_gpus_plans_the_documented_node_per_method_with_ranges(tmp_path):
    r = launcher(tmp_path, "--dry-run", "--methods", "baseline,mhc", "--seeds", "42,123,456",
                 "--price-per-gpu-hour", "3")
    assert r.returncode == 0, r.stderr
    assert "for the documented node, 8 x NVIDIA H100 80GB HBM3 (no GPU found here" in r.stdout
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith(("mhc_d", "baseline_d"))}
    assert "micro-batch 8 (auto), global batch 32, " in lines["mhc_d32_s42"]        # auto, planned for 80 GiB
    assert "micro-batch 2 (auto)" in lines["mhc_d48_s42"] and " of 80 GiB" in lines["mhc_d48_s42"]
    for depth in (32, 48):          # the stream mixing costs time: mHC's range lies above the baseline's
        baseline, mhc = hours(lines[f"baseline_d{depth}_s42"]), hours(lines[f"mhc_d{depth}_s42"])
        assert baseline[0] < baseline[1] and mhc[0] > baseline[0] and mhc[1] > baseline[1]
    assert "triton path" in lines["mhc_d32_s42"] and "reference path" in lines["baseline_d32_s42"]
    assert "(modelled)" in lines["mhc_d32_s42"] and "Step times, modelled: each job's kernels counted" in r.stdout
    assert "checkpoint writes" in r.stdout
    wall = re.search(r"Wall time: 12 job\(s\) on 8 slot\(s\).*", r.stdout).group()
    cost = re.search(r"Cost at \$3.00 per GPU-hour: 8 GPU\(s\) x .* = \$([\d,]+)-\$([\d,]+) for the node", r.stdout)
    assert hours(wall)[0] < hours(wall)[1] and cost and int(cost[1].replace(",", "")) < int(cost[2].replace(",", ""))
    assert not (tmp_path / "runs").exists()
    assert "goes with --dry-run" in launcher(tmp_path, "--calibrate").stderr


@pytest.mark.slow
def test_dry_run_takes_the_gpu_checks_timing_and_gpu_type(tmp_path):
    """{out}/gpu_check/result.json (docs/planning.md) replaces the model for the arm, path and GPU it timed."""
    check = tmp_path / "runs" / "gpu_check" / "result.json"
    check.parent.mkdir(parents=True)
    check.write_text(json.dumps({"gpu": "NVIDIA H200", "timings": {"mhc": {"triton/eager": {"step_s": 2.0}}},
                                 "methods": {"mhc": {"step_seconds": 2.0, "tokens_per_step": 32768,
                                                     "flops_per_token": 1.0e10, "gpus": 1}}}))
    r = launcher(tmp_path, "--dry-run", "--methods", "mhc", "--depths", "32", "--seeds", "1", "--gpu-type",
                 "NVIDIA H200")
    assert r.returncode == 0, r.stderr
    line = next(line for line in r.stdout.splitlines() if line.startswith("mhc_d32_s1"))
    assert "8 x NVIDIA H200" in r.stdout and "triton path" in line and "(scaled)" in line
    assert "Step times, scaled: mhc on the triton path (eager) timed by the GPU check at its small size, scaled by " \
           "FLOPs per token" in r.stdout
    # 10,000 steps of 2 s at 1e10 FLOPs per token, scaled to depth 32's 1.116e10 (the head's included) and spread
    # 0.9-1.2 (5.58-7.44 h), plus the rest
    low, high = hours(line)
    assert 5.58 < low < 5.9 and 7.44 < high < 8.0
    r = launcher(tmp_path, "--dry-run", "--methods", "mhc", "--depths", "32", "--seeds", "1")
    assert r.returncode == 0 and "GPU check" not in r.stdout          # measured on another GPU than planned
    r = launcher(tmp_path, "--dry-run", "--methods", "mhc", "--depths", "32", "--seeds", "1", "--gpu-type",
                 "NVIDIA H200", "--", "--kernels", "reference")
    assert r.returncode == 0 and "GPU check" not in r.stdout and "reference path" in r.stdout   # not the timed path


@pytest.mark.slow
def test_dry_run_prices_rehearsed_jobs_as_measured_and_refuses_a_micro_batch_that_ran_out_of_memory(tmp_path):
    """tests/illustrative_check.py's result.json (made up): the baseline at depth 48 and mHC at depth 32 trained,
    HC at depth 48 ran out of memory at its planned micro-batch 2."""
    illustrative_check.write(tmp_path / "runs")
    r = launcher(tmp_path, "--dry-run", "--seeds", "1")
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if re.match(r"\w+_d\d+_s1 ", line)}
    assert "micro-batch 4 (auto)" in lines["baseline_d48_s1"] and "(measured: 1.41 s a step, 1.39-1.44)" in \
        lines["baseline_d48_s1"]
    assert "(measured: 1.58 s a step, 1.55-1.62)" in lines["mhc_d32_s1"]
    assert "micro-batch 1 (auto)" in lines["hc_d48_s1"] and "(modelled)" in lines["hc_d48_s1"]     # below the 2
    assert sum("(measured" in line for line in lines.values()) == 2 and len(lines) == 6
    low, high = hours(lines["mhc_d32_s1"])         # 10,000 steps of 1.55-1.62 s, and the rest
    assert 4.3 < low < 4.7 and 4.5 < high < 5.0
    assert "Step times, measured: the GPU check's rehearsal of the job's very shape" in r.stdout
    r = launcher(tmp_path, "--dry-run", "--methods", "hc", "--depths", "48", "--seeds", "1", "--",
                 "--micro-batch-size", "2")
    assert r.returncode == 2 and "nothing was launched" not in r.stdout
    assert re.search(r"refuses hc_d48_s1: --micro-batch-size 2: the GPU check's rehearsal of hc at depth 48 ran out "
                     r"of memory at micro-batch 2 on this NVIDIA H100 80GB HBM3 \(result\.json in .*\): use a "
                     r"smaller one, or auto", r.stderr), r.stderr


@pytest.mark.slow
def test_every_job_is_refused_before_any_launch_for_bad_flags_or_memory(tmp_path):
    r = launcher(tmp_path, "--demo", "--", "--lrr", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "train_c4.py refuses baseline_d4_s42 and 2 more job(s): unrecognized arguments: --lrr 1" in r.stderr
    assert "nothing was launched" in r.stderr and not list((tmp_path / "runs").glob("*_d4_s42"))
    r = launcher(tmp_path, "--dry-run", "--methods", "mhc", "--depths", "48", "--seeds", "1", "--",
                 "--micro-batch-size", "16")
    assert r.returncode == 2
    assert re.search(r"refuses mhc_d48_s1: .* plans [\d.]+ GiB per GPU, more than the 80 GiB", r.stderr)


@pytest.mark.slow
def test_demo_dry_run_calibrates_on_the_cpu(tmp_path):
    r = launcher(tmp_path, "--demo", "--dry-run", "--calibrate", "--methods", "mhc", "--stagger", "0",
                 RUN_EXPERIMENTS_CALIBRATE_STEPS="4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Calibrating mhc_d4 on the CPU: 4 steps" in r.stdout
    assert "Times from --calibrate" in r.stdout and "mhc_d4 " in r.stdout and "calibrated just now" in r.stdout
    assert "Wall time: 1 job(s) on 1 slot(s)" in r.stdout and "no GPU-hours" in r.stdout
    assert not (tmp_path / "runs").exists()


def test_the_estimate_prints_the_modelled_mfu_of_its_step_range():
    """MFU = tokens a step x FLOPs a token (the head's included) / (seconds x the card's bf16 peak x GPUs): the slow end
    of the step gives the low MFU; a card without a known peak (the CPU) prints none."""
    cfg = parse_config(["--residual", "baseline", "--depth", "32"])
    params = count_parameters(cfg)
    h100 = "NVIDIA H100 80GB HBM3"
    work = cfg.tokens_per_step * gpus.flops_per_token(cfg, params) / gpus.gpu_peak_flops(h100)
    assert estimate.mfu_text(cfg, params, (work / 0.5, work / 0.25), h100, 1) == ", MFU 25-50%"
    assert estimate.mfu_text(cfg, params, (work / 0.5, work / 0.5), h100, 2) == ", MFU 25%"
    assert estimate.mfu_text(cfg, params, (1.0, 2.0), "cpu", 1) == ""
    head = params["embedding"] - cfg.seq_len * cfg.width
    assert gpus.flops_per_token(cfg, params) - 6 * params["non_embedding"] == 6 * head + 12 * 32 * 2048 * 1024
