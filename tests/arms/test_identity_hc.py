"""hcstudy/arms/identity_hc.py: mHC's read and write with H_res fixed at the identity, so that nothing mixes."""
from hcstudy.metrics import instability_probe
from helpers import NO_AUTOCAST, tiny_config, train_steps


def test_identity_hc_logs_gain_one_and_mixes_nothing():
    model, idx = train_steps(tiny_config("identity-hc", depth=3), steps=10, lr=0.05)
    conn = model.blocks[0].attn_conn
    assert conn.phi.weight.abs().max() > 0 and conn.phi.out_features == 2 * conn.n       # read and write only
    assert not hasattr(conn, "a_res") and not hasattr(conn, "b_res")
    metrics_ = instability_probe(model, idx, NO_AUTOCAST, with_layers=True)
    for key in ("amax_fwd", "amax_bwd", "amax_fwd_abs", "amax_bwd_abs", "min_row_sum", "min_col_sum",
                "amax_l0_fwd", "amax_l0_bwd"):
        assert abs(metrics_[key] - 1) < 1e-6, key
    assert max(abs(g - 1) for g in metrics_["layer_gain_fwd"] + metrics_["layer_gain_bwd"]) < 1e-6
    assert "sinkhorn_col_err" not in metrics_                                           # no Sinkhorn to measure
