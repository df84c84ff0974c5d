"""The model, as the spec: a GPT-2 body whose residual path is one of the arms (hcstudy/arms/), acting on n streams
that persist from the embedding to the head.

    embedding (tokens + positions) -> expand once: the embedding copied into n streams (B, T, n, C)
    depth x Block: attention and MLP sublayers, each F(norm(u)), each behind its own connection of the arm
    collapse once: the n streams summed (or stream 0), the final LayerNorm, the tied LM head

Expanding and collapsing inside each block would turn HC into n plain residuals (docs/model.md, "Stream
persistence"). The arm's connection maps the state (B, T, n, C) to (B, T, n, C) and returns the probe's record of
its mixing; the baseline is the same body with one stream. Learned absolute positions, pre-LayerNorm, GELU MLP 4x,
no biases, GPT-2's init: the public 1.7B reproduction's body, so that its numbers compare.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hcstudy import arms
from hcstudy.kernels import choice, cross_entropy, fused
from hcstudy.metrics import stream_gram


def padded_vocab_size(tokenizer: str, exact: bool = False) -> int:
    # GPT-2's 50257 padded to a multiple of 64: the embedding matmuls run on aligned shapes
    return 256 if tokenizer == "byte" else 50257 if exact else 50304


def embedding_rows(cfg) -> int:
    return padded_vocab_size(cfg.tokenizer, cfg.vocab == "exact")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg, use_flash: bool):
        super().__init__()
        self.heads, self.use_flash = cfg.heads, use_flash
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).unbind(2)
        if self.use_flash:
            from flash_attn import flash_attn_func
            y = flash_attn_func(q, k, v, causal=True)
        else:
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True).transpose(1, 2)
        return self.proj(y.reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.width, 4 * cfg.width, bias=False)
        self.proj = nn.Linear(4 * cfg.width, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class StreamNorm(nn.LayerNorm):
    """LayerNorm in its input's dtype: FSDP gathers its weights in bf16, CPU's autocast does not cast them."""

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(u, self.normalized_shape, self.weight.to(u.dtype), self.bias.to(u.dtype), self.eps)


class PreNorm(nn.Sequential):
    """F(norm(u)): the block's own pre-norm sublayer, identical for all three residual paths."""

    def __init__(self, cfg, inner: nn.Module):
        super().__init__()
        self.norm, self.inner = StreamNorm(cfg.width, eps=cfg.norm_eps), inner        # applied in this order


STREAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def connection_class(cfg) -> type:
    """The arm's connection: its file's Connection (hcstudy/arms/)."""
    return arms.connection(cfg.residual)


def kernel_path(cfg, device: torch.device) -> tuple[str, str]:
    """The streams' path a run takes on `device` and why (choice.kernel_path; a self-check builds one connection)."""
    return choice.kernel_path(cfg, device, functools.partial(connection_class(cfg), cfg, 1))


class Block(nn.Module):
    """Maps the residual state (B, T, n, C) to (B, T, n, C): the streams persist across blocks."""

    def __init__(self, cfg, index: int, use_flash: bool, kernels: str = "reference"):
        super().__init__()
        self.attn = PreNorm(cfg, CausalSelfAttention(cfg, use_flash))
        self.mlp = PreNorm(cfg, MLP(cfg))
        connection = connection_class(cfg)
        self.attn_conn = connection(cfg, 2 * index, kernels)
        self.mlp_conn = connection(cfg, 2 * index + 1, kernels)
        self.activation_checkpointing = cfg.activation_checkpointing

    @property
    def checkpointed(self):
        """What checkpointing recomputes: what would cost n x C per token to keep. The formulas' autograd keeps the
        normalised state (and a bf16 state's fp32 copy), so their connection is recomputed with its sublayer; the
        kernels' connections (fused, triton) keep the state itself and per-token coefficients, so they run once
        and only the sublayer is recomputed, keeping u and y instead (docs/model.md, "Activation checkpointing").
        Read from the connection's path at each call, so that a model switched to another path (the GPU check's
        check_parts.take_path) checkpoints as that path needs."""
        streams_path = getattr(self.attn_conn, "kernels", "reference")
        return self.activation_checkpointing and ("connection" if streams_path == "reference" else "sublayer")

    def forward(self, x, return_mixing: bool = False, with_states: bool = False):
        # returned, not appended to a caller's list: torch.compile would guard on its length, a graph per block
        mixing, states = [], []
        for conn, sublayer in ((self.attn_conn, self.attn), (self.mlp_conn, self.mlp)):
            if with_states:             # the probe's: what each connection reads, as n x n per token, not n x C
                states.append(stream_gram(x))
            if self.checkpointed == "connection" and torch.is_grad_enabled():
                x, record = checkpoint(conn, x, sublayer, use_reentrant=False)
            else:
                recomputed = self.checkpointed and torch.is_grad_enabled()
                x, record = conn(x, functools.partial(checkpoint, sublayer, use_reentrant=False) if recomputed
                                 else sublayer)
            mixing.append(record)
        return (x, mixing, states) if return_mixing else x


class GPT(nn.Module):
    """kernels: the streams' path, where it has the arm (choice.supports; choice.kernel_path decides it for a run);
    loss: the cross-entropy's (cross_entropy.choose decides it)."""

    def __init__(self, cfg, use_flash: bool = False, kernels: str = "reference", loss: str = "plain"):
        super().__init__()
        self.fused_loss = loss == "fused"
        self.streams = cfg.expansion if arms.ARMS[cfg.residual].streams else 1
        self.stream_dtype = STREAM_DTYPES[cfg.stream_dtype]
        self.kernels = kernels if choice.supports(cfg, kernels) else "reference"
        self.collapse_first = cfg.collapse == "first"
        self.wte = nn.Embedding(embedding_rows(cfg), cfg.width)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg, i, use_flash, self.kernels) for i in range(cfg.depth))
        self.ln_f = StreamNorm(cfg.width, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.width, self.wte.num_embeddings, bias=False)
        self.lm_head.weight = self.wte.weight
        # GPT-2: residual output projections scaled by 1/sqrt(number of residual additions); the study's: not
        self._init_weights(0.02 / math.sqrt(2 * cfg.depth) if cfg.proj_init == "scaled" else 0.02, cfg.dynamic_init_std)

    @torch.no_grad()
    def _init_weights(self, proj_std: float, dynamic_init_std: float):
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = proj_std if name.endswith("inner.proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                # the dynamic mixing weights start at 0 or rescaled to dynamic_init_std: drawn all the same, so that
                # a seed gives the body the weights it always gave
                if "_conn." in name and dynamic_init_std:
                    module.weight.mul_(dynamic_init_std / std)
                elif "_conn." in name:
                    module.weight.zero_()

    def forward(self, idx, targets=None, mixing_out: list | None = None, states_out: list | None = None):
        # the state in --stream-dtype in every mode (precision_policy): under FSDP the embeddings are bf16
        h = (self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))).to(self.stream_dtype)
        # expand once, the embedding copied into every stream, in the layout the blocks return (torch.compile
        # specialises on strides): hcstudy/kernels/fused.py's is stream-major
        fused_streams = self.kernels == "fused" and self.streams > 1
        x = fused.expand(h, self.streams) if fused_streams else h.unsqueeze(-2).repeat(1, 1, self.streams, 1)
        for block in self.blocks:
            if mixing_out is None:
                x = block(x)
            else:
                x, mixing, states = block(x, return_mixing=True, with_states=states_out is not None)
                mixing_out.extend(mixing)
                states_out is None or states_out.extend(states)
        if x.requires_grad and fused_streams:
            x.register_hook(fused.stream_major)          # the collapse's gradient comes as one stride-0 view
        x = x.float()                                   # the collapse and the final norm in fp32, as for u
        x = self.ln_f(x[..., 0, :] if self.collapse_first else x.sum(dim=-2))    # collapse once
        if targets is not None and self.fused_loss:    # the loss without the logits; the probe's forward keeps them
            return None, cross_entropy.fused_cross_entropy(x, self.lm_head.weight, targets)
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def count_parameters(cfg) -> dict:
    """Parameter counts from a model built on the meta device: no memory for the weights."""
    with torch.device("meta"):
        model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.wte.weight.numel() + model.wpe.weight.numel()
    streams = sum(p.numel() for name, p in model.named_parameters() if "_conn." in name)
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "streams": streams}
