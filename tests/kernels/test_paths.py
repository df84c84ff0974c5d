"""Every fast path an arm registers held to its formulas: one case per arm (the registry's, $HCSTUDY_ARMS's
included) x each path in its `kernels` (fused.py's hand-written backwards, triton_ops.py's kernels, in Triton's
interpreter on the CPU) x stream dtype (--stream-dtype fp32, bf16), the output and every gradient (the input's and
each parameter's) against the formulas' path (--kernels reference) on the same state. Tiny shapes: what the paths
do at several channel chunks, other n, layouts and under autocast is tests/kernels/test_triton_ops.py's and
test_fused.py's.

The bounds, per tensor, as a multiple of its largest entry:
  - fp32 streams: the two paths compute the same fp32 maths in other orders (a fused sum, tl.dot's, Sinkhorn's
    sums kept or recomputed). The output and x's gradient differ by a few ulp (measured at most 2.7e-7): 1e-6.
    The parameters' gradients are sums over every token and stream; a scalar gate's cancels heavily, so that the
    formulas' own fp32 result lies up to 3.9e-5 of it from fp64 (mHC-lite's a_post) and the paths up to 4.3e-5
    apart: 1e-4, set by the formulas' rounding, not the kernels', and far below what a wrong term does (a dropped
    norm term or a transposed H_res moves a gradient by 1e-2 and more).
  - bf16 streams: each path rounds the output once to bf16 from fp32 sums (within u = 2^-8 of the exact value each,
    so 2u apart at most); x's gradient is rounded where each path stores it (the write's dx, then the read's sum:
    up to twice), and the parameters' gradients are fp32 sums of products of those: 4u (measured at most 1.6u).
"""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hcstudy import arms
from test_fused import state
from test_stream_dtype import U, connection

ROOT = Path(__file__).resolve().parents[2]
BOUND = {"fp32": {"output": 1e-6, "x": 1e-6, "parameter": 1e-4}, "bf16": {"output": 2 * U, "x": 4 * U, "parameter": 4 * U}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# every arm on every path it registers, from the registry: a new arm is held to its formulas as it lands
CASES = [(name, path) for name, arm in arms.ARMS.items() for path in arm.kernels]


def step(conn, sublayer, x, grad):
    x = x.clone().requires_grad_()
    out = conn(x, sublayer)[0]
    out.backward(grad)
    return {"output": out.detach(), "x": x.grad, **{name: p.grad for name, p in conn.named_parameters()}}


@pytest.mark.parametrize("stream_dtype", DTYPES)
@pytest.mark.parametrize("arm,path", CASES)
def test_each_path_equals_the_formulas_forward_and_every_gradient(arm, path, stream_dtype):
    fast, sublayer = connection(arm, path, stream_dtype=stream_dtype)
    formulas = copy.deepcopy(fast)
    formulas.kernels = "reference"
    x = state(torch.float32, True, shape=(2, 8, fast.n, fast.width)).to(DTYPES[stream_dtype])
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(x.dtype)
    found, expected = step(fast, sublayer, x, grad), step(formulas, sublayer, x, grad)
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        assert found[name].dtype == value.dtype, name
        bound = BOUND[stream_dtype].get(name, BOUND[stream_dtype]["parameter"]) * value.abs().max().item()
        error = (found[name].double() - value.double()).abs().max().item()
        assert error <= bound, f"{name}: {error:.3g} > {bound:.3g}"


TRIAL = '''"""A throw-away arm: mHC's formulas, registering mHC's fused path as its own."""
from hcstudy.arms import mhc
from hcstudy.kernels import fused
from hcstudy.stream_mixing import fused_update

ARM = dict(name="trial", label="Trial", order=50, summary="a test's arm", paper="none", kernels=("fused",),
           uses=("sinkhorn_iters", "mhc_res_diag", "mhc_gate_init", "mhc_pre_bias", "mhc_post_bias"))


class Connection(mhc.Connection):
    KERNEL_PATHS = {"fused": fused_update(fused.mhc_coefficients)}
'''


@pytest.mark.slow
def test_an_arm_from_hcstudy_arms_is_held_to_its_formulas_without_an_edit_here(tmp_path):
    """The cases come from the registry: a throw-away arm in $HCSTUDY_ARMS with a fused path gets its two cases,
    and they run (a pytest of this file alone, restricted to them)."""
    (tmp_path / "trial.py").write_text(TRIAL)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-k", "trial", __file__],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, arms.EXTRA_ARMS: str(tmp_path)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout, done.stdout[-2000:]
