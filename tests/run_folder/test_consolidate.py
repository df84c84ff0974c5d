"""hcstudy/consolidate.py (train_c4.py --consolidate): a checkpoint's weights in one file, safetensors and the
model's config beside it; a bad config or no usable checkpoint refused in one line."""
import json

import pytest
import torch

from hcstudy import consolidate
from hcstudy import run_folder
import train_c4 as T
from hcstudy.config import Config
from hcstudy.model import GPT

from finished_runs import RUN, copy_of, finished, one_line  # noqa: F401 (finished: a fixture)


@pytest.mark.parametrize("config", [{"width": "16"}, {"width": -16}, {"residual": "nope"}, {"depth": 10 ** 8},
                                    None, []])
def test_consolidate_refuses_a_bad_config_in_one_line(finished, tmp_path, capsys, config):
    out, run_dir = copy_of(finished, tmp_path)
    record = json.loads((run_dir / "config.json").read_text())
    if isinstance(config, dict):
        record["config"] |= config
    else:
        record = config if config is not None else {"config": None}
    (run_dir / "config.json").write_text(json.dumps(record))
    assert T.main(["--consolidate", str(run_dir), str(tmp_path / "w.pt")]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "config.json" in err and not (tmp_path / "w.pt").exists()


def test_consolidate_of_a_run_without_a_usable_checkpoint_is_one_line_naming_the_newest_problem(finished, tmp_path,
                                                                                                 capsys):
    out, run_dir = copy_of(finished, tmp_path)
    for folder in (run_dir / "checkpoints").iterdir():
        (folder / run_folder.MARKER).write_text("[]")
    assert T.main(["--consolidate", str(run_dir), str(tmp_path / "w.pt")]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "(newest: step-20 has no valid completion marker)" in err


@pytest.mark.slow
def test_consolidate_creates_a_missing_output_folder(finished, tmp_path):
    """As docs/distributed.md's `w/mhc.pt` on a fresh clone; a folder that cannot be made is one line and exit 2
    (tests/run_folder/test_faults.py)."""
    assert T.main(["--consolidate", str(finished / RUN), str(tmp_path / "no" / "such" / "w.pt")]) == 0
    assert sorted(p.name for p in (tmp_path / "no" / "such").iterdir()) == ["w.json", "w.pt", "w.safetensors"]


def test_consolidate_writes_safetensors_beside_a_config(finished, tmp_path):
    from safetensors.torch import load_file
    consolidate.consolidate(finished / RUN, tmp_path / "w.pt")
    cfg = Config(**json.loads((tmp_path / "w.json").read_text()))
    model = GPT(cfg)
    missing = model.load_state_dict(load_file(tmp_path / "w.safetensors"), strict=False).missing_keys
    assert missing == ["lm_head.weight"] and model.lm_head.weight is model.wte.weight     # tied to the embedding
    reference = torch.load(tmp_path / "w.pt", weights_only=True)
    assert all(torch.equal(reference[key], value) for key, value in model.state_dict().items())
