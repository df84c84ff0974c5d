"""The optimizer, its schedule, and the forward and backward of one optimizer step.

AdamW with betas (0.9, 0.95), weight decay on the weights of linears and embeddings only, a linear warm-up then a
cosine to --min-lr-ratio; every optimizer step sees --batch-size sequences, split into micro-batches whose
gradients accumulate (all-reduced on the last one only), and its pre-clip gradient norm is what is logged. The
trainer's loop (train_c4.py) and the GPU check's timed steps take their steps here.
"""
import contextlib
import math

import torch
import torch.nn as nn

from hcstudy.metrics import batch_mean_mixing, study_gains


def decay_groups(model: nn.Module, weight_decay: float, decay_mixing: bool = True, everything: bool = False
                 ) -> list[dict]:
    """Weight decay on the weights of linears and embeddings only; the connections' (dynamic mixing) if decay_mixing;
    everything: on every parameter (the study's AdamW(model.parameters()))."""
    decay = {id(p): p for p in model.parameters()} if everything else {
        id(m.weight): m.weight for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) and (decay_mixing or "_conn." not in name)}
    rest = [p for p in model.parameters() if id(p) not in decay]
    return [{"params": list(decay.values()), "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    # fused: the for-loop AdamW PyTorch picks on the CPU runs ~10 small ops per parameter tensor (benchmarks.md)
    groups = decay_groups(model, cfg.weight_decay, not cfg.no_mixing_decay, cfg.weight_decay_on == "all")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True)


def lr_at(cfg, step: int) -> float:
    if step < cfg.warmup:       # the study's warm-up trains step 0 at lr 0: only Adam's moments take its gradient
        return cfg.lr * (step + 1 if cfg.warmup_from == "one-step" else step) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def accumulate(model, loader, accum: int, dist, dtype: torch.dtype, stop) -> torch.Tensor:
    """Forward and backward of every micro-batch; the gradient is all-reduced on the last one only. Returns the
    mean loss, the stop votes (`stop.requested` on any rank) and the study's reading of the training batch (the
    H_res of these forwards), as one tensor on the device: no host synchronisation here."""
    device, loss_sum, mixing_sum = dist.device, torch.zeros((), device=dist.device), 0.0
    for micro_step in range(accum):
        records = []
        x, y = (t.to(device, non_blocking=True) for t in loader.next_batch())
        last = micro_step == accum - 1
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(last)
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast(device, dtype):
                _, loss = model(x, y, mixing_out=records)
            (loss / accum).backward()
        loss_sum += loss.detach()
        mixing_sum = mixing_sum + batch_mean_mixing(records, device)
    stop_flag = torch.tensor(float(stop.requested), device=device)
    share = 1 / (accum * dist.world)        # equal micro-batches: the mean of means is the batch's
    summed = dist.sum(torch.cat([torch.stack([loss_sum * share, stop_flag]), mixing_sum.flatten() * share]))
    batch_mean = summed[2:].view_as(mixing_sum).double().unsqueeze(1)
    return torch.cat([summed[:2], study_gains(batch_mean)[-1:].float()])     # full depth only


def gradients(model, optimizer, loader, accum: int, dist, dtype: torch.dtype, grad_clip: float, lr: float, stop
              ) -> tuple[float, float, float, float]:
    """One step's gradients at learning rate `lr`, clipped: (mean loss, stop votes, the study's reading, the pre-clip
    gradient norm). The caller applies them (optimizer.step) once it has seen that they are finite."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_and_stop = accumulate(model, loader, accum, dist, dtype, stop)
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm    # FSDP's DTensor
    # the one host synchronisation of a step: divergence must be caught before the update is applied
    loss, stop_votes, study, norm = torch.cat([loss_and_stop, grad_norm.reshape(1).to(loss_and_stop)]).tolist()
    return loss, stop_votes, study, norm
