"""hcstudy/kernels/triton_ops.py against the formulas of train_c4.py, run in Triton's interpreter on the CPU (TRITON_INTERPRET=1,
which the module sets where there is no CUDA): forward and every gradient, for every arm, several n, widths that are
not powers of two, token counts that are not multiples of the block, non-contiguous states, bf16 sublayers; the path
choice (--kernels triton, auto) and its fallbacks; a training run through the CLI. The sm_90 compile is
benchmarks/triton_compile.py's (its smoke run is the last test)."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hcstudy import arms
from helpers import tiny_config

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")     # compiled on a GPU, else interpreted
pytest.importorskip("triton", reason="triton is not installed (bash setup.sh --dev installs it)")
from hcstudy.kernels import triton_ops as kernels  # noqa: E402

# the issue's bar: 1e-5 of each tensor's largest entry, against the formulas in fp64. Where the formulas' own fp32
# result lies further from fp64 than that (the gates' and biases' gradients: sums over every token and stream with
# heavy cancellation, measured up to 3e-5 of the largest entry), the bar is 4 times the formulas' own fp32 error
TOLERANCE = 1e-5
ARMS_AND_N = [(arm, n) for arm in ("hc", "mhc", "identity-hc") for n in (1, 2, 3, 4, 8)] + \
             [("mhc-lite", n) for n in (1, 2, 3, 4, 5)]         # n! permutations: 720 at n = 6, 40,320 at 8


def connections(arm, n, width, **overrides):
    """The same randomised connection on the formulas' path (fp64 and fp32) and on the Triton path (fp32)."""
    cfg = tiny_config(arm, width=width, expansion=n, **overrides)
    torch.manual_seed(0)
    reference = arms.connection(arm)(cfg, 1, "reference")
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.3 * torch.randn_like(p))
    fast = arms.connection(arm)(cfg, 1, "triton")
    fast.load_state_dict(reference.state_dict())
    assert fast.kernels == "triton"
    return copy.deepcopy(reference).double().to(DEVICE), reference.to(DEVICE), fast.to(DEVICE)


def step(conn, x, grad_out, weight, dtype=None, autocast=False):
    """Forward (under bf16 autocast if asked) and backward of one connection around a fixed sublayer (tanh of a
    per-channel scale): the output, the probe's record, x's gradient and every parameter's."""
    x = (x if dtype is None else x.to(dtype)).detach().requires_grad_()
    conn.zero_grad()
    seen = {}

    def sublayer(u):
        seen["dtype"] = u.dtype
        return torch.tanh(u * weight.to(u.dtype))

    with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
        out, (H_res, logits) = conn(x, sublayer)
    out.backward(grad_out.to(out.dtype))
    found = {"output": out.detach(), "H_res": H_res, "x": x.grad, "u dtype": seen["dtype"]}
    if logits is not None:
        found["logits"] = logits
    return found | {name: p.grad for name, p in conn.named_parameters()}


def assert_close_to(fast, truth, formulas=None, tolerance=TOLERANCE):
    """Every tensor of `fast` within `tolerance` of truth's largest entry, or within 4 times the distance of the
    formulas' own fp32 result from truth where that is larger."""
    assert fast.keys() == truth.keys()
    for name, value in truth.items():
        if name == "u dtype":
            continue
        limit = tolerance * value.abs().max().item()
        if formulas is not None:
            limit = max(limit, 4 * (formulas[name].double() - value).abs().max().item())
        error = (fast[name].double() - value).abs().max().item()
        assert error <= limit, f"{name}: {error:.3g} > {limit:.3g}"


def inputs(n, width, tokens=13, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, n, width, generator=generator)
    return (x.to(DEVICE), torch.randn(x.shape, generator=generator).to(DEVICE),
            torch.randn(width, generator=generator).to(DEVICE))


@pytest.mark.slow
@pytest.mark.parametrize("arm,n", ARMS_AND_N)
def test_each_arm_equals_the_formulas_forward_and_every_gradient(arm, n):
    width = 40 if n < 8 else 24                          # neither a power of two; 26 tokens: no whole block
    exact, reference, fast = connections(arm, n, width)
    x, grad_out, weight = inputs(n, width)
    truth = step(exact, x, grad_out, weight, torch.float64)
    assert_close_to(step(fast, x, grad_out, weight), truth, step(reference, x, grad_out, weight))


def small_blocks(monkeypatch, project=True):
    """Block sizes forced small: 16 channels a chunk, 2 tokens a program (16 where the kernel runs tl.dot), and the
    read's column pass in 2 token groups of several blocks each (10 programs over 5 chunks; HC's, of 32 channels,
    over 3 chunks in 4 groups); project=False: the mHC family's projection on cuBLAS, as mhc-lite's n! logits take
    it from n = 5."""
    real = kernels.block_sizes
    monkeypatch.setattr(kernels, "block_sizes", lambda n, C: (2, 16, real(n, C)[2]))
    monkeypatch.setattr(kernels, "dot_block_sizes", lambda n, C: (16, 16, real(n, C)[2]))
    monkeypatch.setattr(kernels, "COLUMN_PROGRAMS", 10)
    if not project:
        monkeypatch.setattr(kernels, "PROJECTED_LOGITS", 0)


@pytest.mark.parametrize("arm,n,project", [("hc", 4, True), ("mhc", 4, True), ("mhc", 3, False),
                                           ("mhc-lite", 3, True), ("identity-hc", 3, True)])
def test_widths_over_several_channel_chunks(arm, n, project, monkeypatch):
    """A width of 72 runs 5 chunks, the last one part-full, and 34 tokens 3 blocks of 16 (2 in the first group), so
    that every kernel's loop over chunks (the norms' and the projections' sums across them, the write's second grid
    axis) and the column pass's loop over token blocks and its partial sums carry real work, which widths of at
    most 40 at the real block sizes never reach."""
    small_blocks(monkeypatch, project)
    assert_fp32_chunks_match(arm, n)


def assert_fp32_chunks_match(arm, n):
    exact, reference, fast = connections(arm, n, 72)
    x, grad_out, weight = inputs(n, 72, tokens=17)
    truth = step(exact, x, grad_out, weight, torch.float64)
    assert_close_to(step(fast, x, grad_out, weight), truth, step(reference, x, grad_out, weight))


@pytest.mark.parametrize("arm,n,project", [("hc", 4, True), ("mhc", 4, True), ("mhc", 3, False),
                                           ("identity-hc", 3, True)])
def test_bf16_streams_over_several_channel_chunks(arm, n, project, monkeypatch):
    """The same chunks and token groups with the state in bf16 (--stream-dtype bf16): the kernels load it widened and
    store the state and x's gradient rounded once, so against the formulas on the same bf16 state the output lies
    within 2u of its largest entry and every gradient within 4u (u = 2^-8; tests/kernels/test_paths.py)."""
    small_blocks(monkeypatch, project)
    assert_bf16_chunks_match(arm, n)


def assert_bf16_chunks_match(arm, n):
    _, reference, fast = connections(arm, n, 72, stream_dtype="bf16")
    x, grad_out, weight = inputs(n, 72, tokens=17)
    found, expected = (step(conn, x, grad_out, weight, torch.bfloat16) for conn in (fast, reference))
    assert found["output"].dtype == found["x"].dtype == torch.bfloat16
    for name, value in expected.items():
        if name != "u dtype":
            assert found[name].dtype == value.dtype, name
            bound = (2 if name == "output" else 4) * 2.0 ** -8 * value.abs().max().item()
            assert (found[name].double() - value.double()).abs().max().item() <= bound, name


@pytest.mark.parametrize("assert_chunks_match", [assert_fp32_chunks_match, assert_bf16_chunks_match],
                         ids=["fp32", "bf16"])
def test_mhc_lite_at_n5_projects_its_130_logits_in_the_kernels_in_two_tiles(assert_chunks_match, monkeypatch):
    """mHC-lite at n = 5 has 2n + n! = 130 logits a token: the read kernels project them in a tile of 128 and one of
    16 (triton_ops._logit_tiles), where n = 6's 732 stay on cuBLAS. The two multi-chunk cases above at n = 5, with
    their bounds (fp32 streams: 1e-5 against the fp64 formulas, or 4 times the formulas' own fp32 error; bf16: 2u and
    4u against the formulas on the same bf16 state): the second tile's logits, their share of x's gradient and of
    phi's, and the mix's chunks of 8 permutations go through every kernel's loops."""
    assert kernels._projects(2 * 5 + 120) and not kernels._projects(2 * 6 + 720)
    assert kernels._logit_tiles(2 * 5 + 120) == (128, 16)
    small_blocks(monkeypatch)
    assert_chunks_match("mhc-lite", 5)


@pytest.mark.parametrize("arm", ["hc", "mhc", "mhc-lite"])
def test_non_contiguous_states_and_a_stride_zero_gradient(arm):
    """The layouts the model hands over: a stream-major view (hcstudy/kernels/fused.py's), a strided slice, and the collapse's
    gradient, which reaches the last connection as one stride-0 view over the streams."""
    exact, reference, fast = connections(arm, 3, 24)
    x, grad_out, weight = inputs(3, 24)
    stream_major = x.movedim(-2, 0).contiguous().movedim(0, -2)
    strided = torch.cat([x, torch.randn_like(x)], dim=-1)[..., :24]
    collapse = grad_out[..., :1, :].expand(x.shape)
    for state, grad in ((stream_major, grad_out), (strided, grad_out), (x, collapse)):
        assert not state.is_contiguous() or not grad.is_contiguous()
        assert_close_to(step(fast, state, grad, weight), step(exact, state, grad, weight, torch.float64),
                        step(reference, state, grad, weight))


@pytest.mark.parametrize("arm", ["hc", "mhc"])
def test_under_autocast_the_read_hands_the_sublayer_fp32_u_as_the_formulas_do(arm):
    """One precision policy (docs/model.md, "Precision"): under autocast the read writes u in fp32, as the formulas
    compute it, so that the sublayer's LayerNorm sees the same input; the streams stay fp32. The forward under
    autocast and the backward after it, as the trainer runs them: fp32 throughout, only the summation order differs."""
    _, reference, fast = connections(arm, 4, 40)
    x, grad_out, weight = inputs(4, 40)
    fast_result, ref_result = (step(conn, x, grad_out, weight, autocast=True) for conn in (fast, reference))
    assert fast_result["u dtype"] == ref_result["u dtype"] == torch.float32
    assert fast_result["output"].dtype == torch.float32
    assert_close_to(fast_result, ref_result)


@pytest.mark.parametrize("arm", ["hc", "mhc"])
def test_a_backward_called_under_autocast_keeps_the_reads_matmuls_in_fp32(arm):
    """The read's backward turns autocast off around its cuBLAS matmuls: called inside an autocast it would round
    them to bf16 (2.3e-3 of x's gradient). The formulas' own backward does round there; the trainer never calls it
    so."""
    _, _, fast = connections(arm, 4, 40)
    x, grad_out, weight = inputs(4, 40)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        inside = step(fast, x, grad_out, weight)
    assert_close_to(inside, step(fast, x, grad_out, weight, autocast=True), tolerance=0)


def test_both_sinkhorn_backwards_give_the_same_gradients(monkeypatch):
    exact, reference, fast = connections("mhc", 4, 40)
    x, grad_out, weight = inputs(4, 40)
    truth, formulas = step(exact, x, grad_out, weight, torch.float64), step(reference, x, grad_out, weight)
    for variant in ("stored", "recompute"):
        monkeypatch.setattr(kernels, "SINKHORN_BACKWARD", variant)
        assert_close_to(step(fast, x, grad_out, weight), truth, formulas)


def test_two_runs_give_the_same_bits():
    _, _, fast = connections("mhc", 4, 40)
    x, grad_out, weight = inputs(4, 40)
    first, second = step(fast, x, grad_out, weight), step(fast, x, grad_out, weight)
    for name in first:
        if name != "u dtype":
            assert torch.equal(first[name], second[name]), name


def test_the_self_check_passes_and_catches_a_wrong_kernel(monkeypatch):
    cfg = tiny_config("mhc", width=24, expansion=3)
    make = lambda path: arms.connection("mhc")(cfg, 1, path)          # noqa: E731
    before = torch.random.get_rng_state()
    assert kernels.self_check(make, DEVICE) is None
    assert torch.equal(torch.random.get_rng_state(), before)        # the model's init must not depend on the path
    write = kernels.write
    monkeypatch.setattr(kernels, "write", lambda *args: write(*args) * (1 + 1e-3))
    assert "disagree" in kernels.self_check(make, DEVICE)


def run_cli(tmp_path, name, *flags, env=None):
    done = subprocess.run([sys.executable, str(ROOT / "train_c4.py"), "--preset", "tiny", "--residual", "mhc",
                           "--steps", "4", "--ckpt-every", "4", "--eval-every", "4", "--metrics-every", "2",
                           "--out", str(tmp_path), "--run-name", name, *flags], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-2000:]
    run_dir = tmp_path / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (json.loads((run_dir / "config.json").read_text()), (run_dir / "train.log").read_text(),
            [r["loss"] for r in records if "loss" in r], [r["amax_fwd"] for r in records if "amax_fwd" in r])


@pytest.mark.slow
def test_a_training_run_on_the_triton_path_follows_the_formulas_run(tmp_path):
    """The CLI as a user runs it: --kernels triton in the interpreter gives the formulas' loss curve and probe, says
    which path it took and why; with triton unimportable it falls back to the formulas and warns in one line."""
    config, log, losses, gains = run_cli(tmp_path, "triton", "--kernels", "triton")
    _, _, ref_losses, ref_gains = run_cli(tmp_path, "reference", "--kernels", "reference")
    assert config["kernels"] == "triton" and "interpreter" in config["kernels_reason"]
    assert "streams' kernels: triton (--kernels triton; in Triton's interpreter" in log
    assert losses == pytest.approx(ref_losses, rel=1e-5) and len(losses) == 4
    assert gains == pytest.approx(ref_gains, rel=1e-5)
    shadow = tmp_path / "no_triton"
    (shadow / "triton").mkdir(parents=True)
    (shadow / "triton" / "__init__.py").write_text("raise ImportError('No module named triton (test)')\n")
    config, log, losses, _ = run_cli(tmp_path, "fallback", "--kernels", "triton", env={"PYTHONPATH": str(shadow)})
    assert config["kernels"] == "reference" and losses == pytest.approx(ref_losses, rel=1e-6)
    warnings = [line for line in log.splitlines() if "warning: the triton kernels failed (ImportError" in line]
    assert len(warnings) == 1, log
