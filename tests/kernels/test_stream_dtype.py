"""--stream-dtype bf16: the residual state stored in bf16 between sublayers on every path, the coefficients, u, the
mixing and the parameters' gradients in fp32 (docs/model.md, "Precision").

The bounds come from bf16's unit roundoff u = 2^-8 (8 significant bits, round to nearest): one store of a value v
gives fl(v) with |fl(v) - v| <= u |v|. So
  - one connection, whose output is computed in fp32 from a bf16 input and stored once, lies within u |v| of the
    exact (fp64) result elementwise, plus the fp32 coefficients' own error (~1e-7 relative, allowed 1e-5 of the
    largest entry). Rounding twice (the mixing stored in bf16, then H_post y added and stored again) adds a second
    u |H_res x| and breaks that bound; storing in fp32 breaks the dtype.
  - a Block (two connections) against fp64 from the same bf16 input: the output has two stores, the first one
    carried through the second sublayer's mixing (gain ~1): within 2u of the tensor's largest entry. x's gradient
    is rounded at most twice per connection's backward: within 4u. A parameter's gradient sums, over the tokens,
    products of a stored state (<= 2 roundings) and a stored gradient (<= 4): each term within 6u; the scalar gates'
    sums cancel (measured up to 7.2u of their largest entry), so 16u.
"""
import copy
import sys
from pathlib import Path

import pytest
import torch

from hcstudy import arms, stream_mixing
from hcstudy.model import GPT
from helpers import randomize_mixing, tiny_config

sys.path.insert(0, str(Path(__file__).parent))
from test_fused import block_step, state  # noqa: E402

U = 2.0 ** -8
ARMS = arms.METHODS
# every arm on every path it registers (the registry's): a new arm is held to this bound as it lands
CASES = [(name, path) for name, arm in arms.ARMS.items() for path in arm.paths]


def connection(arm, path, n=4, width=16, stream_dtype="bf16"):
    """One randomised connection on `path` (the baseline's is its plain residual) and a fixed fp32 sublayer."""
    if path == "triton":
        pytest.importorskip("triton", reason="triton is not installed (bash setup.sh --dev installs it)")
    cfg = tiny_config(arm, width=width, expansion=n, stream_dtype=stream_dtype)
    torch.manual_seed(0)
    conn = arms.connection(arm)(cfg, 1, path)
    randomize_mixing(torch.nn.ModuleDict({"x_conn": conn}))
    weight = torch.randn(width, generator=torch.Generator().manual_seed(3))
    return conn, lambda u: torch.tanh(u * weight.to(u.dtype))


def bf16_state(arm, n=4, width=16):
    return state(torch.float32, True, shape=(2, 8, 1 if arm == "baseline" else n, width)).bfloat16()


def exact_output(conn, sublayer, x):
    """The connection's output in fp64 from the same (bf16-valued) state: the value a single rounding must meet."""
    reference = copy.deepcopy(conn).double()
    if hasattr(reference, "kernels"):
        reference.kernels = "reference"
    return reference(x.double(), sublayer)[0]


def rounded_once(out, exact):
    """Whether out is a bf16 state within one rounding of exact everywhere (the module's docstring)."""
    slack = 1e-5 * exact.abs().max()
    return out.dtype == torch.bfloat16 and bool(((out.double() - exact).abs() <= U * exact.abs() + slack).all())


@pytest.mark.parametrize("arm,path", CASES)
def test_one_connection_rounds_the_state_once(arm, path):
    conn, sublayer = connection(arm, path)
    x = bf16_state(arm)
    out = conn(x, sublayer)[0]
    assert rounded_once(out, exact_output(conn, sublayer, x))


def rounding_twice(x, H_pre, H_post, H_res, sublayer, autocast=False):
    """The mutation: the mixing H_res x rounded to bf16 before H_post y is added (the connection rounds the sum)."""
    y = sublayer(torch.einsum("...j,...jc->...c", H_pre, x)).to(x.dtype)
    return (H_res @ x).bfloat16().to(x.dtype) + H_post.unsqueeze(-1) * y.unsqueeze(-2)


def test_rounding_twice_is_caught(monkeypatch):
    conn, sublayer = connection("mhc", "reference")
    x = bf16_state("mhc")
    exact = exact_output(conn, sublayer, x)
    monkeypatch.setattr(stream_mixing, "stream_update", rounding_twice)
    assert not rounded_once(conn(x, sublayer)[0], exact)


@pytest.mark.parametrize("arm", ARMS)
def test_a_block_with_bf16_streams_follows_fp64_forward_and_every_gradient(arm):
    x0 = bf16_state(arm)
    grad = torch.randn(x0.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    exact = block_step(arm, "reference", x0.double(), grad.double(), torch.float64)
    found = block_step(arm, "reference", x0, grad)
    assert found["output"].dtype == found["input"].dtype == torch.bfloat16
    for name, value in exact.items():
        if name not in ("input", "output"):
            assert found[name].dtype == torch.float32, name        # parameters' gradients stay fp32
        bound = {"output": 2 * U, "input": 4 * U}.get(name, 16 * U) * value.abs().max().item()
        error = (found[name].double() - value).abs().max().item()
        assert error <= bound, f"{name}: {error:.3g} > {bound:.3g}"


@pytest.mark.parametrize("arm", ["baseline", "mhc"])
def test_the_model_stores_its_state_in_the_stream_dtype(arm):
    cfg = tiny_config(arm, stream_dtype="bf16")
    model = GPT(cfg)
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    model.blocks[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    idx = torch.randint(0, 100, (2, 8))
    logits, loss = model(idx, idx)
    loss.backward()
    assert seen == [torch.bfloat16, torch.bfloat16] and loss.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
