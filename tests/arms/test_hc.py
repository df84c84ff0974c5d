"""hcstudy/arms/hc.py: the paper's Hyper-Connections, at init the pre-norm baseline, and the gains it reports."""
import pytest
import torch

from hcstudy.arms import hc
from hcstudy.metrics import gain_metrics
from hcstudy.model import GPT
from helpers import tiny_config


def test_hc_at_init_equals_the_pre_norm_baseline():
    torch.manual_seed(0)
    base = GPT(tiny_config("baseline", depth=3))
    torch.manual_seed(0)
    hc = GPT(tiny_config("hc", depth=3))
    body = {k: v for k, v in base.state_dict().items()}
    missing, unexpected = hc.load_state_dict(body, strict=False)
    assert not unexpected and all("_conn." in k for k in missing)
    # HC's collapsed state is n x the baseline's; LayerNorm(n h, eps) == LayerNorm(h, eps / n^2)
    base.ln_f.eps = hc.ln_f.eps / hc.streams ** 2
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(hc(idx), base(idx), rtol=0, atol=1e-5)


def test_hc_reports_the_transpose_of_A_r():
    """A hand-built A_r: rows (where source stream i goes) sum to 3 and 1, columns to 2 and 2."""
    cfg = tiny_config("hc", expansion=2, width=4, heads=1)
    conn = hc.Connection(cfg, sublayer_index=0)
    A_r = torch.tensor([[2.0, 1.0], [0.0, 1.0]])
    with torch.no_grad():
        conn.A_r_static.copy_(A_r)
    _, _, H_res, _ = conn.coefficients(torch.randn(1, 1, 2, 4))
    torch.testing.assert_close(H_res[0, 0], A_r.T)
    metrics = gain_metrics(H_res.reshape(1, 1, 2, 2))
    assert metrics["amax_l0_fwd"] == pytest.approx(2.0)   # row sums of A_r^T = column sums of A_r
    assert metrics["amax_l0_bwd"] == pytest.approx(3.0)
