"""The fast paths of the model against plain reference code, torch.compile against eager, and the step benchmark."""
import os
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train_c4 as T

ROOT = Path(__file__).resolve().parent.parent


def reference_sinkhorn(logits, iters):
    """docs/model.md word for word, differentiated by autograd."""
    P = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        P = P / P.sum(dim=-2, keepdim=True)
        P = P / P.sum(dim=-1, keepdim=True)
    return P


def reference_stream_update(x, H_pre, H_post, H_res, sublayer):
    """x_next = H_res @ x + H_post^T * F(H_pre @ x), written as einsums."""
    u = torch.einsum("...n,...nc->...c", H_pre, x)
    y = sublayer(u)
    return torch.einsum("...ij,...jc->...ic", H_res, x) + H_post.unsqueeze(-1) * y.unsqueeze(-2)


from helpers import randomize_mixing, tiny_config  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [0.1, 3.0])
def test_sinkhorn_equals_the_reference_loop(dtype, scale):
    generator = torch.Generator().manual_seed(0)
    logits = (scale * torch.randn(64, 4, 4, generator=generator)).to(dtype)
    grad_out = torch.randn(64, 4, 4, generator=generator).to(dtype)
    fast_in, ref_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    fast, ref = T.sinkhorn(fast_in, 20), reference_sinkhorn(ref_in, 20)
    # the first pair runs in the log domain (exact maths, other rounding), the rest are the same divisions
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-15 if dtype == torch.float64 else 1e-6)
    fast.backward(grad_out)
    ref.backward(grad_out)
    # the backward is the same derivative in a different arrangement: equal up to rounding of ~80 small steps
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(fast_in.grad, ref_in.grad, rtol=tol, atol=tol)


def test_sinkhorn_backward_passes_gradcheck_with_few_and_many_iterations():
    for iters in (1, 3):
        m = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda t: T.sinkhorn(t, iters), (m,))


PROJECTIONS = {  # name: (the fast Function, the plain formula, whether it reads the flattened streams, outputs)
    # docs/model.md: z = (v @ phi) / sqrt(mean(v^2) + eps), v = vec(x)
    "rms_scaled": (lambda x, w: T._RMSScaledProjection.apply(x, w, 1e-5)[0],
                   lambda x, w: F.linear(x.flatten(-2), w) * torch.rsqrt(x.flatten(-2).pow(2).mean(-1, keepdim=True)
                                                                         + 1e-5), True, 24),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("stream_major", [False, True])      # the model's layout, and a plain contiguous one
@pytest.mark.parametrize("name", PROJECTIONS)
def test_fused_projections_equal_the_plain_formulas(name, stream_major, dtype):
    fast_fn, plain_fn, flattened, outputs = PROJECTIONS[name]
    shape = (2, 5, 4, 32)
    generator = torch.Generator().manual_seed(0)
    x0 = (3 * torch.randn(*shape, generator=generator) + 1).to(dtype)     # vectors with a mean of their own
    if stream_major:
        x0 = x0.movedim(-2, 0).contiguous().movedim(0, -2)
    w0 = torch.randn(outputs, shape[-1] * (shape[-2] if flattened else 1), generator=generator).to(dtype)
    out_shape = (*shape[:-2], outputs) if flattened else (*shape[:-1], outputs)
    grad_out = torch.randn(*out_shape, generator=generator).to(dtype)
    results = []
    for fn in (fast_fn, plain_fn):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        z = fn(x, w)
        z.backward(grad_out)
        results.append((z.detach(), x.grad, w.grad))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for fast, ref in zip(*results):
        torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)
    small = (torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True),
             torch.randn(4, 18 if flattened else 6, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(fast_fn, small)


def reference_coefficients(conn, x):
    """H_pre, H_post, H_res of a connection as the papers write them, every step through autograd."""
    n = conn.n
    if isinstance(conn, T.HyperConnection):
        d = torch.tanh(F.linear(F.layer_norm(x, x.shape[-1:], eps=conn.eps), conn.dynamic.weight))
        A_r = conn.s_a * d[..., 1:n + 1] + conn.A_r_static
        return (conn.s_a * d[..., 0] + conn.A_m_static, conn.s_b * d[..., n + 1] + conn.B_static,
                A_r.transpose(-1, -2))
    v = x.flatten(-2)
    z = F.linear(v, conn.phi.weight) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + conn.eps)
    z_pre, z_post, z_res = z.split([n, n, n * n], dim=-1)
    return (torch.sigmoid(conn.a_pre * z_pre + conn.b_pre), 2 * torch.sigmoid(conn.a_post * z_post + conn.b_post),
            reference_sinkhorn(conn.a_res * z_res.unflatten(-1, (n, n)) + conn.b_res, conn.iters))


@pytest.mark.parametrize("stream_major", [False, True])
@pytest.mark.parametrize("mean", [1.0, 30.0])     # stream means of their own, up to 30x the spread of 1
def test_hc_coefficients_equal_the_plain_formulas(mean, stream_major):
    """_HCCoefficients folds each stream's LayerNorm into the projection (variance as mean(x^2) - mean^2):
    against LayerNorm then the projection, tanh and scales through autograd, outputs and every gradient (fp32, as
    the model computes its coefficients; gradcheck below covers fp64)."""
    cfg = tiny_config("hc", width=32, heads=2)
    connection = T.HyperConnection(cfg, 1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in connection.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    x0 = (torch.randn(2, 5, cfg.expansion, cfg.width, generator=generator)
          + mean * torch.randn(2, 5, cfg.expansion, 1, generator=generator).sign())
    if stream_major:
        x0 = x0.movedim(-2, 0).contiguous().movedim(0, -2)
    grads_out = [torch.randn(shape, generator=generator) for shape in ((2, 5, 4), (2, 5, 4), (2, 5, 4, 4))]
    results = []
    for fast in (True, False):
        x = x0.clone().requires_grad_()
        outputs = connection.coefficients(x)[:3] if fast else reference_coefficients(connection, x)
        torch.autograd.backward(outputs, grads_out)
        results.append([o.detach() for o in outputs] + [x.grad] + [p.grad.clone() for p in connection.parameters()])
        connection.zero_grad()
    # fp32: the folded variance's rounding grows with (mean / spread)^2, ~1e-7 * 900 at the worst tested here
    tol = 2e-5 if mean < 10 else 2e-4
    for fast, ref in zip(*results):
        torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)


def test_hc_coefficients_backward_passes_gradcheck():
    n, C = 3, 5
    inputs = [torch.randn(shape, dtype=torch.float64, requires_grad=True)
              for shape in ((2, 3, n, C), (n + 2, C), (n,), (n, n), (n,), (), ())]
    assert torch.autograd.gradcheck(lambda *a: T._HCCoefficients.apply(*a, 1e-5)[:3], inputs)


@pytest.mark.parametrize("residual", ["hc", "mhc"])
def test_connection_equals_the_plain_formulas(residual):
    """One connection, forward and every gradient, against reference_coefficients + reference_stream_update:
    checks that x's gradient, gathered in place through the projection's passed-through output, is whole."""
    cfg = tiny_config(residual, width=16, heads=2)
    connection = (T.HyperConnection if residual == "hc" else T.ManifoldHyperConnection)(cfg, 1)
    sublayer = torch.nn.Sequential(torch.nn.LayerNorm(cfg.width), torch.nn.Linear(cfg.width, cfg.width))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in connection.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    x0 = torch.randn(2, 5, cfg.expansion, cfg.width, generator=generator) + 0.5
    grad_out = torch.randn(x0.shape, generator=generator)
    results = []
    for fast in (True, False):
        x = x0.clone().requires_grad_()
        out = connection(x, sublayer)[0] if fast else reference_stream_update(
            x, *reference_coefficients(connection, x), sublayer)
        out.backward(grad_out)
        results.append([out.detach(), x.grad] + [p.grad.clone() for p in connection.parameters()]
                       + [p.grad.clone() for p in sublayer.parameters()])
        connection.zero_grad()
        sublayer.zero_grad()
    for fast, ref in zip(*results):
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("transposed_res", [False, True])      # H_res of any strides (mHC's is a view)
def test_stream_update_equals_the_einsum_reference(dtype, transposed_res):
    generator = torch.Generator().manual_seed(0)
    B, L, n, C = 2, 5, 4, 8
    sublayer = torch.nn.Sequential(torch.nn.LayerNorm(C), torch.nn.Linear(C, C)).to(dtype)
    tensors = [torch.randn(shape, generator=generator).to(dtype)
               for shape in ((B, L, n, C), (B, L, n), (B, L, n), (B, L, n, n))]
    grad_out = torch.randn(B, L, n, C, generator=generator).to(dtype)
    results = []
    for fn in (T.stream_update, reference_stream_update):
        x, H_pre, H_post, H_res = (t.clone().requires_grad_() for t in tensors)
        H_res_used = H_res.transpose(-1, -2) if transposed_res else H_res
        if fn is T.stream_update:                 # it takes the coefficients with their stream axes first
            out = fn(x, H_pre.movedim(-1, 0), H_post.movedim(-1, 0), H_res_used.movedim((-2, -1), (0, 1)), sublayer)
        else:
            out = fn(x, H_pre, H_post, H_res_used, sublayer)
        out.backward(grad_out)
        results.append([out.detach(), x.grad, H_pre.grad, H_post.grad, H_res.grad]
                       + [p.grad.clone() for p in sublayer.parameters()])
        sublayer.zero_grad()
    # matmuls against einsum + broadcast: the same sums, possibly in another order
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for fast, ref in zip(*results):
        torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("residual", ["baseline", "hc", "mhc"])
def test_compiled_blocks_agree_with_eager_without_graph_breaks(residual):
    """block.compile() (what --compile does) against eager: loss and every gradient, then the instability probe.

    Tolerance: inductor fuses the small ops and may reassociate reductions (LayerNorm, softmax, the Sinkhorn
    sums), which in fp32 moves results by a few ulp; measured on this model: loss identical, largest gradient
    difference 8e-8 (absolute; gradients are O(1e-2..1)). atol 1e-6 / rtol 1e-4 is ten times that, and far
    below what a semantic difference does (a wrong transpose, a dropped normalisation or a lost stream change
    the gradients at the 1e-2 level). Three Sinkhorn iterations instead of 20 keep the compile short: the
    code path is the same, the unrolled graph smaller."""
    from torch._dynamo.utils import counters
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = T.GPT(tiny_config(residual, depth=2, sinkhorn_iters=3))
        randomize_mixing(model)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            for block in model.blocks:
                block.compile()
        for _ in range(2):                                        # the second call runs the cached graph
            model.zero_grad()
            _, loss = model(idx, idx)
            loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # steady state: one graph serves both blocks, nothing fell back to eager
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_probe_needs_one_graph_whatever_the_depth():
    """The probe collects every block's H_res. Passed in as a list, the list made dynamo guard on its length:
    one graph per block, past the recompile limit (8) at depth > 6, so the deep models fell back to eager."""
    from torch._dynamo.utils import counters
    model = T.GPT(tiny_config("hc", depth=10))
    idx = torch.randint(0, 256, (2, 16))
    eager = T.instability_probe(model, idx, lambda: torch.autocast("cpu", enabled=False), with_layers=True)
    torch._dynamo.reset()
    counters.clear()
    for block in model.blocks:
        block.compile()
    for _ in range(2):
        compiled = T.instability_probe(model, idx, lambda: torch.autocast("cpu", enabled=False), with_layers=True)
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
    out = T.stream_update(x.movedim(0, -2), H_pre, H_post, H_res, lambda u: u)
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
