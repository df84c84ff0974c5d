"""hcstudy/arms/study_mhc.py: the public study's mHC (the norm before the projection, tanh, its biases, its
rows-first Sinkhorn) against the study's layer rebuilt in tests/support/study_layer.py."""
import math

import pytest
import torch
import torch.nn.functional as F

from hcstudy import arms
from study_layer import (N, WIDTH, StudyConnection, assert_equals_the_studys_layer_in_fp64,
                         assert_the_same_biases_at_init, copy_into, study_config, study_sinkhorn)


def test_it_starts_where_the_study_starts():
    """mHC's H_res diagonal 0.711, H_pre 0.88 / 0.5, H_post 1.76 / 1."""
    ours = assert_the_same_biases_at_init("study-mhc")
    H_pre, H_post, H_res, _ = ours.coefficients(torch.zeros(1, 1, N, WIDTH))
    assert H_res[0, 0, 0, 0].item() == pytest.approx(math.e ** 2 / (math.e ** 2 + 3), abs=1e-6)
    assert H_pre[0, 0].tolist() == pytest.approx([0.8808, 0.5, 0.5, 0.5], abs=1e-4)
    assert H_post[0, 0].tolist() == pytest.approx([1.7616, 1, 1, 1], abs=1e-4)


def test_it_equals_the_studys_layer_in_fp64():
    assert_equals_the_studys_layer_in_fp64("study-mhc")


def test_under_bf16_autocast_the_studys_norm_first_order_gives_its_coefficients_to_the_bit():
    """The study divides vec(x) by its RMS before its bf16 projections, so that z, tanh(z) and a * z stay bf16:
    the study's mHC does so and equals its coefficients to the bit; the paper's order (ours, dividing the
    projection's output, as the kernels fuse it) gives z in fp32 and other roundings."""
    x = torch.randn(3, 1, N, WIDTH)
    torch.manual_seed(0)
    study = StudyConnection(True)
    with torch.no_grad():
        for p in study.parameters():
            p.add_(0.5 * torch.randn_like(p))
        v = study.norm(x.flatten(-2))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        pre, post, res = (torch.tanh(theta(v)) for theta in (study.theta_pre, study.theta_post, study.theta_res))
        H_study = (torch.sigmoid(study.alpha_pre * pre + study.b_pre),
                   2 * torch.sigmoid(study.alpha_post * post + study.b_post),
                   study_sinkhorn(study.alpha_res * res.unflatten(-1, (N, N)) + study.b_res))
    ours = arms.connection("study-mhc")(study_config("study-mhc"), 3)
    copy_into(ours, study)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        H_ours = ours.coefficients(x)[:3]
        # the paper's order on the same weights, with the study's tanh added after it
        inv_rms = torch.rsqrt(x.flatten(-2).square().mean(-1, keepdim=True) + ours.eps)
        z = torch.tanh(F.linear(ours.scaled(x).flatten(-2), ours.phi.weight) * inv_rms)
    differences = [max((mine - theirs).abs().max().item() for mine, theirs in zip(H_ours, H_study)),
                   (z - torch.tanh(v @ torch.cat([study.theta_pre.weight, study.theta_post.weight,
                                                  study.theta_res.weight]).T)).abs().max().item()]
    assert differences[0] == 0 and differences[1] > 1e-4
