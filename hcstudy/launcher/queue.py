"""The run: the queue, slots that free up, and what each exit code means (MatrixRun), in one process that lives as
long as run_experiments.sh and writes every decision to matrix.log (Log).

The conversation with the bash side (Bash; `--requests FD --replies FD`, two pipes): this process writes one
request per line, shell-quoted words; bash answers with zero or more lines and then `end`.

    lock FILE                       take the launcher lock (flock), inherited by every job -> `ok` | `busy`
    probe LOGDIR GPU...             probe the GPUs in parallel, output in LOGDIR/probe{GPU}.log -> `GPU STATUS`...
    launch RUN GPUS LOG CMD...      start CMD in its own process group with CUDA_VISIBLE_DEVICES=GPUS
                                    (`cpu`: none), appending to LOG
    wait MS POLL_MS                 until a job exits, a signal arrives or MS pass -> `exited RUN STATUS`...,
                                    `signal INT|TERM`...
    kill SIGNAL                     send SIGNAL to every running job's process group
"""
from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

from hcstudy.contract import (CHECKPOINT_MARKER, CHECKPOINTS, CONFIG_FILE, EXIT_BAD_CONFIG, EXIT_DATA, EXIT_DEVICE,
                              EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_OK, EXIT_OOM, LAUNCHER_FILE, STATUS_FILE, TRAIN_LOG,
                              TRAINER_EXIT_CODES, log_line, read_json, write_json_atomic)
from hcstudy.launcher.jobs import lock_name, log_name, probe_folder_name, slot_count, trainer_base, trainer_flags
from hcstudy.launcher.options import EXIT_FAILED, EXIT_SIGINT, EXIT_SIGTERM, PROG, RunError, extra_value
from hcstudy.launcher.summary import print_report, show_matrix


class LauncherGone(Exception):
    """The bash side closed the conversation (it was killed): nothing left to decide."""


class Bash:
    """The process-control side: one request per line, its answer lines up to `end`. Every answer may carry
    `signal NAME` lines: a Ctrl-C or SIGTERM the launcher received since its last answer."""

    def __init__(self, requests, replies):
        self.requests, self.replies = os.fdopen(requests, "w"), os.fdopen(replies)
        self.signals = []

    def ask(self, *words):
        try:
            self.requests.write(shlex.join(map(str, words)) + "\n")
            self.requests.flush()
        except BrokenPipeError:
            raise LauncherGone from None
        answer = []
        for line in self.replies:
            words = line.split(maxsplit=2)
            if words == ["end"]:
                return answer
            if words[:1] == ["signal"]:
                self.signals.append(words[1])
            else:
                answer.append(words)
        raise LauncherGone


class Log:
    """Timestamped decisions, to the terminal and to the matrix log."""

    def __init__(self, path):
        self.path = path

    def __call__(self, event, text="", run=None, **fields):
        """One line of matrix.log's grammar (contract.log_line): `STAMP EVENT [RUN] [key=value ...] [text]`."""
        line = log_line(event, run, text, **fields)
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def tail_lines(path, count):
    """The last `count` lines of a log, read from its last 64 KiB: a train.log grows with every attempt."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text.replace("\r", "").splitlines()[-count:]


def newest_checkpoint(folder):
    """`step-N` of the run's newest complete checkpoint (one with its marker), None without one: where its trainer
    resumes, unless the checksums fail (train.log then says which one it took)."""
    steps = [int(d.name[5:]) for d in Path(folder, CHECKPOINTS).glob("step-*")
             if d.name[5:].isascii() and d.name[5:].isdigit() and (d / CHECKPOINT_MARKER).is_file()]
    return f"step-{max(steps)}" if steps else None


def last_line(path):
    return "".join(tail_lines(path, 1))[:300]


class MatrixRun:
    def __init__(self, opt, jobs, gpus, bash):
        self.opt, self.bash, self.gpus = opt, bash, gpus
        self.jobs = [j for j in jobs if j.node == opt.node_rank]
        self.base = trainer_base(opt)
        self.cpu = gpus == ["cpu"]
        self.gpu_state = dict.fromkeys(gpus, "free")           # free|busy|quarantined
        self.failed_runs = {g: [] for g in gpus}               # the runs that had a device error on a GPU
        self.queue, self.running = [], {}
        self.stopping, self.stop_status, self.stop_deadline = False, EXIT_OK, 0.0
        self.last_launch = None
        # the evidence behind a QUARANTINE line stays with the matrix, kept after it ends (each probe of a GPU
        # replaces that GPU's log)
        self.probes = opt.out / probe_folder_name(opt)
        self.log = Log(opt.out / log_name(opt))

    # -- start-up -------------------------------------------------------------------------------
    def start(self):
        o = self.opt
        if self.bash.ask("lock", o.out / lock_name(o)) != [["ok"]]:
            raise RunError(f"another launcher, or jobs of a killed one, are still running on {o.out} (see: fuser -v "
                           f"{o.out / lock_name(o)}); stop them or wait, then run this again")
        preset = o.preset or "c4"
        data = extra_value(o.extra, "--data") or f"preset {preset} default"
        self.log("START", f"{PROG} pid={os.getppid()} mode={o.mode} runs={len(self.jobs)} gpus={' '.join(self.gpus)} "
                          f"gpus_per_run={o.gpus_per_run} stagger={o.stagger:g}s max_retries={o.max_retries} "
                          f"data={data}"
                          + (f" node={o.node_rank}/{o.nodes}" if o.nodes > 1 else "")
                          + f" extra={shlex.join(o.extra)}")
        # the line report.py --watch reads the matrix from (queue order, slots, price, and the trainer's planned
        # seconds, the middle of its range: the view's ETA until steps are timed)
        planned = ",".join(f"{j.name}:{sum(j.planned['seconds']) / 2:.0f}" for j in self.jobs
                           if j.planned.get("seconds"))
        self.log("QUEUE", slots=slot_count(o, self.gpus), gpus_per_run=o.gpus_per_run, gpus=",".join(self.gpus),
                 price_per_gpu_hour=f"{o.price:g}", runs=",".join(j.name for j in self.jobs), planned_s=planned)
        for job in self.jobs:
            if job.skipped_as:
                self.log("SKIP", f"already {job.skipped_as} (status.json)", job.name)
            else:
                self.queue.append(job)
        if not self.cpu and self.queue:
            for gpu, status in self.probe(self.gpus):
                if status == "0":
                    self.log("PROBE", "healthy", gpu=gpu)
                else:
                    self.quarantine(gpu, f"failed the start-up probe: {self.probe_reason(gpu, int(status))}")
            if self.healthy() < o.gpus_per_run:
                self.log("ERROR", f"too few GPUs passed the health probe ({self.healthy()} healthy, {o.gpus_per_run} "
                                  "needed per run); see the QUARANTINE lines above (on a machine without GPUs, leave "
                                  "out --gpus)")

    def probe(self, gpus):
        """(gpu, exit status) of each GPU probed in parallel, each probe's output in its log under --out."""
        self.probes.mkdir(exist_ok=True)
        return self.bash.ask("probe", self.probes, *gpus)

    def probe_reason(self, gpu, status):
        """A failed probe's last line, else what its exit status says."""
        return (last_line(self.probes / f"probe{gpu}.log") or (
            "timed out, no output" if status == 124 else f"killed by signal {status - 128}, no output" if status > 128
            else f"exit status {status}, no output"))

    def quarantine(self, gpu, reason):
        self.gpu_state[gpu] = "quarantined"
        self.log("QUARANTINE", f"{reason}; it is not used again in this matrix (probe log: "
                               f"{self.probes / f'probe{gpu}.log'})", gpu=gpu)

    def healthy(self):
        return sum(state != "quarantined" for state in self.gpu_state.values())

    # -- the loop -------------------------------------------------------------------------------
    def run(self):
        self.start()
        last_view = time.time()        # the first view a period after the start
        while self.running or not self.stopping and self.queue:
            self.handle_signals()
            if self.stopping:
                if time.time() > self.stop_deadline:
                    self.log("STOP", f"jobs still running {self.opt.stop_timeout}s after SIGTERM: killing them")
                    self.bash.ask("kill", "KILL")
                    self.stop_deadline = time.time() + 3600
            elif self.healthy() < self.opt.gpus_per_run and not self.cpu:
                for job in self.queue:
                    self.fail(job, "no healthy GPU left to run it")
                self.queue = []
                continue
            elif self.try_launch():
                continue           # poll again right away: another slot may be free
            for _, name, status in self.bash.ask("wait", int(self.wait_seconds() * 1000), int(self.opt.poll * 1000)):
                self.on_exit(self.running.pop(name), int(status))
            if self.opt.watch_every and self.running and time.time() - last_view >= self.opt.watch_every:
                last_view = time.time()
                show_matrix(self.opt)
        self.handle_signals()
        return self.finish()

    def wait_seconds(self):
        """One poll, or less when the stagger ends sooner, so launches are not late by a poll."""
        wait = self.opt.poll
        if not self.stopping and self.queue and self.last_launch is not None:
            left = self.last_launch + self.opt.stagger - time.time()
            wait = left if 0 < left < wait else wait
        return wait

    def handle_signals(self):
        while self.bash.signals:
            name = self.bash.signals.pop(0)
            if self.stopping:
                self.log("STOP", f"second SIG{name}: killing the remaining jobs without waiting for their checkpoints")
                self.bash.ask("kill", "KILL")
                continue
            self.stopping, self.stop_status = True, EXIT_SIGINT if name == "INT" else EXIT_SIGTERM
            self.stop_deadline = time.time() + self.opt.stop_timeout
            self.log("STOP", f"SIG{name} received: sending SIGTERM to {len(self.running)} job(s); each saves a "
                             "checkpoint and exits; run the same command again to resume")
            self.bash.ask("kill", "TERM")

    # -- launching ------------------------------------------------------------------------------
    def pick_gpus(self, job):
        """The GPUs for a job, or None. A job avoids the GPUs it had a device error on, as long as enough other
        healthy GPUs exist (then it waits for them to free up)."""
        if self.cpu:
            return "cpu" if self.gpu_state["cpu"] == "free" else None
        k = self.opt.gpus_per_run
        usable = [g for g, state in self.gpu_state.items() if state != "quarantined"]
        free = [g for g in usable if self.gpu_state[g] == "free"]
        preferred = [g for g in free if g not in job.avoid]
        if len(preferred) >= k:
            return ",".join(preferred[:k])
        if len([g for g in usable if g not in job.avoid]) < k and len(free) >= k:
            return ",".join(free[:k])
        return None

    def try_launch(self):
        """Launch the first ready job that fits a free slot; False when none."""
        now = time.time()
        if self.last_launch is not None and now - self.last_launch < self.opt.stagger:
            return False
        for job in self.queue:
            gpus = job.not_before <= now and self.pick_gpus(job)
            if gpus:
                self.queue.remove(job)
                self.launch(job, gpus)
                return True
        return False

    def launch(self, job, gpus):
        job.attempts += 1
        command = self.base + trainer_flags(self.opt, job)
        folder = self.opt.out / job.name
        folder.mkdir(parents=True, exist_ok=True)
        for g in gpus.split(","):
            self.gpu_state[g] = "busy"
        micro, batch = job.micro or job.planned.get("micro"), job.batch or job.planned.get("batch")
        resume = newest_checkpoint(folder)
        self.log("LAUNCH", f"cmd: CUDA_VISIBLE_DEVICES={'' if gpus == 'cpu' else gpus} {shlex.join(command)}", job.name,
                 gpus=gpus, attempt=job.attempts, **({"resume": resume} if resume else {}), micro_batch=micro,
                 global_batch=batch)
        self.last_launch = time.time()
        job.launched_at = self.last_launch - 1      # a status.json older than this is left from before
        with open(folder / TRAIN_LOG, "a") as f:
            f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')}: launcher attempt {job.attempts} on "
                    f"{'CPU' if gpus == 'cpu' else gpus}: {shlex.join(command)}\n")
        self.bash.ask("launch", job.name, gpus, folder / TRAIN_LOG, *command)
        self.running[job.name] = job
        job.gpus, job.state = gpus, "running"

    def requeue(self, job):
        """To the front of the queue: it has a checkpoint."""
        self.queue.insert(0, job)
        job.state = "pending"

    # -- exits ----------------------------------------------------------------------------------
    def status(self, job):
        """status.json as this attempt left it ({} when it is from an earlier attempt)."""
        return read_json(self.opt.out / job.name / STATUS_FILE, {}, newer_than=job.launched_at)

    def trainer_code(self, job, status):
        """A status the trainer does not use (torchrun reports 1 for any failed rank) is replaced by the
        exit_code rank 0 wrote to status.json during this attempt, when there is one."""
        if status in TRAINER_EXIT_CODES:
            return status
        code = self.status(job).get("exit_code")
        return code if code in TRAINER_EXIT_CODES - {EXIT_OK} else status

    def reason(self, job):
        """The trainer's own reason for its exit: status.json, else the last line of train.log."""
        return self.status(job).get("reason") or last_line(self.opt.out / job.name / TRAIN_LOG)

    def record_death(self, job, code):
        """A trainer that died without recording its end (SIGKILL, rank 0 killed under torchrun) leaves status.json
        `running`: the launcher, which saw the exit, records it as failed."""
        path = self.opt.out / job.name / STATUS_FILE
        status = read_json(path, {})
        if code in TRAINER_EXIT_CODES or status.get("state") != "running":
            return
        died = f"killed by signal {code - 128}" if code > 128 else f"exit {code}"
        write_json_atomic(path, {**status, "state": "failed", "exit_code": code, "updated": time.time(),
                          "reason": f"the trainer ended ({died}) without recording its state; seen by the launcher"})

    def on_exit(self, job, status):
        for g in job.gpus.split(","):
            if self.gpu_state[g] != "quarantined":
                self.gpu_state[g] = "free"
        code = self.trainer_code(job, status)
        self.log("EXIT", f"(trainer code {code} from status.json)" if code != status else "", job.name, code=status,
                 gpus=job.gpus)
        self.record_death(job, code)
        if self.stopping and code not in (EXIT_OK, EXIT_DIVERGED):
            job.state, job.reason = "interrupted", f"stopped by the launcher (exit {status}); resumes on the next run"
            return
        if code == EXIT_OK:
            job.state = "completed"
            self.log("DONE", "completed", job.name)
        elif code == EXIT_DIVERGED:
            job.state, job.reason = "diverged", self.reason(job)
            self.log("DIVERGED", f"recorded as a result, not retried: {job.reason}", job.name)
        elif code == EXIT_BAD_CONFIG:
            self.fail(job, f"bad arguments or config, not retried: {self.reason(job)}")
            train_log = self.opt.out / job.name / TRAIN_LOG
            print(f"---- last lines of {train_log} ----", *tail_lines(train_log, 5), sep="\n", file=sys.stderr,
                  flush=True)
        elif code == EXIT_OOM:
            self.oom_retry(job)
        elif code == EXIT_DEVICE:
            self.device_error(job)
        elif code == EXIT_DATA:
            self.data_retry(job)
        elif code == EXIT_INTERRUPTED:
            self.requeue_or_fail(job, "interrupted (exit 75) but the launcher is not stopping: resuming from its "
                                      "checkpoint",
                                 f"interrupted {self.opt.max_requeues + 1} times; not requeued again")
        else:
            self.retry_or_fail(job, f"exit {status}: {self.reason(job)}")

    def fail(self, job, reason):
        job.state, job.reason = "failed", reason
        self.log("FAILED", reason, job.name)

    def retry_or_fail(self, job, why):
        """A retry within --max-retries, else failed."""
        if job.retries < self.opt.max_retries:
            job.retries += 1
            self.log("RETRY", f"({why}) retry {job.retries}/{self.opt.max_retries}; resumes from its checkpoint",
                     job.name)
            self.requeue(job)
        else:
            self.fail(job, f"{why}; gave up after {self.opt.max_retries} retries")

    def requeue_or_fail(self, job, why, given_up):
        """Requeues (exit 75, device errors) are bounded by RUN_EXPERIMENTS_MAX_REQUEUES."""
        if job.requeues < self.opt.max_requeues:
            job.requeues += 1
            self.log("REQUEUE", why, job.name)
            self.requeue(job)
        else:
            self.fail(job, given_up)

    def data_retry(self, job):
        if job.data_retries >= self.opt.max_retries:
            self.fail(job, f"data source unreachable after {self.opt.max_retries} retries: {self.reason(job)}")
            return
        delay = self.opt.data_backoff << job.data_retries
        job.data_retries += 1
        job.not_before = time.time() + delay
        self.log("RETRY", f"data source unreachable: retry {job.data_retries}/{self.opt.max_retries} in {delay}s: "
                          f"{self.reason(job)}", job.name)
        self.requeue(job)

    def oom_retry(self, job):
        """Halve the micro-batch the run used, keep its global batch; once."""
        micro, batch = self.used_batches(job)
        if job.oom_retried:
            return self.fail(job, f"out of memory again at micro-batch {micro} (after one halving); pass a smaller -- "
                                  "--micro-batch-size or use --gpus-per-run")
        if not isinstance(micro, int):
            return self.fail(job, "out of memory, and its micro-batch is unknown (no config.json from this attempt, "
                                  f"micro-batch {micro or 'not given'}); pass -- --micro-batch-size N")
        if micro <= 1:
            return self.fail(job, "out of memory at micro-batch 1; a GPU cannot hold this run alone: use "
                                  "--gpus-per-run 2 or more")
        batch = batch if isinstance(batch, int) else None
        job.oom_retried, job.micro, job.batch = True, micro // 2, batch or job.batch
        write_json_atomic(self.opt.out / job.name / LAUNCHER_FILE,
                   {"micro_batch_size": job.micro, "reason": f"halved from {micro} after an out-of-memory exit"})
        self.log("RETRY", f"out of memory at micro-batch {micro}: retrying once with micro-batch {job.micro}, "
                          f"global batch {batch or 'unchanged (trainer default)'}", job.name)
        self.requeue(job)

    def used_batches(self, job):
        """(micro-batch, global batch) this attempt used: its config.json, else what the launcher passed, else what
        the trainer planned before the first launch (the OOM may come before config.json is written)."""
        config = read_json(self.opt.out / job.name / CONFIG_FILE, {}, newer_than=job.launched_at).get("config", {})
        known = {"micro_batch_size": job.micro or job.planned.get("micro"),
                 "batch_size": job.batch or job.planned.get("batch")}
        return [config[key] if isinstance(config.get(key), int) else value for key, value in known.items()]

    def device_error(self, job):
        """Exit 5: probe the job's GPUs; a GPU that fails the probe, or has now failed two different jobs, is
        quarantined. The job is requeued and avoids these GPUs."""
        if job.gpus == "cpu":
            return self.retry_or_fail(job, "device error on the CPU slot")
        gpus = job.gpus.split(",")
        for g in gpus:
            if job.name not in self.failed_runs[g]:
                self.failed_runs[g].append(job.name)
            job.avoid.add(g)
        for gpu, status in self.probe(gpus):
            if status != "0":
                self.quarantine(gpu, f"failed the probe after a device error in {job.name}: "
                                     f"{self.probe_reason(gpu, int(status))}")
            elif len(self.failed_runs[gpu]) >= 2:
                runs = " ".join(self.failed_runs[gpu])
                self.quarantine(gpu, f"passed the probe but failed two different jobs ({runs})")
            else:
                self.log("PROBE", f"healthy after a device error in {job.name}; kept (a second failing job "
                                  "quarantines it)", gpu=gpu)
        self.requeue_or_fail(job, f"after a device error on gpu {job.gpus}; it will run on other GPUs if any are "
                                  "healthy",
                             f"device errors on {job.requeues + 1} attempts; probably not the hardware: see "
                             f"{self.opt.out / job.name / 'train.log'}")

    # -- the end --------------------------------------------------------------------------------
    def finish(self):
        finished = ("completed", "diverged", "skipped_completed", "skipped_diverged")
        bad = [j for j in self.jobs if j.state not in finished]
        print(f"\nMatrix in {self.opt.out} (log: {self.log.path}):")
        for job in self.jobs:
            state = {"pending": "not started"}.get(job.state, job.state.replace("skipped_", "already "))
            print(f"  {job.name:<16} {state:<18} {job.reason}".rstrip())
        quarantined = [g for g, state in self.gpu_state.items() if state == "quarantined"]
        if quarantined:      # not remembered across invocations: the next start-up probe checks them again
            self.log("END", f"quarantined GPU(s): {' '.join(quarantined)}; to keep them out next time: --exclude-gpus "
                            f"{','.join(quarantined)}")
        ok = len(self.jobs) - len(bad)
        if self.stopping:
            self.log("END", f"stopped: {ok} of {len(self.jobs)} runs finished; run the same command to resume the rest")
            return self.stop_status
        print_report(self.opt)
        if bad:
            self.log("END", f"{ok} of {len(self.jobs)} runs finished; {len(bad)} failed:")
            for job in bad:
                self.log("END", f"failed {job.name}: {job.reason or job.state}")
            return EXIT_FAILED
        self.log("END", f"all {len(self.jobs)} runs finished (completed or diverged)")
        return EXIT_OK
