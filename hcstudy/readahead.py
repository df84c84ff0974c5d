"""The trainer's data read ahead, so that the accelerator does not wait on reading and tokenizing.

Beside train_c4.py, whose loader (RankBatches) decides which sequences every step holds and resumes exactly; here
those steps are read in DataLoader processes (off the training process's interpreter lock) or a thread, and the
states of the streams kept for checkpoints (docs/data.md).
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import multiprocessing
import os
import queue
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from hcstudy.contract import ConfigError, DataUnavailable, TrainerError


class _StepShares(torch.utils.data.IterableDataset):
    """One reader's share of every step: the windows of every readers-th of the rank's streams. Its streams' recent
    states stay with the reader and are sent on request (at a checkpoint): they hold the shuffle buffers, megabytes
    that would cost more to receive every step than reading the data."""

    def __init__(self, batches, readers: int, keep: int, make_queue=multiprocessing.Queue):
        self.rebuild, self.recipe, self.state = type(batches), batches.recipe, batches.state_dict()  # RankBatches
        self.readers, self.keep = readers, keep
        self.requests, self.replies = [make_queue() for _ in range(readers)], make_queue()

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()            # None in the loader thread
        reader = worker.id if worker else 0
        batches = self.rebuild(*self.recipe)                   # each reader builds its own
        batches.load_state_dict([self.state])
        mine, states = sorted(set(batches.owners))[reader::self.readers], {}   # a small batch reads fewer streams
        threading.Thread(target=self._answer, args=(reader, states), daemon=True).start()
        try:
            for step in itertools.count():
                slots, windows = batches.read_step(mine)
                states[step] = {str(v): batches.streams[v].state_dict() for v in mine}
                states.pop(step - self.keep, None)
                yield slots, windows, None
        except TrainerError as error:          # raised in the training process as one line, not a worker traceback
            yield None, None, error

    def _answer(self, reader: int, states: dict) -> None:
        while True:
            self.replies.put(states[self.requests[reader].get()])

    def states_after(self, step: int, timeout: float) -> dict:
        """Every reader's stream states after `step` (counted from 0), merged."""
        for requests in self.requests:
            requests.put(step)
        streams = {}
        try:
            for _ in self.requests:
                streams |= self.replies.get(timeout=timeout)
        except queue.Empty:
            raise DataUnavailable(f"a data loader process did not send its state within {timeout:.0f} s") from None
        return streams


def _leave_group_signals_to_the_trainer(_worker_id: int) -> None:
    """A stop signal sent to the job's process group must reach the trainer alone, which finishes its step and
    checkpoints; a worker in a group of its own asks Linux to end it with the trainer, so it never outlives it."""
    os.setpgrp()
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
        if os.getppid() == 1:                               # the training process died before the line above
            os._exit(1)


class Loader:
    """Reads the rank's steps ahead, so the accelerator does not wait on reading and tokenizing: in `workers`
    DataLoader processes (off the training process's interpreter lock) or, with 0, a thread reading `depth` steps
    ahead. Shares come back in reader order, so the batches are RankBatches'. Reading starts at the first
    next_batch, after a resume's load_state_dict; state_dict is the state after the last whole step consumed."""

    def __init__(self, batches, workers: int, timeout: float, depth: int = 1, pin_memory: bool = False):
        self.batches, self.workers, self.timeout, self.pin_memory = batches, workers, timeout, pin_memory
        self.depth = depth
        self.micro, self.per_step, self.steps, self.cursor, self.waited = batches.micro, len(batches.owners), 0, 0, 0.0
        self.state, self.shares, self.stopping = (0, batches.state_dict()), None, threading.Event()

    def load_state_dict(self, states: list[dict]) -> None:
        """Every rank's saved states (RankBatches.load_state_dict), before the first next_batch."""
        self.batches.load_state_dict(states)
        self.state = (0, self.batches.state_dict())

    def _start(self) -> None:
        self.unread = self.state[1]["streams"]          # streams no batch position reads keep this state
        if self.workers:                                # states kept: more steps than a worker runs ahead (2)
            self.shares = _StepShares(self.batches, self.workers, keep=8)
            self.received = iter(torch.utils.data.DataLoader(self.shares, batch_size=None, num_workers=self.workers,
                                                             prefetch_factor=2, timeout=self.timeout,
                                                             worker_init_fn=_leave_group_signals_to_the_trainer))
        else:
            self.shares = _StepShares(self.batches, 1, keep=self.depth + 4, make_queue=queue.Queue)
            self.queue = queue.Queue(self.depth)
            self.thread = threading.Thread(target=self._read_ahead, daemon=True, name="prefetch")
            self.thread.start()

    def _read_ahead(self) -> None:
        try:
            for share in self.shares:
                if not self._put(share):
                    return
        except BaseException as error:                 # handed to the consumer, raised there
            self._put((None, None, error))

    def _put(self, share: tuple) -> bool:
        while not self.stopping.is_set():              # a put that waits forever would block close()
            with contextlib.suppress(queue.Full):
                self.queue.put(share, timeout=0.1)
                return True
        return False

    def _receive(self) -> tuple:
        try:
            return next(self.received) if self.workers else self.queue.get(timeout=self.timeout)
        except (queue.Empty, RuntimeError) as error:   # RuntimeError: the DataLoader's, a worker died or timed out
            if isinstance(error, RuntimeError) and "timed out" not in str(error):
                raise DataUnavailable(f"a data loader process failed ({str(error).splitlines()[0]})") from None
            raise DataUnavailable(f"the data loader delivered nothing for {self.timeout:.0f} s (--data-timeout); "
                                  "the data source stalled") from None

    def _next_step(self) -> None:
        if self.shares is None:
            self._start()
        started = time.perf_counter()
        try:
            shares = [self._receive() for _ in range(self.workers or 1)]
        finally:
            self.waited += time.perf_counter() - started
        for *_, error in shares:
            if error is not None:
                raise error
        windows = torch.empty(self.per_step, shares[0][1].shape[1], dtype=torch.long)
        for slots, part, _ in shares:
            windows[slots] = part
        self.inputs, self.targets = (t.contiguous() for t in (windows[:, :-1], windows[:, 1:]))
        if self.pin_memory:                            # page-locked: the copy to the GPU runs asynchronously
            self.inputs, self.targets = self.inputs.pin_memory(), self.targets.pin_memory()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cursor == 0:
            self._next_step()
        start, self.cursor = self.cursor, (self.cursor + self.micro) % self.per_step
        self.steps += self.cursor == 0
        return self.inputs[start:start + self.micro], self.targets[start:start + self.micro]

    def state_dict(self) -> dict:
        if self.state[0] != self.steps:
            streams = self.unread | self.shares.states_after(self.steps - 1, self.timeout)
            self.state = (self.steps, {"cursor": 0, "streams": streams})
        return self.state[1]

    @property
    def skipped(self) -> int:
        """Malformed or empty lines skipped so far."""
        # a stream state written before states counted them at the top holds the count in its documents' state
        streams = self.state_dict()["streams"].values()
        return sum(stream.get("skipped", stream["documents"]["skipped"]) for stream in streams)

    def close(self) -> None:
        """The thread stops before the interpreter exits (a thread killed inside torch aborts the process); the
        DataLoader iterator shuts its workers down when released."""
        self.stopping.set()
        if self.shares is not None and not self.workers:
            self.thread.join(timeout=60)
        self.received = None


def dataset_cache(remote: bool):
    """Where datasets puts its lock file while it sets a stream up: its cache (HF_DATASETS_CACHE, under HF_HOME) for
    the hub; a temporary folder for local files, which need no cache, so that an unwritable one never stops them."""
    return contextlib.nullcontext() if remote else tempfile.TemporaryDirectory()


def in_hf_cache(error: Exception) -> bool:
    """Whether `error` is the file system refusing datasets' cache folder (HF_DATASETS_CACHE, under HF_HOME) or
    a folder above it that it tried to create: a cause no data file can fix."""
    import datasets
    if not (isinstance(error, OSError) and error.filename):
        return False
    cache, refused = Path(datasets.config.HF_DATASETS_CACHE).absolute(), Path(error.filename).absolute()
    return refused == cache or refused in cache.parents or cache in refused.parents


def hf_cache_refused(cause: str) -> ConfigError:
    return ConfigError(f"the Hugging Face cache cannot be written ({cause}); set HF_HOME (or HF_DATASETS_CACHE) to "
                       "a writable folder, or train on local files (--data sample, or a glob)")

