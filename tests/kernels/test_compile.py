"""torch.compile against eager, and the benchmarks (the fused path against the formulas: test_fused.py)."""
import os
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hcstudy.kernels import fused as fused_module
from hcstudy.distributed import Dist, wrap_model
from hcstudy.metrics import instability_probe
from hcstudy.model import GPT
from helpers import randomize_mixing, tiny_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
def test_compiled_blocks_agree_with_eager_without_graph_breaks(residual):
    """block.compile() (what --compile does) against eager: loss and every gradient, then the instability probe.

    Tolerance: inductor fuses the small ops and may reassociate reductions (LayerNorm, softmax, the Sinkhorn
    sums), which in fp32 moves results by a few ulp; measured on this model: loss identical, largest gradient
    difference 8e-8 (absolute; gradients are O(1e-2..1)). atol 1e-6 / rtol 1e-4 is ten times that, and far
    below what a semantic difference does (a wrong transpose, a dropped normalisation or a lost stream change
    the gradients at the 1e-2 level). Three Sinkhorn iterations instead of 20 keep the compile short: the
    code path is the same, the unrolled graph smaller."""
    def compile_blocks(model):
        for block in model.blocks:
            block.compile()
    counters = compiled_against_eager(lambda: GPT(tiny_config(residual, depth=2, sinkhorn_iters=3)), compile_blocks)
    # steady state: one graph serves both blocks, nothing fell back to eager
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])


def compiled_against_eager(make_model, compile_model):
    """make_model()'s loss and every gradient, eager and after compile_model(model), two steps each (the second runs
    the cached graph), held equal (the tolerance: test_compiled_blocks_agree_with_eager_without_graph_breaks's);
    returns dynamo's counters of the compiled run."""
    from torch._dynamo.utils import counters
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = make_model()
        randomize_mixing(model)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_model(model)
        for _ in range(2):
            model.zero_grad()
            _, loss = model(idx, idx)
            loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    return counters


@pytest.mark.parametrize("residual, loss", [("baseline", "plain"), ("mhc", "plain"), ("baseline", "fused")])
def test_the_whole_model_compiled_agrees_with_eager_in_one_graph(monkeypatch, residual, loss):
    """--compile-scope model (wrap_model: the GPT compiled whole, not its blocks): embedding, blocks, final norm and
    either loss in one graph, nothing left to eager; loss and every gradient as eager. On the aot_eager backend (the
    graph Dynamo and AOTAutograd trace, without inductor's code generation, minutes on this CPU; inductor was run by
    hand: one graph too, gradients within 2e-8): measured identical to eager."""
    from functools import partialmethod
    monkeypatch.setattr(torch.nn.Module, "compile", partialmethod(torch.nn.Module.compile, backend="aot_eager"))
    cfg = tiny_config(residual, depth=2, sinkhorn_iters=3, compile=True, compile_scope="model")

    def compile_as_the_trainer(model):
        wrap_model(model, cfg, Dist(0, 1, torch.device("cpu")), torch.float32)
        assert model._compiled_call_impl is not None
        assert all(block._compiled_call_impl is None for block in model.blocks)
    counters = compiled_against_eager(lambda: GPT(cfg, loss=loss), compile_as_the_trainer)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert counters["frames"]["total"] == counters["frames"]["ok"]


def test_compiled_probe_needs_one_graph_whatever_the_depth():
    """The probe collects every block's H_res. Passed in as a list, the list made dynamo guard on its length:
    one graph per block, past the recompile limit (8) at depth > 6, so the deep models fell back to eager."""
    from torch._dynamo.utils import counters
    model = GPT(tiny_config("hc", depth=10))
    idx = torch.randint(0, 256, (2, 16))
    eager = instability_probe(model, idx, lambda: torch.autocast("cpu", enabled=False), with_layers=True)
    torch._dynamo.reset()
    counters.clear()
    for block in model.blocks:
        block.compile()
    for _ in range(2):
        compiled = instability_probe(model, idx, lambda: torch.autocast("cpu", enabled=False), with_layers=True)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert counters["frames"]["total"] == counters["frames"]["ok"]           # no frame gave up and ran eager
    assert compiled["layer_gain_fwd"] == pytest.approx(eager["layer_gain_fwd"], rel=1e-5)


def test_memory_benchmark_runs_in_smoke_mode_and_refuses_the_real_sizes_without_cuda(tmp_path):
    script = str(ROOT / "benchmarks" / "bench_memory.py")
    done = subprocess.run([sys.executable, script, "--smoke", "--depths", "2", "--json", str(tmp_path / "m.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    row = json.loads((tmp_path / "m.json").read_text())["rows"][0]
    assert row["depth"] == 2 and row["planned_allocated_gib"] >= 0 and row["measured_peak_gib"] is None
    if not torch.cuda.is_available():
        refused = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "needs a CUDA device" in refused.stderr


def test_step_benchmark_runs_in_smoke_mode():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--smoke", "--json"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hc/baseline" in done.stdout and "smoke" in done.stdout


def test_op_benchmark_lists_the_stream_work_of_hc_and_mhc():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ops.py"), "--smoke", "--top", "40"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    hc, mhc = done.stdout.split("== hc minus baseline")[1].split("== mhc minus baseline")
    assert "addcmul_" in hc and "tanh" in hc            # the stream mixing and HC's coefficient function
    assert "logsumexp" in mhc and "div" in mhc          # the Sinkhorn's log-domain pair and its divisions


def test_mixing_benchmark_times_the_trainers_maths(capsys):
    """bench_mixing's pointwise formulas (the ones it compiles) are the trainer's stream update and its gradients,
    and the script runs end to end (in this process: no second torch import)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_mixing
    n, tokens, C = 3, 5, 8
    x = torch.randn(n, tokens, C, dtype=torch.float64, requires_grad=True)
    H_pre, H_post = torch.randn(n, tokens, dtype=torch.float64), torch.randn(n, tokens, dtype=torch.float64)
    H_res, grad = torch.randn(n, n, tokens, dtype=torch.float64), torch.randn(n, tokens, C, dtype=torch.float64)
    coefficients = [H.requires_grad_() for H in (H_pre, H_post, H_res)]
    out = fused_module.stream_update(x.movedim(0, -2), H_pre, H_post, H_res, lambda u: u)
    expected = torch.autograd.grad(out, (x, *coefficients), grad.movedim(0, -2))
    with torch.no_grad():
        u = bench_mixing.read(H_pre, x)
        assert torch.allclose(bench_mixing.write(H_res, x, H_post, u), out.movedim(-2, 0))
        grad_x, grad_u, grad_H_res, grad_H_post = bench_mixing.write_backward(grad, H_res, x, H_post, u)
        grad_x, grad_H_pre = bench_mixing.read_backward(grad_u, H_pre, x, grad_x)
    for got, want in zip((grad_x, grad_H_pre, grad_H_post, grad_H_res), expected):
        assert torch.allclose(got, want)
    assert bench_mixing.main(["--smoke"]) == 0
    printed = capsys.readouterr().out
    assert "eager" in printed and "floor" in printed and "overhead per connection" in printed


def test_saved_activation_bytes_drop_with_checkpointing():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_step
    args = bench_step.parse_args(["--smoke"])
    for residual in ("baseline", "mhc"):
        plain = bench_step.saved_activation_bytes(args, residual, False, torch.device("cpu"))
        checkpointed = bench_step.saved_activation_bytes(args, residual, True, torch.device("cpu"))
        assert 0 < checkpointed < plain
