"""The planner's step time: the work of a step counted on the real model (kernel launches, the bytes every kernel
that is not a matmul of the width moves) and priced at a device's rates (hcstudy/planner; docs/planning.md)."""
import dataclasses

import pytest
import torch

from hcstudy.planner import run_time

from hcstudy.planner import step_work
from hcstudy.config import Config, parse_config
from hcstudy.model import GPT, MLP, count_parameters

H100 = "NVIDIA H100 80GB HBM3"


def work(residual: str, path: str, **settings):
    return step_work.step_work(GPT, step_work.work_key(Config(residual=residual, **settings)), path)


def test_an_elementwise_op_is_one_launch_moving_its_inputs_and_output():
    x = torch.ones(8, 64)
    with step_work.counting(64) as counter:
        x + 1
    assert (counter.launches, counter.bytes) == (1, 2 * x.nbytes)
    with step_work.counting(64) as counter:
        x.expand(3, 8, 64) * 2                       # a broadcast input is read once: its strides' span
    assert (counter.launches, counter.bytes) == (1, x.nbytes + 3 * x.nbytes)
    with step_work.counting(64) as counter:
        x.view(64, 8).t()                            # views launch nothing
    assert (counter.launches, counter.bytes) == (0, 0)


def test_matmuls_of_the_width_are_priced_by_flops_the_mixings_by_bytes():
    tokens, width, n = 16, 128, 4
    x, weight, grad = torch.ones(tokens, width), torch.ones(width, 3 * width), torch.ones(3 * width, tokens)
    state, mixing = torch.ones(tokens, n * width), torch.ones(n * width, n + 2)
    with step_work.counting(width) as counter:
        x @ weight                                   # a block's projection: its FLOPs are in flops_per_token
        grad @ x                                     # and its weight gradient
    assert (counter.launches, counter.bytes) == (2, 0)
    with step_work.counting(width) as counter:
        out = state @ mixing                         # HC's coefficients: bandwidth-bound, counted as bytes
    assert counter.launches == 1 and counter.bytes == state.nbytes + mixing.nbytes + out.nbytes


def test_a_triton_operator_counts_as_its_kernel_alone():
    """The triton path's operators (hcstudy/kernels/triton_library.py) launch their kernel, under counting a stub
    that adds the bytes triton_ops.traffic gives it: the operator's own call is no second launch."""
    from hcstudy.kernels import triton_library, triton_ops
    n, width, tokens = 4, 64, 8
    assert triton_library.NAMESPACE == "hcstudy"
    inputs = torch.ones(tokens, n, width), torch.ones(tokens, width), torch.ones(tokens, n, n), torch.ones(tokens, n)
    with step_work.counting(width, ("mhc", n, tokens, 4)) as counter:
        torch.ops.hcstudy.write_forward(*inputs)
    assert (counter.launches, counter.bytes) == (1, tokens * triton_ops.traffic("mhc", n, width)["_write_forward"])


def test_one_more_op_in_a_block_counts_its_launches_and_bytes_as_the_formula_says(monkeypatch):
    plain = work("baseline", "reference")
    monkeypatch.setattr(MLP, "forward", lambda self, x: self.proj(torch.nn.functional.gelu(self.fc(x))).neg())
    step_work.step_work.cache_clear()
    try:
        more = work("baseline", "reference")
    finally:
        step_work.step_work.cache_clear()
    # neg forward and its gradient's neg backward, each reading and writing the MLP's bf16 output of `width` values
    assert more.launches == (plain.launches[0] + 2, plain.launches[1])
    assert more.block_bytes == pytest.approx((plain.block_bytes[0] + 4 * 2, plain.block_bytes[1]))
    assert more.rest_bytes == pytest.approx(plain.rest_bytes)


@pytest.mark.slow
def test_the_fit_in_width_predicts_a_count_at_another_width():
    key = step_work.work_key(Config(residual="mhc", dtype="bf16"))
    fitted = step_work.step_work(GPT, key, "reference")
    width = 3 * step_work._counted_width(key)
    counts = {d: step_work.count_steps(GPT, key, "reference", width, d) for d in (1, 2)}
    per_token = {d: (c[2][1] - c[1][1]) / step_work.COUNT_SEQ for d, c in counts.items()}
    assert per_token[2] - per_token[1] == pytest.approx(fitted.block_bytes_per_token(width))
    assert counts[2][1][0] - counts[1][1][0] == fitted.launches[0]


def test_the_paths_differ_as_their_code_does():
    """mHC's formulas launch hundreds of kernels a block (20 Sinkhorn iterations of small ops, forward and backward);
    the triton path a few per connection, with fewer bytes; the baseline the least."""
    base, reference, fused, triton = (work("baseline", "reference"), work("mhc", "reference"),
                                      work("mhc", "fused"), work("mhc", "triton"))
    assert reference.launches[0] > 600 and fused.launches[0] < reference.launches[0]
    assert base.launches[0] < triton.launches[0] < 100
    width = 2048
    assert (base.block_bytes_per_token(width) < triton.block_bytes_per_token(width)
            < fused.block_bytes_per_token(width) < reference.block_bytes_per_token(width))


def test_the_triton_kernels_bytes_are_counted_in_full(monkeypatch):
    """Each triton kernel a connection launches (its stub) counts the bytes triton_ops.traffic gives it per token:
    a byte more per kernel and token is one more per launch, two connections a block."""
    from hcstudy.kernels import triton_ops
    plain, traffic = work("mhc", "triton"), triton_ops.traffic
    kernels = [name for name in traffic("mhc", 4, 64) if name.startswith("_")]
    monkeypatch.setattr(triton_ops, "traffic", lambda *args, **kw: {k: v + k.startswith("_")
                                                                     for k, v in traffic(*args, **kw).items()})
    step_work.step_work.cache_clear()
    try:
        more = work("mhc", "triton")
    finally:
        step_work.step_work.cache_clear()
    assert len(kernels) == 5 and more.launches == plain.launches
    assert more.block_bytes == pytest.approx((plain.block_bytes[0], plain.block_bytes[1] + 2 * len(kernels)))


def test_a_step_is_bound_by_its_largest_term_and_host_time_overlaps_on_a_gpu():
    big = parse_config(["--depth", "32", "--batch-size", "32"])
    params = count_parameters(big)
    cost = run_time.step_cost(GPT, big, params, "triton", 8, 1, run_time.gpu_rates(H100))
    assert cost.dominant in ("matmuls", "memory")
    device = [sum(cost.terms[t][i] for t in ("matmuls", "memory", "launch gaps")) for i in (0, 1)]
    assert cost.seconds == pytest.approx(tuple(device)) and cost.seconds[0] < cost.seconds[1]
    small = parse_config(["--preset", "demo"])                # a tiny model: the host issues ops slower than
    tiny = run_time.step_cost(GPT, small, count_parameters(small), "reference", 16, 1, run_time.gpu_rates(H100))
    assert tiny.dominant == "host" and tiny.seconds == pytest.approx(tiny.terms["host"])   # the GPU runs them
    faster = dataclasses.replace(run_time.gpu_rates(H100), bandwidth=tuple(2 * b for b in run_time.gpu_rates(H100).bandwidth))
    assert run_time.step_cost(GPT, big, params, "triton", 8, 1, faster).terms["memory"] == pytest.approx(
        tuple(t / 2 for t in cost.terms["memory"]))


def test_the_planned_path_follows_kernels_and_the_checks_fastest_timing():
    mhc, gpu = Config(residual="mhc"), "NVIDIA H200"
    assert run_time.planned_path(mhc, gpu, None) == "triton" and run_time.planned_path(mhc, "cpu", None) == "fused"
    assert run_time.planned_path(Config(residual="baseline"), gpu, None) == "reference"
    assert run_time.planned_path(Config(residual="mhc", kernels="fused"), gpu, None) == "fused"
    check = {"gpu": gpu, "timings": {"mhc": {"reference/eager": {"step_s": 1.0}, "fused/eager": {"step_s": 0.5},
                                             "triton/eager": None}}}
    assert run_time.planned_path(mhc, gpu, check) == "fused"
    assert run_time.planned_path(mhc, "NVIDIA H100 80GB HBM3", check) == "triton"       # timed on another card
    assert run_time.planned_path(Config(residual="mhc", coefficients="sequence"), gpu, None) == "reference"


def test_the_cpu_is_priced_at_its_own_timed_rates():
    demo = parse_config(["--preset", "demo", "--residual", "mhc"])
    estimate = run_time.run_time(GPT, demo, count_parameters(demo), 16, 1, "cpu", "fused")
    assert estimate is not None and 0 < estimate.step[0] < estimate.step[1] and estimate.total[0] > 600 * estimate.step[0]
    rates = run_time.device_rates(run_time.device_config(demo, "cpu"), 16, "cpu")
    assert not rates.overlapped and all(r > 0 for r in (*rates.flops, *rates.bandwidth, *rates.host))
