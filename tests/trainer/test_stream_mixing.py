"""hcstudy/stream_mixing.py: the update every arm with streams shares, against the formula written out by hand."""
import pytest
import torch

from hcstudy.stream_mixing import read_stream, stream_update, wide
from hcstudy.model import GPT
from helpers import randomize_mixing, tiny_config


def test_the_update_is_h_res_x_plus_h_post_times_the_sublayer_of_h_pre_x():
    gen = torch.Generator().manual_seed(0)
    n, width = 3, 5
    x = torch.randn(2, n, width, generator=gen)
    H_pre, H_post = torch.rand(2, n, generator=gen), torch.rand(2, n, generator=gen)
    H_res = torch.rand(2, n, n, generator=gen)
    weight = torch.randn(width, width, generator=gen)

    def sublayer(u):
        return torch.tanh(u @ weight)
    got = stream_update(x, H_pre, H_post, H_res, sublayer)
    for t in range(2):
        u = sum(H_pre[t, j] * x[t, j] for j in range(n))
        y = sublayer(u)
        for i in range(n):
            expected = sum(H_res[t, i, j] * x[t, j] for j in range(n)) + H_post[t, i] * y
            assert torch.allclose(got[t, i], expected, atol=1e-6)


def test_the_streams_are_mixed_in_fp32_even_under_bf16_autocast():
    x = wide(torch.randn(1, 2, 4).bfloat16())
    assert x.dtype == torch.float32 and wide(x.double()).dtype == torch.float64
    ones, eye = torch.ones(1, 2), torch.eye(2).unsqueeze(0)
    read = []                                  # the dtype of what the sublayer reads: H_pre x
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert stream_update(x, ones, ones, eye, lambda u: read.append(u.dtype) or u).dtype == torch.float32
        # the study's --mixing-precision autocast leaves the mixing to the run's autocast
        stream_update(x, ones, ones, eye, lambda u: read.append(u.dtype) or u, autocast=True)
    assert read == [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("read, expected", [("rotate", [0, 1, 2, 3, 0, 1]), ("first", [0] * 6)])
def test_each_sublayer_reads_its_stream_at_init(read, expected):
    cfg = tiny_config("hc", read_stream=read)
    assert [int(read_stream(cfg, k).argmax()) for k in range(6)] == expected
    assert all(int(read_stream(cfg, k).sum()) == 1 for k in range(6))       # one-hot


COEFFICIENT_ARMS = ("hc", "mhc", "mhc-lite", "identity-hc")


def outputs_with_a_changed_future_token(residual, coefficients):
    """The logits of one sequence and of the same sequence with its last token changed."""
    torch.manual_seed(0)
    model = GPT(tiny_config(residual, depth=2, coefficients=coefficients))
    randomize_mixing(model)
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 256
    with torch.no_grad():
        return model(idx), model(changed)


@pytest.mark.parametrize("residual", COEFFICIENT_ARMS)
def test_sequence_coefficients_let_a_future_token_change_earlier_positions(residual):
    before, after = outputs_with_a_changed_future_token(residual, "sequence")
    assert (after[0, :-1] - before[0, :-1]).abs().max() > 1e-6                          # not causal
    before, after = outputs_with_a_changed_future_token(residual, "token")
    torch.testing.assert_close(after[0, :-1], before[0, :-1], rtol=0, atol=0)           # causal


@pytest.mark.parametrize("residual", COEFFICIENT_ARMS)
def test_sequence_coefficients_are_one_set_per_sequence(residual):
    model = GPT(tiny_config(residual, depth=2, coefficients="sequence"))
    randomize_mixing(model)
    mixing = []
    model(torch.randint(0, 256, (3, 16)), mixing_out=mixing)
    assert all(H.shape == (3, 1, model.streams, model.streams) for H, _ in mixing)
