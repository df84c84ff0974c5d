"""hcstudy/kernels/fused.py against the formulas of train_c4.py (--kernels fused against --kernels reference): forward and every
gradient, in the layouts, precisions and wrappings the fused code meets; torch.compile of both paths."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


from hcstudy.kernels import fused as fused_module
from hcstudy.arms.mhc import sinkhorn
from hcstudy.metrics import instability_probe
from hcstudy.model import Block, GPT
from hcstudy.stream_mixing import stream_update
from helpers import randomize_mixing, tiny_config

ROOT = Path(__file__).resolve().parents[2]
RESIDUALS = ("baseline", "hc", "mhc")
# fp64: the same maths in another order; measured at most 2e-14. fp32: measured at most 3e-6 relative.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def block_step(residual, kernels, x0, grad_out, dtype=torch.float32, autocast=False, **overrides):
    """One Block (attention and MLP sublayers, each with its connection) with randomised mixing: its output,
    the input's gradient and every parameter's."""
    torch.manual_seed(0)
    cfg = tiny_config(residual, **overrides)
    block = Block(cfg, 1, False, kernels).to(dtype)
    randomize_mixing(block)
    x = x0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = block(x)
    out.backward(grad_out)
    return {"output": out.detach(), "input": x.grad, **{n: p.grad for n, p in block.named_parameters()}}


def state(dtype, stream_major, mean=0.0, shape=(2, 8, 4, 16)):
    """A residual state with stream means of their own; stored stream-major as GPT.forward makes it, or contiguous."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=generator) + mean * torch.randn(*shape[:-1], 1, generator=generator).sign()
    x = x.to(dtype)
    return x.movedim(-2, 0).contiguous().movedim(0, -2) if stream_major else x


def assert_equal_steps(fast, ref, rtol, atol):
    assert fast.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(fast[name], ref[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("stream_major", [True, False])
@pytest.mark.parametrize("residual", RESIDUALS)
def test_fused_block_equals_the_formulas_in_fp64(residual, stream_major):
    """A whole Block in fp64, both layouts: the hand-written backwards are the formulas' derivatives to rounding,
    not approximations (fp32 streams and bf16, one connection: tests/kernels/test_paths.py)."""
    dtype = torch.float64
    x0 = state(dtype, stream_major, shape=(2, 8, 1 if residual == "baseline" else 4, 16))
    grad_out = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    fast, ref = (block_step(residual, k, x0, grad_out, dtype) for k in ("fused", "reference"))
    assert_equal_steps(fast, ref, TOLERANCE[dtype], TOLERANCE[dtype])


def test_hc_folded_norm_stays_close_when_streams_have_large_means():
    """hcstudy/kernels/fused.py folds each stream's LayerNorm into the projection (variance as mean(x^2) - mean^2, docs/model.md):
    its fp32 rounding grows with (mean / spread)^2. At a mean 30 times the spread, measured: up to 3.3e-4 of a
    tensor's largest entry apart (the formulas themselves are 7e-5 from fp64 there), against 1.3e-6 at mean 1."""
    x0 = state(torch.float32, True, mean=30.0)
    grad_out = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2))
    fast, ref = (block_step("hc", fk, x0, grad_out) for fk in ("fused", "reference"))
    for name in ref:
        torch.testing.assert_close(fast[name], ref[name], rtol=0, atol=1e-3 * ref[name].abs().max().item(), msg=name)


@pytest.mark.parametrize("residual", RESIDUALS)
def test_fused_block_equals_the_formulas_under_bf16_autocast(residual):
    """The sublayers run in bf16, the mixing in fp32 on both paths: the two differ by the bf16 rounding of inputs
    that differ in their last fp32 bits: measured at most 1.5e-5 apart (gradients up to ~200), so a rounding that
    flips one bf16 bit somewhere stays inside the tolerance."""
    x0 = state(torch.float32, True, shape=(2, 8, 1 if residual == "baseline" else 4, 16))
    grad_out = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2))
    fast, ref = (block_step(residual, fk, x0, grad_out, autocast=True) for fk in ("fused", "reference"))
    assert fast["output"].dtype == torch.float32                         # the streams are never rounded to bf16
    assert_equal_steps(fast, ref, 5e-3, 1e-3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("transposed_res", [False, True])      # H_res of any strides (mHC's is a view)
def test_fused_stream_update_equals_the_formula(dtype, transposed_res):
    generator = torch.Generator().manual_seed(0)
    B, L, n, C = 2, 5, 4, 8
    sublayer = torch.nn.Sequential(torch.nn.LayerNorm(C), torch.nn.Linear(C, C)).to(dtype)
    tensors = [torch.randn(shape, generator=generator).to(dtype)
               for shape in ((B, L, n, C), (B, L, n), (B, L, n), (B, L, n, n))]
    grad_out = torch.randn(B, L, n, C, generator=generator).to(dtype)
    results = []
    for fast in (True, False):
        x, H_pre, H_post, H_res = (t.clone().requires_grad_() for t in tensors)
        H_res_used = H_res.transpose(-1, -2) if transposed_res else H_res
        if fast:                                 # hcstudy/kernels/fused.py takes the coefficients with their stream axes first
            out = fused_module.stream_update(x, H_pre.movedim(-1, 0), H_post.movedim(-1, 0),
                                      H_res_used.movedim((-2, -1), (0, 1)), sublayer)
        else:
            out = stream_update(x, H_pre, H_post, H_res_used, sublayer)
        out.backward(grad_out)
        results.append([out.detach(), x.grad, H_pre.grad, H_post.grad, H_res.grad]
                       + [p.grad.clone() for p in sublayer.parameters()])
        sublayer.zero_grad()
    for fast, ref in zip(*results):
        torch.testing.assert_close(fast, ref, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [0.1, 3.0])
def test_fused_sinkhorn_equals_the_loop(dtype, scale):
    """fused_module.sinkhorn keeps only the sums and recovers each earlier P in its backward (docs/model.md)."""
    generator = torch.Generator().manual_seed(0)
    logits = (scale * torch.randn(64, 4, 4, generator=generator)).to(dtype)
    grad_out = torch.randn(64, 4, 4, generator=generator).to(dtype)
    fast_in, ref_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    fast, ref = fused_module.sinkhorn(fast_in, 20), sinkhorn(ref_in, 20)
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-15 if dtype == torch.float64 else 1e-6)
    fast.backward(grad_out)
    ref.backward(grad_out)
    tol = 1e-12 if dtype == torch.float64 else 2e-5                   # ~80 small steps of other rounding
    torch.testing.assert_close(fast_in.grad, ref_in.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("residual", RESIDUALS)
def test_the_probe_reads_the_same_gains_on_both_paths(residual):
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    probes = []
    for kernels in ("fused", "reference"):
        torch.manual_seed(0)
        model = GPT(tiny_config(residual, depth=2), kernels=kernels)
        randomize_mixing(model)
        probes.append(instability_probe(model, idx, lambda: torch.autocast("cpu", enabled=False), True))
    fast, ref = probes
    assert fast.keys() == ref.keys() and ("amax_bwd_converged" in fast) == (residual == "mhc")
    for key in ref:
        assert fast[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("kernels", ["reference", "fused"])
@pytest.mark.parametrize("residual", RESIDUALS)
def test_one_block_compiles_to_one_graph_and_matches_eager(residual, kernels):
    """fullgraph=True fails on any graph break. aot_eager traces forward and backward as inductor would, without
    its C++ code generation: 0.3-3 s per block here, where inductor takes 13-50 s per tiny model on a 2-core CPU
    (test_compile.py compiles with it); 3 Sinkhorn iterations keep the graph small."""
    x0 = state(torch.float32, True, shape=(2, 8, 1 if residual == "baseline" else 4, 16))
    grad_out = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        block = Block(tiny_config(residual, sinkhorn_iters=3), 1, False, kernels)
        randomize_mixing(block)
        run = torch.compile(block, fullgraph=True, backend="aot_eager") if compiled else block
        x = x0.clone().requires_grad_()
        out, mixing, _ = run(x, return_mixing=True)
        out.backward(grad_out)
        results.append({"output": out.detach(), "input": x.grad, **{n: p.grad for n, p in block.named_parameters()},
                        **{f"record {i}": r[0] for i, r in enumerate(mixing) if r is not None}})
    torch._dynamo.reset()
    # the functionalised graph turns the fused backward's in-place accumulations into out-of-place ones: measured
    # 2e-5 on a gradient of 8 (fused HC), exact elsewhere
    assert_equal_steps(results[1], results[0], 1e-5, 1e-5)


FSDP_ARMS = ("hc", "mhc", "mhc-lite", "identity-hc")      # hcstudy/kernels/fused.py has the first two; the others run the formulas


@pytest.mark.slow
def test_fsdp_gives_the_same_gradients_on_every_path(tmp_path):
    """One 2-process gloo job (tests/support/kernels_fsdp_probe.py): FSDP2 shards the connections on their own, and the
    fused Functions and the Triton kernels (in the interpreter) see sharded-then-gathered parameters of shape (1,)
    for the scalars."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "tests" / "support" / "kernels_fsdp_probe.py"), *FSDP_ARMS], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    worst = json.loads(done.stdout.strip().splitlines()[-1])
    for residual in FSDP_ARMS:
        for kernels in ("fused", "triton"):
            found = worst[f"{residual}/{kernels}"]
            assert found["loss"] < 1e-5 and found["grad"] < 1e-5, worst
            assert found["parameters"] >= 40                        # every block's body and both connections
        assert worst[f"{residual}/triton"]["taken"] == "triton"
        assert worst[f"{residual}/fused"]["taken"] == ("fused" if residual in ("hc", "mhc") else "reference")


@pytest.mark.slow
def test_fifty_steps_through_the_cli_give_the_same_losses_either_way(tmp_path):
    """The whole run as a user starts it, each residual kind with --kernels reference and --kernels fused;
    config.json says which path ran. Measured: at most 5e-7 apart over 50 steps."""
    runs = {}
    for residual in ("hc", "mhc"):
        for kernels in ("reference", "fused"):
            name = f"{residual}_{kernels}"
            runs[name] = subprocess.Popen(
                [sys.executable, str(ROOT / "train_c4.py"), "--preset", "tiny", "--residual", residual, "--kernels",
                 kernels, "--steps", "50", "--ckpt-every", "50", "--eval-every", "50", "--metrics-every", "50",
                 "--layer-metrics-every", "50", "--out", str(tmp_path), "--run-name", name],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    losses = {}
    for name, process in runs.items():
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-2000:]
        run_dir = tmp_path / name
        assert json.loads((run_dir / "config.json").read_text())["kernels"] == name.split("_")[1]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if "loss" in r]
    for residual in ("hc", "mhc"):
        reference, fast = losses[f"{residual}_reference"], losses[f"{residual}_fused"]
        assert len(reference) == len(fast) == 50
        assert max(abs(a - b) for a, b in zip(reference, fast)) < 1e-5
