"""Under torchrun with --parallel fsdp: each arm built on every kernel path (reference, fused, triton; a path without
the arm runs the formulas), one step each on the rank's half of a batch; prints, per arm and path, the largest
differences of the loss and of every full gradient from the reference path's."""
import json
import sys

import torch

from hcstudy.config import parse_config
from hcstudy.distributed import end_distributed, setup_distributed, wrap_model
from hcstudy.failures import exit_process
from hcstudy.model import GPT
from helpers import randomize_mixing      # beside this file: torchrun puts its folder on sys.path

idx = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
dist, worst = setup_distributed(), {}
for residual in sys.argv[1:]:
    cfg = parse_config(["--preset", "tiny", "--residual", residual, "--parallel", "fsdp"])
    results = {}
    for kernels in ("reference", "fused", "triton"):
        torch.manual_seed(0)
        model = GPT(cfg, kernels=kernels)
        randomize_mixing(model)
        wrapped = wrap_model(model, cfg, dist, torch.float32)
        part = idx.chunk(dist.world)[dist.rank]
        _, loss = wrapped(part, part)
        loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        results[kernels] = (loss.detach(), grads, model.kernels)
    loss_ref, grads_ref, _ = results["reference"]
    for kernels in ("fused", "triton"):
        loss, grads, taken = results[kernels]
        grad_errors = [(grads_ref[n] - grads[n]).abs().max().item() / (1 + grads_ref[n].abs().max().item())
                       for n in grads_ref]
        worst[f"{residual}/{kernels}"] = {"loss": (loss_ref - loss).abs().item(), "grad": max(grad_errors),
                                          "parameters": len(grads_ref), "taken": taken}
if dist.is_main:
    print(json.dumps(worst))
end_distributed()
exit_process(0)
