"""The data: the tokenizers, C4 (the hub or local shards) and the bundled sample, streamed and exactly resumable.

A run reads --data-streams virtual streams of documents, each in an order fixed by --data-seed; sequence p of every
global batch comes from stream p mod S, so any number of processes that divides the batch reads the same data,
and a checkpoint holds each stream's position (docs/data.md). Held-out documents (files named "validation", or
--val-data, or a hashed slice of the training documents) are never trained on; the first of them make the fixed
validation set and the probe batch. The loader reads ahead in processes or a thread (hcstudy/readahead.py).
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import random
import sys
import time

import tiktoken
import torch
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str

from hcstudy import ROOT, contract
from hcstudy.contract import ConfigError, DataUnavailable
from hcstudy.readahead import Loader, dataset_cache, hf_cache_refused, in_hf_cache

DATA_DIR = ROOT / "data"
# tiktoken's published sha256 of OpenAI's GPT-2 files (tiktoken_ext/openai_public.py)
GPT2_HASHES = {"vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
               "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"}
C4_HUB = "hf://datasets/allenai/c4/en"
C4_TRAIN_SHARDS, C4_VALIDATION_SHARDS = 1024, 8
HUB_RETRIES, HUB_MAX_BACKOFF_S = 6, 60         # about two minutes of retries before exit 6
# without held-out files, 1 training document in this many is held out: ~3,500 of a C4 shard, more than eval needs
HELD_OUT_EVERY = 100


class ByteTokenizer:
    """UTF-8 bytes; byte 0 (never in text) separates documents."""
    vocab_size, eot = 256, 0

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]


class GPT2Tokenizer:
    """GPT-2 BPE through tiktoken, built from the files in data/gpt2 (never downloaded)."""
    vocab_size = 50257

    def __init__(self):
        files = {name: str(DATA_DIR / "gpt2" / name) for name in GPT2_HASHES}
        ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=files["vocab.bpe"],
                                                encoder_json_file=files["encoder.json"],
                                                vocab_bpe_hash=GPT2_HASHES["vocab.bpe"],
                                                encoder_json_hash=GPT2_HASHES["encoder.json"])
        self.encoding = tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                          special_tokens={"<|endoftext|>": 50256})
        self.eot = self.encoding.eot_token

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts, num_threads=4)


def make_tokenizer(name: str):
    return ByteTokenizer() if name == "byte" else GPT2Tokenizer()


@dataclasses.dataclass(frozen=True)
class DataFiles:
    """What a run reads. held_out_slice: no held-out files exist, so validation reads the training files'
    held-out slice (in_held_out_slice), which training skips."""
    train: list[str]
    val: list[str]
    held_out_slice: bool


def resolve_data_files(data: str, val_data: str = "") -> DataFiles:
    """Held out: the files of --val-data, else those of --data named "validation" (C4's convention, never trained
    on), else a slice of the training documents."""
    if data == "c4":
        train = [f"{C4_HUB}/c4-train.{i:05d}-of-{C4_TRAIN_SHARDS:05d}.json.gz" for i in range(C4_TRAIN_SHARDS)]
        val = [f"{C4_HUB}/c4-validation.{i:05d}-of-{C4_VALIDATION_SHARDS:05d}.json.gz"
               for i in range(C4_VALIDATION_SHARDS)]
    else:
        files = local_files("--data", data)
        val = [f for f in files if "validation" in os.path.basename(f)]
        train = [f for f in files if f not in val]
    if val_data:
        val = local_files("--val-data", val_data)
        train = [f for f in train if f not in val]
    if not train:
        raise ConfigError(f"--data {data!r} leaves no training file: every file it matches is held out "
                          "('validation' in its name, or in --val-data)")
    return DataFiles(train, val or train, held_out_slice=not val)


def local_files(flag: str, value: str) -> list[str]:
    pattern = str(DATA_DIR / "sample" / "*.json.gz") if value == "sample" else value
    if os.path.isdir(pattern):
        pattern = os.path.join(pattern, "*.json*")
    files = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    if not files:
        raise ConfigError(f"{flag} {value!r} matches no file; give a C4-format .json/.json.gz path or glob")
    return files


def in_held_out_slice(text: str) -> bool:
    """Decided by a hash of the text alone: the same slice for every run, rank, world size and resume, no state."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELD_OUT_EVERY == 0


def parse_c4_line(line: str) -> str | None:
    """The document text of one C4 JSON line, or None for a malformed line or an empty document."""
    try:
        text = json.loads(line)["text"]
    except (ValueError, KeyError, TypeError):
        return None
    return text if isinstance(text, str) and text.strip() else None


class DocumentStream:
    """Virtual stream `rank` of `world`: its documents in an order fixed by the seed, resumable exactly. Lines are
    parsed here, so a malformed line is skipped rather than failing its shard; the shuffle buffer is ours, since
    datasets' own is not in its state_dict."""

    def __init__(self, files: list[str], rank: int, world: int, seed: int | None, buffer_size: int,
                 held_out: bool | None = None):
        """seed None keeps the file order; held_out True reads only the held-out slice, False all but it, None all."""
        self.files, self.rank, self.world, self.seed, self.buffer_size = files, rank, world, seed, buffer_size
        self.held_out = held_out
        self.remote = any(f.startswith("hf://") for f in files)
        self.epoch, self.position, self.buffer, self.skipped = 0, None, [], 0
        self.rng = torch.Generator().manual_seed((seed or 0) * 1_000_003 + rank)

    def _open_epoch(self):
        import datasets
        from datasets.distributed import split_dataset_by_node
        order = range(len(self.files)) if self.seed is None else torch.randperm(
            len(self.files), generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        with dataset_cache(self.remote) as cache:
            stream = datasets.load_dataset("text", data_files=[self.files[i] for i in order], split="train",
                                           streaming=True, encoding_errors="replace", cache_dir=cache)
        stream = split_dataset_by_node(stream, rank=self.rank, world_size=self.world)
        if self.position is not None:
            stream.load_state_dict(self.position)
        return stream

    def __iter__(self):
        failures, usable, whole_epoch = 0, 0, self.position is None
        while True:
            try:
                stream = self._open_epoch()
                # iter(), unlike a plain loop, does not split the shards again inside a DataLoader worker
                for row in stream.iter(batch_size=1):
                    self.position, failures = stream.state_dict(), 0
                    text = parse_c4_line(row["text"][0])
                    if text is None:
                        self.skipped += 1
                        continue
                    if self.held_out is not None and in_held_out_slice(text) != self.held_out:
                        continue
                    usable += 1
                    self.buffer.append(text)
                    if len(self.buffer) > self.buffer_size:
                        slot = int(torch.randint(len(self.buffer), (), generator=self.rng))
                        self.buffer[slot], self.buffer[-1] = self.buffer[-1], self.buffer[slot]
                        yield self.buffer.pop()
            except Exception as error:
                failures += 1
                self._wait_or_give_up(error, failures)
                continue                       # reopen at the saved position: nothing read twice
            if whole_epoch and not usable and not self.buffer:
                raise ConfigError(f"data stream {self.rank} of {self.world} holds no usable document "
                                  f"({self.skipped} malformed or empty lines); check the files of --data")
            self.epoch, self.position, usable, whole_epoch = self.epoch + 1, None, 0, True

    def _wait_or_give_up(self, error: Exception, failures: int) -> None:
        """Hub errors are retried with exponential backoff and jitter, so that ranks hitting a rate limit together
        do not retry together; local files are not retried."""
        cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if self.remote and in_hf_cache(error):
            raise hf_cache_refused(cause) from error
        if not self.remote:
            raise ConfigError(f"a data shard is unreadable ({cause}); check the files of --data") from error
        unreachable = contract.hub_unreachable(error)
        if failures > HUB_RETRIES or unreachable or "Offline" in type(error).__name__:
            raise DataUnavailable(("the hub cannot be reached" if unreachable else "C4 could not be streamed from "
                                   f"the hub after {failures} attempt(s)") + f" ({cause}); download shards once with "
                                  "`bash setup.sh --prefetch-c4 N` and pass their glob to --data, or pass another "
                                  "local glob") from error
        delay = min(HUB_MAX_BACKOFF_S, 2 ** failures) * random.Random().uniform(0.5, 1.5)
        print(f"warning: hub read failed ({cause}); retry {failures}/{HUB_RETRIES} in {delay:.0f} s", file=sys.stderr)
        time.sleep(delay)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "buffer": list(self.buffer),
                "rng": self.rng.get_state(), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.buffer = state["epoch"], state["position"], list(state["buffer"])
        self.rng.set_state(state["rng"])
        self.skipped = state["skipped"]


LEGACY_TOKENS = "pending tokens saved by an older checkpoint"


class TokenWindows:
    """Packs a document stream into seq_len + 1 windows, documents joined by the end-of-text token or by nothing
    (separator "none", the study's). Its state is the document stream's state before the documents whose tokens are
    pending, and how many of their tokens were taken: a resume encodes those documents again rather than a checkpoint
    holding their tokens (long documents made that megabytes per stream). Packing ignores the documents per encode."""

    def __init__(self, documents: DocumentStream, tokenizer, seq_len: int, separator: str = "eot",
                 docs_per_encode: int = 64):
        self.documents, self.tokenizer = documents, tokenizer
        self.separator = (tokenizer.eot,) if separator == "eot" else ()
        self.window, self.docs_per_encode = seq_len + 1, docs_per_encode
        self.tokens, self.offset = torch.zeros(0, dtype=torch.long), 0
        self.refills = []            # (the documents' state before a refill whose tokens are pending, its token count)
        self._docs = iter(documents)

    def _refill(self) -> None:
        before = self.documents.state_dict()
        texts = [text for _, text in zip(range(self.docs_per_encode), self._docs)]
        if not texts:
            raise ConfigError("the data stream holds no usable document")
        ids = [token for doc in self.tokenizer.encode_batch(texts) for token in (*doc, *self.separator)]
        self.tokens = torch.cat([self.tokens, torch.tensor(ids, dtype=torch.long)])
        self.refills.append((before, len(ids)))
        if len(self.refills) == 1 and self.offset >= len(self.tokens):     # a saved count is always inside its refill
            raise ConfigError(f"the checkpoint's data position ({self.offset:,} tokens taken) lies past the "
                              f"{len(self.tokens):,} tokens its documents hold; resume from another checkpoint")

    def take(self, count: int) -> torch.Tensor:
        need = count * self.window
        while len(self.tokens) - self.offset < need:
            self._refill()
        windows = self.tokens[self.offset:self.offset + need].view(count, self.window)
        self.offset += need
        while self.refills and self.offset >= self.refills[0][1]:     # a refill wholly taken: its state is spent
            length = self.refills.pop(0)[1]
            self.tokens, self.offset = self.tokens[length:], self.offset - length
        return windows

    def state_dict(self) -> dict:
        """`skipped` counts the malformed lines read so far, the documents' state those before its start."""
        start = self.refills[0][0] if self.refills else self.documents.state_dict()
        skipped = self.documents.skipped
        if start is LEGACY_TOKENS:                # pending tokens that no document state can encode again
            return {"documents": self.documents.state_dict(), "tokens": self.tokens[self.offset:].clone(), "offset": 0,
                    "skipped": skipped}
        return {"documents": start, "taken": self.offset, "skipped": skipped}

    def load_state_dict(self, state: dict) -> None:
        """`taken` tokens are skipped when the documents are encoded again; a checkpoint that holds the pending
        tokens themselves (written before states held `taken`) is read as it was written."""
        self.documents.load_state_dict(state["documents"])
        self.refills, self._docs = [], iter(self.documents)
        if "taken" in state:
            if type(state["taken"]) is not int or state["taken"] < 0:
                raise ValueError(f"a data position of {state['taken']!r} tokens taken")
            self.tokens, self.offset = torch.zeros(0, dtype=torch.long), state["taken"]
        else:
            self.tokens, self.offset = state["tokens"][state["offset"]:], 0
            self.refills = [(LEGACY_TOKENS, len(self.tokens))]


class RankBatches:
    """This rank's share of every global batch, the same sequences whatever the world size: sequence p of a step is
    window p // S of virtual stream p mod S (S = --data-streams), and rank r takes positions r, r + world, ..."""

    def __init__(self, files: list[str], tokenizer, cfg, rank: int, world: int, micro: int,
                 skip_held_out: bool = False):
        self.recipe = (files, tokenizer, cfg, rank, world, micro, skip_held_out)   # a loader process rebuilds it
        self.count, self.batch_size = cfg.data_streams, cfg.batch_size
        self.positions = range(rank, cfg.batch_size, world)
        self.owners = [p % self.count for p in self.positions]
        # streams no position reads (a batch below --data-streams) are kept too: their states go into checkpoints
        read = sorted(set(self.owners) | set(range(rank, self.count, world)))
        held_out = False if skip_held_out else None
        self.streams = {v: TokenWindows(DocumentStream(files, v, self.count, cfg.data_seed, cfg.shuffle_buffer,
                                                       held_out), tokenizer, cfg.seq_len, cfg.doc_separator)
                        for v in read}
        self.micro, self.cursor, self.step = micro, 0, None

    def read_step(self, streams: list[int]) -> tuple[list[int], torch.Tensor]:
        """This rank's slots of the next step that `streams` own, and their windows. A stream shared with other ranks
        (the world size does not divide the streams) is read whole, the others' windows dropped."""
        windows = {v: self.streams[v].take(len(range(v, self.batch_size, self.count))) for v in streams}
        slots = [slot for slot, v in enumerate(self.owners) if v in windows]
        return slots, torch.stack([windows[self.owners[s]][self.positions[s] // self.count] for s in slots])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cursor == 0:
            self.step = self.read_step(sorted(set(self.owners)))[1]
        windows = self.step[self.cursor:self.cursor + self.micro]
        self.cursor = (self.cursor + self.micro) % len(self.owners)
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        """Taken between steps (checkpoints are): a step's streams are read when its first micro-batch is."""
        return {"cursor": self.cursor, "streams": {str(v): s.state_dict() for v, s in self.streams.items()}}

    def load_state_dict(self, states: list[dict]) -> None:
        """`states` are every rank's saved states: each stream is found wherever it was saved."""
        saved = {int(v): state for rank_state in states for v, state in rank_state["streams"].items()}
        missing = sorted(set(self.streams) - set(saved))
        if missing:
            raise ConfigError(f"the checkpoint holds no state for data stream(s) {missing}; was --data-streams "
                              "changed? resume with the original value")
        for v, stream in self.streams.items():
            stream.load_state_dict(saved[v])
        self.cursor = states[0]["cursor"]


def make_loader(batches: RankBatches, cfg, pin_memory: bool) -> Loader:
    steps_ahead = -(-cfg.prefetch * batches.micro // len(batches.owners))       # --prefetch counts micro-batches
    return Loader(batches, cfg.data_workers, cfg.data_timeout, steps_ahead, pin_memory)


def fixed_sequences(data: DataFiles, tokenizer, seq_len: int, count: int, separator: str = "eot"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` windows of the held-out documents in file order, packed as training packs its documents:
    the same for every eval. One document per encode, so that the stream's epoch says whether they ran out."""
    documents = DocumentStream(data.val, rank=0, world=1, seed=None, buffer_size=0,
                               held_out=True if data.held_out_slice else None)
    sequences = TokenWindows(documents, tokenizer, seq_len, separator, docs_per_encode=1).take(count)
    if documents.epoch and int(os.environ.get("RANK", "0")) == 0:
        print(f"warning: the held-out set ({', '.join(map(os.path.basename, data.val))}"
              f"{', its held-out slice' if data.held_out_slice else ''}) is smaller than the {count} "
              f"sequences of {seq_len + 1} tokens evaluation takes (--eval-batches x --batch-size): its documents "
              "repeat, so val_loss and the probe rest on less data than asked", file=sys.stderr, flush=True)
    return sequences[:, :-1], sequences[:, 1:]



def held_out_source(data: DataFiles, val_data: str) -> str:
    if data.held_out_slice:
        return (f"1 document in {HELD_OUT_EVERY} of the training files (by a hash of its text), never trained on; "
                "the first of them in file order")
    return f"{len(data.val)} file(s) " + (f"of --val-data {val_data!r}" if val_data else "named 'validation'")
