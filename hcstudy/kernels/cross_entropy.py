"""The loss's two paths (--cross-entropy): plain, the head's (tokens x vocabulary) logits and F.cross_entropy on them
in fp32 (train_c4.GPT.forward, the reference); fused, PyTorch's own chunked linear cross-entropy
(F.linear_cross_entropy with LinearCrossEntropyOptions), which computes the logits a chunk of tokens at a time and
never holds them whole: at depth 32 and micro-batch 8 the plain path's log-probabilities and their two backward
buffers take 4.6 GiB. And which one a run takes: the flag, or auto's pick (what --check timed faster on this GPU).

What torch's chunked op does, and why it is called the way it is here (its docstring, and torch/nn/modules/
linear_cross_entropy.py):
- it is a custom op: autocast does not cast its inputs, and given fp32 it runs its matmuls in fp32. Under autocast the
  head's input and weight are cast to the autocast dtype here, as autocast casts them for the plain path's Linear.
- with bf16 inputs it returns the loss in bf16, accumulated over the chunks in bf16 (2 to 3 significant digits: 0.02 at
  a loss of 3, more than the arms differ by). So it is asked for each token's loss (reduction 'none', computed in fp32
  and rounded once, 2^-9 of a token's loss) and their mean is taken in fp32: the rounding errors average out over the
  tokens. The cost: reduction 'none' computes the gradients in the backward, one more chunked matmul of the head
  (2 x vocabulary x width FLOPs a token) than the plain path's three.
- its backward is not differentiable again (no double backward, no forward-mode AD, no torch.func.grad); under
  torch.compile it stays one opaque op in the graph. Neither is used by the trainer.
- the tied weight (lm_head = wte) gets the head's gradient through the cast, added to the embedding's as with plain.
Nothing of it needs CUDA: the CPU runs the same op (the tests hold it equal to plain there, in fp32)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hcstudy.contract import timed_losses

PATHS = ("plain", "fused")


def chunk_rows(tokens: int, width: int, vocab: int) -> int:
    """Tokens a chunk holds: torch's own 'aspect_ratio:2' (its pick for bf16 on CUDA), given explicitly so that the
    planner prices the same chunk the trainer runs: a chunk's logits have about half the elements of the head's input,
    tokens / ceil(vocab / width) rounded up to a power of two, halved. 256 tokens at 8 x 1024 tokens, width 2048 and
    GPT-2's vocabulary: 52 MB of fp32 logits."""
    per_chunk = -(-tokens // -(-vocab // width))
    return max(1, min(tokens, (1 << (per_chunk - 1).bit_length()) // 2))


def fused_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """mean over tokens of cross_entropy(hidden @ weight.T, targets), the (tokens x vocabulary) logits never whole.
    hidden: (..., width), weight: (vocabulary, width), targets: (...). Under autocast, both in its dtype (see above)."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]).to(dtype), targets.reshape(-1)
    rows = chunk_rows(len(hidden), weight.shape[1], weight.shape[0])
    per_token = F.linear_cross_entropy(hidden, weight.to(dtype), targets, reduction="none",
                                       options=torch.nn.LinearCrossEntropyOptions(batch_chunk_size=rows))
    return per_token.float().mean()


def choose(cfg, gpu: str, check: dict | None) -> tuple[str, str]:
    """The loss a run of `cfg` takes on `gpu` (a CUDA device's name, or 'cpu') and why, for train.log, config.json and
    the planner: --cross-entropy plain or fused; auto, the one --check timed faster on this GPU (its result.json,
    `check`), else plain (the reference; fused has not been timed against it on this card)."""
    if cfg.cross_entropy != "auto":
        return cfg.cross_entropy, f"--cross-entropy {cfg.cross_entropy}"
    if gpu == "cpu":
        return "plain", "auto on the CPU: plain, the reference (--check times the two on a GPU)"
    timed = timed_losses(check or {}, gpu)
    if len(timed) < 2:
        return "plain", f"auto: plain, --check has not timed both losses on this {gpu}"
    faster = min(timed, key=timed.get)
    return faster, (f"auto: --check timed it faster on this {gpu} ({timed[faster]:.3f} s/step, "
                    f"{timed[max(timed, key=timed.get)]:.3f} for the other)")
