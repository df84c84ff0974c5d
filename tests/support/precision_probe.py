"""Under torchrun: the dtypes one mixing connection and one attention sublayer see inside the forward."""
import json
import sys

import torch

from hcstudy.config import parse_config
from hcstudy.distributed import end_distributed, setup_distributed, unwrap, wrap_model
from hcstudy.failures import exit_process
from hcstudy.model import GPT

residual, parallel = sys.argv[1:3]
cfg = parse_config(["--preset", "tiny", "--residual", residual, "--parallel", parallel, "--dtype", "bf16"])
dist = setup_distributed()
torch.manual_seed(0)
wrapped = wrap_model(GPT(cfg), cfg, dist, torch.bfloat16)
block, seen = unwrap(wrapped).blocks[0], {}


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
end_distributed()
exit_process(0)
