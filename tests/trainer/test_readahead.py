"""hcstudy/readahead.py: the data read ahead in loader processes or a thread: disjoint documents, exact resume, a
failed or stalled loader as one clean error."""
import time

import pytest
import torch

from hcstudy import readahead
from hcstudy.config import parse_config
from hcstudy.contract import ConfigError, DataUnavailable
from hcstudy.data import ByteTokenizer, RankBatches
from hcstudy.planner.memory import batch_plan

from data_shards import write_shards


def first_documents(windows, count):
    """The ids of the first `count` documents in a stream's consecutive byte windows."""
    documents = bytes(torch.cat(windows).tolist()).decode().split("\0")
    assert len(documents) > count, "read too little"
    return [document.split()[0] for document in documents[:count]]


def test_two_ranks_times_two_loader_processes_read_disjoint_documents_whose_union_is_everything(tmp_path):
    files = write_shards(tmp_path)
    cfg = parse_config(["--preset", "tiny", "--seq-len", "64", "--batch-size", "8", "--data-streams", "4",
                          "--shuffle-buffer", "0"])
    documents = []
    for rank in range(2):
        batches = RankBatches(files, ByteTokenizer(), cfg, rank=rank, world=2, micro=4)   # a step per batch
        loader, by_stream = readahead.Loader(batches, workers=2, timeout=60), {v: [] for v in batches.streams}
        for _ in range(15):
            x, y = loader.next_batch()
            for v, window in zip(batches.owners, torch.cat([x, y[:, -1:]], dim=1)):
                by_stream[v].append(window)
        loader.close()
        # one shard per stream, no shuffle buffer: a stream's first epoch is its first 30 documents
        documents += [d for windows in by_stream.values() for d in first_documents(windows, 30)]
    assert len(documents) == len(set(documents)) == 4 * 30


@pytest.mark.parametrize("kind", ["thread", "processes"])
def test_resume_through_the_background_loader_is_exact_after_three_resumes(tmp_path, kind):
    files = write_shards(tmp_path)
    cfg = parse_config(["--preset", "tiny", "--seq-len", "16", "--data-streams", "2", "--shuffle-buffer", "8"])

    def fresh():
        return RankBatches(files, ByteTokenizer(), cfg, rank=0, world=1, micro=2)

    reference = fresh()
    expected = [reference.next_batch() for _ in range(80)]
    seen, state = [], None
    for segment in range(4):
        loader = readahead.Loader(fresh(), workers=0 if kind == "thread" else 2, timeout=30, depth=4)
        if state is not None:
            loader.load_state_dict([state])                  # before the first batch, as a resume does
        seen += [loader.next_batch() for _ in range(20)]     # whole steps: checkpoints are taken between steps
        time.sleep(0.05)                                     # let the loader read ahead of what was consumed
        state = loader.state_dict()
        loader.close()
    assert all(torch.equal(a, b) for pair, reference_pair in zip(seen, expected)
               for a, b in zip(pair, reference_pair))


def test_a_batch_smaller_than_the_stream_count_resumes_exactly_through_loader_processes(tmp_path):
    """8 streams, 4 sequences per step: streams 4-7 are never read, yet their state must be saved."""
    files = write_shards(tmp_path, shards=8)
    cfg = parse_config(["--preset", "tiny", "--data-streams", "8", "--batch-size", "4"])
    reference = RankBatches(files, ByteTokenizer(), cfg, 0, 1, 2)
    expected = [reference.next_batch()[0] for _ in range(12)]
    loader = readahead.Loader(RankBatches(files, ByteTokenizer(), cfg, 0, 1, 2), workers=2, timeout=30)
    seen = [loader.next_batch()[0] for _ in range(6)]
    state = loader.state_dict()
    loader.close()
    resumed = RankBatches(files, ByteTokenizer(), cfg, 0, 1, 2)
    resumed.load_state_dict([state])
    seen += [resumed.next_batch()[0] for _ in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(seen, expected))
    with pytest.raises(ConfigError, match="exceeds the 4 data stream"):
        batch_plan(parse_config(["--preset", "tiny", "--data-streams", "8", "--batch-size", "4",
                                     "--data-workers", "5"]), world=1)


def test_a_loader_process_error_arrives_as_one_clean_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("not json\n{\"no_text\": 1}\n")
    cfg = parse_config(["--preset", "tiny", "--data-streams", "2"])
    loader = readahead.Loader(RankBatches([str(bad)], ByteTokenizer(), cfg, 0, 1, 2), workers=2, timeout=30)
    with pytest.raises(ConfigError, match="holds no usable document") as error:
        loader.next_batch()
    assert "Traceback" not in str(error.value)
    loader.close()


@pytest.mark.parametrize("workers", [0, 1])               # the thread, a loader process
def test_a_stalled_loader_raises_instead_of_hanging(tmp_path, monkeypatch, workers):
    files = write_shards(tmp_path)
    monkeypatch.setattr(RankBatches, "read_step", lambda self, streams: time.sleep(3))   # inherited by the fork
    cfg = parse_config(["--preset", "tiny"])
    loader = readahead.Loader(RankBatches(files, ByteTokenizer(), cfg, 0, 1, 2), workers=workers, timeout=1)
    with pytest.raises(DataUnavailable, match="--data-timeout"):
        loader.next_batch()
    loader.close()
