"""hcstudy/planner/run_time.py: a step priced at this CPU's rates, timed on one thread at the share of a core the
other work leaves."""
import dataclasses
import math

import pytest
import torch

from hcstudy.planner import run_time


def test_the_cpu_model_prices_the_trainers_threads_at_the_share_of_a_core_the_other_work_leaves():
    """One thread's timed rates (a core's own speed) become the trainer's: fast, its threads side by side at the share
    a thread gets; slow, one thread's share at two thirds; the host's ops on one thread either way."""
    quiet = run_time.cpu_rates_at(60e9, 100e9, 4e-6, cores=2, share=1.0)
    slow = run_time.CPU_SLOW_SHARE
    assert quiet.flops == (120e9, 60e9 * slow) and quiet.bandwidth == (200e9, 100e9 * slow)
    assert quiet.host == (4e-6, 4e-6 / slow) and not quiet.overlapped
    loaded = run_time.cpu_rates_at(60e9, 100e9, 4e-6, cores=2, share=0.4)     # a load of about 4 on 2 cores
    assert loaded.flops == pytest.approx((48e9, 24e9 * slow)) and loaded.host == pytest.approx((1e-5, 1e-5 / slow))
    work = run_time.StepCost("fused", 12e9, 2e9, 600, quiet)
    quiet_s, loaded_s = work.seconds, dataclasses.replace(work, rates=loaded).seconds
    assert loaded_s == pytest.approx(tuple(s / 0.4 for s in quiet_s))     # the step, at both ends, over the share
    assert run_time.cpu_rates_at(60e9, 100e9, 4e-6, 2, share=0.0).flops[1] > 0     # a timing that got no CPU at all


def test_the_cpu_rates_are_timed_on_one_thread_on_a_slice_of_a_large_shape(monkeypatch):
    """--estimate --width 65536 timed the MLP's matmul on its own (65536 x 262144) weight: 64 GiB. Never more than
    a slice, one thread, the caller's thread count kept."""
    randn, set_threads, threads, asked = torch.randn, torch.set_num_threads, torch.get_num_threads(), []

    def small_randn(*size, **kwargs):
        assert math.prod(size) <= 2 ** 24, f"the CPU timing allocates {size}"
        return randn(*size, **kwargs)

    def recorded_set_threads(n):
        asked.append(n)
        set_threads(n)
    monkeypatch.setattr(torch, "randn", small_randn)
    monkeypatch.setattr(torch, "set_num_threads", recorded_set_threads)
    rates = run_time.cpu_rates.__wrapped__(16 * 65536, 65536, 4)
    assert asked == [1, threads] and torch.get_num_threads() == threads
    assert 0 < rates.flops[1] < rates.flops[0] and 0 < rates.bandwidth[1] < rates.bandwidth[0]
    assert rates.host[0] < rates.host[1]
