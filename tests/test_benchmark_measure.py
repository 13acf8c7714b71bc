"""The benchmarks' shared measuring module (benchmarks/_measure.py) on allocations of known size."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import _measure  # noqa: E402

MIB = 2 ** 20


def _four_then_two(kept):
    """Peak 8 MiB: two 4 MiB tensors live together, then freed; a 2 MiB tensor outlives the call."""
    a = torch.empty(MIB, dtype=torch.float32)
    b = torch.empty(MIB, dtype=torch.float32)
    del a, b
    kept.append(torch.empty(MIB // 2, dtype=torch.float32))


def test_cpu_peak_counts_only_the_call():
    existing = torch.ones(4 * MIB)  # noqa: F841  (16 MiB live before the call: not counted)
    kept = []
    readings = []
    for _ in range(3):
        readings.append(_measure.peak_memory_bytes(lambda: _four_then_two(kept), "cpu"))
        # freed between calls, with no profiler running: the CPU allocator's own profiling total
        # never hears of this free and would count these 2 MiB again in every later call
        kept.clear()
    assert readings == [8 * MIB] * 3


def test_cpu_peak_of_a_free_during_the_call():
    def make_and_drop():
        x = torch.empty(3 * MIB // 4, dtype=torch.float32)  # 3 MiB
        y = x + 1  # 6 MiB live
        del x
        return y.sum()

    assert _measure.peak_memory_bytes(make_and_drop, "cpu") == pytest.approx(6 * MIB, abs=4096)


def test_summarize_quantiles():
    times = [float(t) for t in range(1, 11)]  # 1 .. 10 s
    s = _measure.summarize(times)
    assert s["median_s"] == 5.5
    assert s["p20_s"] == pytest.approx(2.8) and s["p80_s"] == pytest.approx(8.2)  # inclusive method
    assert _measure.summarize([3.0]) == {"median_s": 3.0, "p20_s": 3.0, "p80_s": 3.0}


def test_time_repeats_counts_calls():
    calls = []
    result = _measure.time_repeats(lambda: calls.append(1), "cpu", repeats=4, warmup=2)
    assert len(calls) == 6 and 0 <= result["p20_s"] <= result["median_s"] <= result["p80_s"]
