"""Under torchrun with --parallel fsdp: HC and mHC built twice, reference and fused, one step each on the rank's
half of a batch; prints the largest differences of the loss and of every full gradient."""
import json
import sys

import torch

import train_c4 as T
from helpers import randomize_mixing

idx = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
dist, worst = T.setup_distributed(), {}
for residual in sys.argv[1:]:
    cfg = T.parse_config(["--preset", "tiny", "--residual", residual, "--parallel", "fsdp"])
    results = []
    for fused_kernels in (False, True):
        torch.manual_seed(0)
        model = T.GPT(cfg, fused_kernels=fused_kernels)
        randomize_mixing(model)
        wrapped = T.wrap_model(model, cfg, dist, torch.float32)
        part = idx.chunk(dist.world)[dist.rank]
        _, loss = wrapped(part, part)
        loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        results.append((loss.detach(), grads))
    (loss_ref, grads_ref), (loss_fused, grads_fused) = results
    grad_errors = [(grads_ref[n] - grads_fused[n]).abs().max().item() / (1 + grads_ref[n].abs().max().item())
                   for n in grads_ref]
    worst[residual] = {"loss": (loss_ref - loss_fused).abs().item(), "grad": max(grad_errors),
                       "parameters": len(grads_ref)}
if dist.is_main:
    print(json.dumps(worst))
T.end_distributed()
T.exit_process(0)
