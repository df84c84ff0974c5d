"""Whether a checkpoint's state is finite: a NaN or an infinity in its weights, optimizer state or anything else it
holds is damage (a buggy writer, a damaged copy with its checksums fixed up), never a divergence, which the trainer
catches in the loss and gradient before an update and never saves. Checked at a cost the size of a read of the
state at memory bandwidth, with one host synchronisation (docs/benchmarks.md); run_folder.py calls it on every
checkpoint before it is sealed and before it is resumed from.
"""
from __future__ import annotations

import torch

from hcstudy.contract import TrainerError


class NonFiniteState(TrainerError):
    """A state about to be sealed, or loaded from DCP's shards, that holds a NaN or an infinity; every rank raises it
    together (non_finite_problem's all-reduce), so that none goes on into a collective the others skip."""


def floating_tensors(state, path: tuple = ()):
    """(key path, tensor) of every floating-point tensor in a nested state (dicts, lists, tuples), in a fixed order
    (every rank of an FSDP checkpoint walks the same keys); a DTensor as its local shard."""
    if isinstance(state, torch.Tensor):
        if state.is_floating_point():
            yield path, state.to_local() if hasattr(state, "to_local") else state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from floating_tensors(value, (*path, key))
    elif isinstance(state, list | tuple):
        for index, value in enumerate(state):
            yield from floating_tensors(value, (*path, index))


def non_finite_flags(tensors: list[torch.Tensor]) -> list[bool]:
    """Per tensor, whether it holds a NaN or an infinity. One fused reduction per device and dtype, the L2 norm
    (torch._foreach_norm, as clip_grad_norm_ takes it: NaN or infinite when an element is), read back in one host
    sync; a norm that is not finite although every element is (a sum of squares past the dtype's range: elements of
    1e19 and more in fp32) is told apart by an elementwise look at that tensor alone."""
    groups = {}
    for index, tensor in enumerate(tensors):
        if tensor.numel():                       # an empty shard holds nothing
            groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    order, suspects = [], []
    for (_, device), indices in groups.items():
        norms = torch._foreach_norm([tensors[i] for i in indices], 2)
        suspects.append((~torch.stack(norms).isfinite()).to(suspects[0].device if suspects else device))
        order += indices
    suspected = dict(zip(order, torch.cat(suspects).tolist())) if suspects else {}
    return [suspected.get(i, False) and not bool(tensors[i].isfinite().all()) for i in range(len(tensors))]


def non_finite_problem(state: dict, across_ranks: bool = False, where: str = "") -> str | None:
    """Which entries of `state` (a checkpoint's files, or DCP's model and optimizer) hold a NaN or an infinity, as
    "holds non-finite values (NaN or infinity) in optimizer.pt (3 tensors, the first state.0.exp_avg_sq)"; None when
    every floating tensor is finite. across_ranks: each rank holds its own shards of the same keys, and an all-reduce
    of the flags (on the shards' device, as NCCL needs) gives every rank the same answer."""
    found_tensors = list(floating_tensors(state))
    flags = non_finite_flags([tensor for _, tensor in found_tensors])
    if across_ranks:
        device = found_tensors[0][1].device if found_tensors else torch.device("cpu")
        summed = torch.tensor(flags, dtype=torch.float32, device=device)
        torch.distributed.all_reduce(summed)
        flags = [bool(flag) for flag in summed.tolist()]
    found = {}
    for (path, _), flag in zip(found_tensors, flags):
        if flag:
            found.setdefault(path[0], []).append(".".join(map(str, path[1:])))
    if not found:
        return None
    entries = [f"{where}{name} ({keys[0]})" if len(keys) == 1 else
               f"{where}{name} ({len(keys)} tensors, the first {keys[0]})" for name, keys in found.items()]
    return f"holds non-finite values (NaN or infinity) in {' and '.join(entries)}"
