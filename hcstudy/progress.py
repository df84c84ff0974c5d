"""The pace shown while a run trains: a progress bar on a terminal, plain log lines elsewhere, and status.json's live
fields (loss, tokens/s, ETA)."""
from __future__ import annotations

import sys
from datetime import timedelta

from tqdm import tqdm


class Progress:
    """A tqdm bar on an interactive terminal, a plain log line every --log-every steps otherwise. Both carry the
    run's pace (tokens/s, MFU, memory, ETA); status.json shows the same, rewritten at every log step."""

    LIVE_KEYS = ("loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s", "mfu", "mem_peak_gb",
                 "val_loss", "amax_fwd", "amax_bwd")

    def __init__(self, cfg, is_main: bool, log, step: int):
        """cfg: the run's Config; log: its RunLog (run_folder.py), on rank 0 `is_main`; step: the one it starts at."""
        self.cfg, self.log, self.step_seconds = cfg, log, None
        interactive = is_main and sys.stderr.isatty()
        self.bar = tqdm(total=cfg.steps, initial=step, dynamic_ncols=True) if interactive else None
        log.bar = self.bar
        log.live["steps"] = cfg.steps

    def update(self, record: dict) -> None:
        cfg, log, step = self.cfg, self.log, record["step"]
        # a moving average: the ETA follows the recent pace, not the first step's compilation or an evaluation
        seconds = record["step_time_s"]
        self.step_seconds = seconds if self.step_seconds is None else 0.9 * self.step_seconds + 0.1 * seconds
        log.live.update({key: record[key] for key in self.LIVE_KEYS if key in record},
                        eta_s=self.step_seconds * (cfg.steps - step))
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                                 amax=self._amax())
            self.bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            log.info(self.line(record), terminal=self.bar is None)     # the bar shows the pace; train.log keeps it
            log.status("running", step)

    def _amax(self) -> str:
        amax = self.log.live.get("amax_fwd")
        return f"{amax:.3g}" if amax is not None else "-"

    def line(self, record: dict) -> str:
        live = self.log.live
        val = f" val {record['val_loss']:.4f}" if "val_loss" in record else ""
        mfu = f" mfu {live['mfu']:.0%}" if live.get("mfu") is not None else ""
        mem = f" mem {live['mem_peak_gb']:.1f}GB" if live.get("mem_peak_gb") is not None else ""
        return (f"step {record['step']}/{self.cfg.steps} loss {record['loss']:.4f}{val} lr {record['lr']:.3g} "
                f"grad_norm {record['grad_norm']:.3g} amax_fwd {self._amax()} tok/s {record['tokens_per_s']:,.0f}"
                f"{mfu}{mem} eta {timedelta(seconds=round(live['eta_s']))}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.log.bar = None
