"""Under torchrun (--parallel ddp or fsdp, argv[1]): the model wrapped as the trainer wraps it, with the plain and the
fused cross-entropy, eager and compiled whole (--compile-scope model, on the aot_eager backend: the same graph without
inductor's minutes); one step each on the rank's half of a batch, fp32 (argv[2] 'fp32') or under bf16 autocast with
FSDP's bf16 weights ('bf16'). Prints, per variant, the largest differences of the loss and of every full gradient from
the eager plain loss's, and the graph breaks."""
import functools
import json
import sys

import torch

from hcstudy.config import parse_config
from hcstudy.distributed import end_distributed, setup_distributed, wrap_model
from hcstudy.failures import exit_process
from hcstudy.model import GPT
from helpers import randomize_mixing      # beside this file: torchrun puts its folder on sys.path

parallel, precision = sys.argv[1:3]
torch.nn.Module.compile = functools.partialmethod(torch.nn.Module.compile, backend="aot_eager")
idx = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
dist, results, worst = setup_distributed(), {}, {}
dtype = torch.bfloat16 if precision == "bf16" else torch.float32
for loss in ("plain", "fused"):
    for compiled in (False, True):
        cfg = parse_config(["--preset", "tiny", "--residual", "mhc", "--parallel", parallel, "--dtype", precision,
                              "--cross-entropy", loss, *(["--compile", "--compile-scope", "model"] * compiled)])
        torch.manual_seed(0)
        torch._dynamo.reset()
        from torch._dynamo.utils import counters
        counters.clear()
        model = GPT(cfg, loss=loss)
        randomize_mixing(model)
        wrapped = wrap_model(model, cfg, dist, dtype)
        part = idx.chunk(dist.world)[dist.rank]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            _, value = wrapped(part, part)
        value.backward()
        grads = {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                 for name, p in model.named_parameters()}
        total = value.detach().clone()
        torch.distributed.all_reduce(total)
        results[loss, compiled] = (total / dist.world, grads, sum(counters["graph_break"].values()))
loss_ref, grads_ref, _ = results["plain", False]
for (loss, compiled), (value, grads, breaks) in results.items():
    errors = [(grads_ref[n] - grads[n]).abs().max().item() / (1e-6 + grads_ref[n].abs().max().item()) for n in grads]
    worst[f"{loss}/{'model' if compiled else 'eager'}"] = {
        "loss": (loss_ref - value).abs().item(), "grad": max(errors), "parameters": len(grads), "graph_breaks": breaks}
if dist.is_main:
    print(json.dumps(worst))
end_distributed()
exit_process(0)
