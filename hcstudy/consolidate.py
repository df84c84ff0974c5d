"""A checkpoint's weights in one file, loadable without a process group or this project's code.

    python train_c4.py --consolidate RUN/checkpoints/step-N OUT.pt     (or a run folder: its newest checkpoint)

writes OUT.pt (a GPT state_dict for torch.load(OUT.pt, weights_only=True)), OUT.safetensors (no pickle at all; the
head, tied to the embedding, left out) and OUT.json (the model's settings). FSDP's sharded checkpoints included.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file as save_safetensors

from hcstudy import config_flags as flags
from hcstudy.config import Config, validate
from hcstudy.contract import MODEL_KEYS, ConfigError, TrainerError
from hcstudy.distributed import Dist
from hcstudy.model import GPT
from hcstudy.run_folder import (MARKER, SHARDED, NonFiniteState, check_writable_folder, checkpoint_dirs, dcp_load,
                                first_cause, safe_dcp, save_file, verified_checkpoints, write_atomically)


def arguments(argv: list[str]) -> tuple[Path, Path]:
    parser = flags.OneLineErrorParser(prog="train_c4.py --consolidate", description="Write one file with the "
                                  "weights of a checkpoint (FSDP's sharded ones included), loadable without a "
                                  "process group: torch.load(OUT, weights_only=True) -> GPT.load_state_dict.")
    parser.add_argument("--consolidate", nargs=2, metavar=("CHECKPOINT", "OUT"), required=True,
                        help="a checkpoint folder (RUN/checkpoints/step-N) or a run folder (its newest "
                        "complete checkpoint), and the .pt file to write")
    source, out = map(Path, parser.parse_args(argv).consolidate)
    if not source.is_dir():
        raise ConfigError(f"--consolidate: {source} is not a checkpoint or run folder")
    if out.is_dir():
        raise ConfigError(f"--consolidate: {out} is a folder; give the .pt file to write")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--consolidate: cannot create {out.parent} ({error.strerror or error})") from None
    check_writable_folder(out.parent, f"--consolidate: {out}'s folder")
    return source, out


def consolidate(source: Path, out: Path) -> str:
    """Write the model's weights from a checkpoint (FSDP's sharded ones included), loadable without a process
    group: OUT, a GPT state_dict for torch.load(OUT, weights_only=True), and beside it OUT's stem .safetensors
    (no pickle at all; the head, tied to the embedding, left out) with OUT's stem .json, the model's config.
    `source` is a checkpoint folder or a run folder (its newest complete checkpoint). Returns what was written."""
    folder, marker = complete_checkpoint(source.resolve(), Dist(0, 1, torch.device("cpu")))
    cfg = saved_config(folder.parent.parent)
    state = saved_model_state(folder, sharded=marker.get("format") == "sharded")
    with torch.device("meta"):
        reference = GPT(cfg).state_dict()
    state.setdefault("lm_head.weight", state.get("wte.weight"))          # tied to the embedding
    if set(state) != set(reference) or any(state[k].numel() != v.numel() for k, v in reference.items()):
        raise ConfigError(f"checkpoint {folder} does not match the model of {folder.parent.parent / 'config.json'}")
    # the model's own shapes again (FSDP held its scalars as 1-element vectors); the head is the embedding
    state = {key: state[key].reshape(like.shape) for key, like in reference.items()}
    state["lm_head.weight"] = state["wte.weight"]
    write_weights(out, state, {key: getattr(cfg, key) for key in MODEL_KEYS}, folder)
    count = sum(t.numel() for k, t in state.items() if k != "lm_head.weight")
    return (f"{out}, {out.with_suffix('.safetensors').name} and {out.with_suffix('.json').name}: {count:,} "
            f"parameters of {cfg.residual} depth {cfg.depth} from {folder}")


def complete_checkpoint(source: Path, single_process) -> tuple[Path, dict]:
    """`source` itself when it is a complete checkpoint, else the newest complete one of the run folder."""
    folders, skipped = [source] if (source / MARKER).exists() else checkpoint_dirs(source)[::-1], []
    for folder, _, marker in verified_checkpoints(folders, single_process, skipped.append):
        print(*(f"warning: {line}" for line in skipped), sep="\n", file=sys.stderr, end="\n" if skipped else "")
        return folder, marker
    newest = f" (newest: {skipped[0].removeprefix('checkpoint ').split(';')[0]})" if skipped else ""
    raise ConfigError(f"{source} holds no complete, safely loadable checkpoint{newest}; pass a run folder or one of "
                      "its checkpoints/step-N folders")


def saved_config(run_dir: Path):
    """The run's Config from its config.json, checked as a command line would be (a bad value is one line)."""
    path = run_dir / "config.json"
    try:
        saved = json.loads(path.read_text())["config"]
        fields = {f.name for f in dataclasses.fields(Config)}
        # the micro-batch saved is the one the run used, not a setting
        cfg = Config(**{k: v for k, v in saved.items() if k in fields - {"micro_batch_size"}})
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError):
        raise ConfigError(f"{path} is missing or unreadable: the model cannot be rebuilt") from None
    try:
        flags.check_types(cfg)
        validate(cfg)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}; the model cannot be rebuilt") from None
    return cfg


def saved_model_state(folder: Path, sharded: bool) -> dict:
    """The model entries of a checkpoint (not the optimizer's), in the shapes they were saved with."""
    if not sharded:
        return torch.load(folder / "model.pt", map_location="cpu", weights_only=True)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    entries = safe_dcp()[0](folder / SHARDED).read_metadata().state_dict_metadata
    state = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in entries.items() if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    wrapped = {"model": state}
    try:
        dcp_load(wrapped, folder, no_dist=True)
    except NonFiniteState as damaged:           # weights no model can use: said, never exported
        raise ConfigError(f"checkpoint {folder} {damaged}; export an earlier checkpoint (checkpoints/step-N)") from None
    return wrapped["model"]


def write_weights(out: Path, state: dict, model_config: dict, folder: Path) -> None:
    untied = {key: tensor.contiguous() for key, tensor in state.items() if key != "lm_head.weight"}

    def write_safetensors(tmp: Path) -> None:       # safetensors makes its file 0600: OUT's mode (the umask's)
        save_safetensors(untied, tmp)
        shutil.copymode(out, tmp)

    try:
        write_atomically(out, functools.partial(save_file, state))
        write_atomically(out.with_suffix(".safetensors"), write_safetensors)
        write_atomically(out.with_suffix(".json"), lambda tmp: tmp.write_text(json.dumps(model_config, indent=1)))
    except OSError as error:
        raise TrainerError(f"could not write {out} ({first_cause(error)}); {folder} is untouched") from error

