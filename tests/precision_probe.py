"""Under torchrun: the dtypes one mixing connection and one attention sublayer see inside the forward."""
import json
import sys

import torch

import train_c4 as T

residual, parallel = sys.argv[1:3]
cfg = T.parse_config(["--preset", "tiny", "--residual", residual, "--parallel", parallel, "--dtype", "bf16"])
dist = T.setup_distributed()
torch.manual_seed(0)
wrapped = T.wrap_model(T.GPT(cfg), cfg, dist, torch.bfloat16)
block, seen = T.unwrap(wrapped).blocks[0], {}


def watch(name):
    def hook(module, args):
        seen[name] = {"input": str(args[0].dtype), "parameters": sorted({str(p.dtype) for p in module.parameters()})}
    return hook


block.attn_conn.register_forward_pre_hook(watch("connection"))
block.attn.inner.register_forward_pre_hook(watch("attention"))
with torch.autocast("cpu", dtype=torch.bfloat16):
    wrapped(torch.zeros(2, 8, dtype=torch.long)).float().sum().backward()
if dist.is_main:
    print(json.dumps(seen))
T.end_distributed()
T.exit_process(0)
