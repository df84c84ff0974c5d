"""What the Sinkhorn-Knopp iteration count costs and buys: the truncation error of mHC's H_res and the
composite backward gain it alone produces, against the time of the projection, at realistic depth.

    python benchmarks/bench_sinkhorn.py [--sublayers 64] [--tokens 2048] [--iters 5,10,20,30,50,100]

The logits are those of a trained mHC connection in form: b_res = c*I (the init, c = --mhc-res-diag) plus a
per-token part a_res * z_res, drawn here as Gaussian noise of standard deviation s per entry. s = 0 is the
init (H_res symmetric: exactly doubly stochastic after one iteration). Two layouts: "independent" draws every
sublayer's logits apart, so their column errors point in random directions and partly cancel in the
products; "aligned" gives every sublayer the same logits, so the errors line up across depth (the worst case,
and the pattern of a network whose layers learn similar mixings). For each s and iteration count: the largest
|column sum - 1| over sublayers and tokens (rows are exact by construction), the composite backward gain
amax_bwd of the matrices as projected (what the probe reports "as used"), the same for the logits projected to
convergence, and the time of one forward + backward of the projection per sublayer (torch.utils.benchmark).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.utils.benchmark as benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hcstudy.arms.mhc import sinkhorn
from hcstudy.metrics import gain_metrics, sinkhorn_converged, stochastic_errors


def logits(sublayers: int, tokens: int, n: int, diag: float, spread: float, aligned: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(1 if aligned else sublayers, tokens, n, n, generator=generator)
    return (diag * torch.eye(n) + spread * noise).expand(sublayers, tokens, n, n)


def per_sublayer_ms(one_sublayer: torch.Tensor, iters: int) -> float:
    """Median time of the projection's forward + backward on one sublayer's tokens, as the model runs it."""
    x = one_sublayer.clone().requires_grad_()
    timer = benchmark.Timer("sinkhorn(x, iters).sum().backward()", globals={"sinkhorn": sinkhorn, "x": x, "iters": iters})
    return timer.blocked_autorange(min_run_time=0.5).median * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sublayers", type=int, default=64, help="2 x depth (64: the depth-32 model)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--expansion", type=int, default=4)
    parser.add_argument("--diag", type=float, default=4.0, help="b_res diagonal (--mhc-res-diag)")
    parser.add_argument("--spreads", default="0,0.5,1,2,4", help="std of the per-token logit part")
    parser.add_argument("--iters", default="5,10,20,30,50,100")
    args = parser.parse_args()
    torch.set_num_threads(1)
    iteration_counts = [int(i) for i in args.iters.split(",")]
    print(f"{args.sublayers} sublayers x {args.tokens} tokens, n = {args.expansion}, b_res = {args.diag:g} I + "
          "s * N(0, 1); fp32, 1 thread")
    print("| layout | s | iterations | max column error | amax_bwd as used | amax_bwd converged (iterations) | "
          "ms per sublayer (fwd+bwd) |")
    print("|---|---|---|---|---|---|---|")
    for aligned in (False, True):
        for spread in (float(s) for s in args.spreads.split(",")):
            L = logits(args.sublayers, args.tokens, args.expansion, args.diag, spread, aligned)
            converged, needed = sinkhorn_converged(L)
            exact = gain_metrics(converged)["amax_bwd"]
            for iters in iteration_counts:
                with torch.no_grad():
                    H = sinkhorn(L, iters)
                error = stochastic_errors(H).max().item()
                used = gain_metrics(H)["amax_bwd"]
                ms = per_sublayer_ms(L[0], iters)
                print(f"| {'aligned' if aligned else 'independent'} | {spread:g} | {iters} | {error:.2e} | "
                      f"{used:.4f} | {exact:.6f} ({needed}) | {ms:.2f} |")


if __name__ == "__main__":
    main()
