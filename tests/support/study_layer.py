"""The public study's HC and mHC layer, rebuilt from its choices as docs/model.md's table lists them ("The public
study's model"): separate Linears of the flattened state, tanh, the study's biases and Sinkhorn, an RMSNorm with a
learnable scale. tests/arms/test_study_hc.py and test_study_mhc.py hold our arms to it: the same weights copied in
must give the same output and gradients in fp64."""
import torch
import torch.nn as nn

from hcstudy import arms
from hcstudy.config import parse_config
from hcstudy.model import MLP, PreNorm

N, WIDTH, ITERS = 4, 16, 20


def study_config(residual, *flags):
    return parse_config(["--preset", "tiny,seed-study", "--residual", residual, "--expansion", str(N), *flags])


class StudyRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), 1e-8

    def forward(self, v):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def study_sinkhorn(logits):
    P = torch.exp(logits)
    for _ in range(ITERS):
        P = P / (P.sum(-1, keepdim=True) + 1e-8)
        P = P / (P.sum(-2, keepdim=True) + 1e-8)
    return P


class StudyConnection(nn.Module):
    """The study's HC (mhc=False) or mHC on streams x (B, T, n, C): coefficients from the streams pooled over the
    sequence and flattened, then x_next = H_res x + H_post^T F(H_pre x)."""

    def __init__(self, mhc):
        super().__init__()
        self.mhc, stream0 = mhc, torch.eye(N)[0]
        self.norm = StudyRMSNorm(N * WIDTH)
        self.theta_pre, self.theta_post = nn.Linear(N * WIDTH, N, bias=False), nn.Linear(N * WIDTH, N, bias=False)
        self.theta_res = nn.Linear(N * WIDTH, N * N, bias=False)
        self.alpha_pre, self.alpha_post, self.alpha_res = (nn.Parameter(torch.tensor(0.01)) for _ in range(3))
        scale = 2.0 if mhc else 1.0         # mHC: b_pre[0] = b_post[0] = 2, b_res = 2 I; HC: 1, 1, I
        self.b_pre, self.b_post = nn.Parameter(scale * stream0), nn.Parameter(scale * stream0)
        self.b_res = nn.Parameter(scale * torch.eye(N))

    def forward(self, x, sublayer):
        v = self.norm(x.mean(1).flatten(-2))                                   # (B, nC)
        pre, post, res = (torch.tanh(theta(v)) for theta in (self.theta_pre, self.theta_post, self.theta_res))
        res = res.view(-1, N, N)
        if self.mhc:
            H_pre = torch.sigmoid(self.alpha_pre * pre + self.b_pre)
            H_post = 2 * torch.sigmoid(self.alpha_post * post + self.b_post)
            H_res = study_sinkhorn(self.alpha_res * res + self.b_res)
        else:
            H_pre, H_post = self.alpha_pre * pre + self.b_pre, self.alpha_post * post + self.b_post
            H_res = self.alpha_res * res + self.b_res
        y = sublayer(torch.einsum("bn,btnc->btc", H_pre, x))
        return torch.einsum("bij,btjc->btic", H_res, x) + H_post[:, None, :, None] * y[:, :, None, :]


def counterparts(ours, study):
    """(our parameter, the study's parameter or parameters it holds): the three Linears are the blocks of one."""
    weight = [study.theta_pre.weight, study.theta_post.weight, study.theta_res.weight]
    pairs = [(ours.norm_scale, study.norm.weight)]
    if study.mhc:
        pairs += [(ours.phi.weight, weight), (ours.a_pre, study.alpha_pre), (ours.a_post, study.alpha_post),
                  (ours.a_res, study.alpha_res), (ours.b_pre, study.b_pre), (ours.b_post, study.b_post),
                  (ours.b_res, study.b_res)]
    else:
        pairs += [(ours.dynamic.weight, weight), (ours.s_a, study.alpha_pre), (ours.s_b, study.alpha_post),
                  (ours.s_r, study.alpha_res), (ours.A_m_static, study.b_pre), (ours.B_static, study.b_post),
                  (ours.A_r_static, study.b_res)]
    return pairs


def flat(theirs, grad=False):
    """The study's parameter(s), or their gradients, as one flat tensor in our layout."""
    return torch.cat([(p.grad if grad else p).detach().reshape(-1) for p in
                      (theirs if isinstance(theirs, list) else [theirs])])


def copy_into(ours, study):
    with torch.no_grad():
        for mine, theirs in counterparts(ours, study):
            mine.copy_(flat(theirs).view_as(mine))


def assert_the_same_biases_at_init(residual):
    """At init our connection's biases and scales (0.01) are the study's."""
    ours, study = arms.connection(residual)(study_config(residual), 5), StudyConnection(residual == "study-mhc")
    for mine, theirs in counterparts(ours, study)[2:]:
        assert torch.equal(mine.detach().reshape(-1), flat(theirs))
    return ours


def assert_equals_the_studys_layer_in_fp64(residual):
    """Random weights far from init, copied in: the same output and the same gradients, to 1e-10."""
    cfg = study_config(residual)
    torch.manual_seed(0)
    ours, study = arms.connection(residual)(cfg, 3).double(), StudyConnection(residual == "study-mhc").double()
    with torch.no_grad():
        for p in study.parameters():
            p.copy_(p + 0.5 * torch.randn_like(p))
    copy_into(ours, study)
    pairs = counterparts(ours, study)
    sublayer = PreNorm(cfg, MLP(cfg)).double()
    x = torch.randn(3, 8, N, WIDTH, dtype=torch.float64)
    x_ours, x_study = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ours, _ = ours(x_ours, sublayer)
    out_study = study(x_study, sublayer)
    assert (out_ours - out_study).abs().max() < 1e-10
    assert (out_ours - x).abs().max() > 0.1                # the streams really are mixed and written
    target = torch.randn_like(x)
    (out_ours * target).sum().backward()
    ours_grads = [mine.grad.clone().reshape(-1) for mine, _ in pairs]
    sublayer.zero_grad()
    (out_study * target).sum().backward()
    assert (x_ours.grad - x_study.grad).abs().max() < 1e-10
    for (mine, theirs), grad in zip(pairs, ours_grads):
        assert (grad - flat(theirs, grad=True)).abs().max() < 1e-10
