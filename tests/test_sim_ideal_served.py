"""The simulator's ideal (infinite cache) bounds its measured hit rate: both count the served requests only, so a
run that rejects requests with little reuse cannot appear to beat the infinite cache."""

from __future__ import annotations

import logging

import pytest

from kv_cache_manager_v2.sim.options import SimulatorOptions
from kv_cache_manager_v2.sim.scheduler import Workload
from kv_cache_manager_v2.sim.simulator import simulate, workload_ideal
from kv_cache_manager_v2.sim.workload import TraceRequest

SHARED_PREFIX = list(range(1, 129))


def request(index: int) -> TraceRequest:
    """Even requests share a 128-token prefix and fit the GPU tier; odd ones are 1000 unique tokens (rejected)."""
    if index % 2:
        prompt = [10_000 * (index + 1) + token for token in range(1000)]
    else:
        prompt = SHARED_PREFIX + [5_000 + 100 * index + token for token in range(16)]
    output = [90_000 + 10 * index + token for token in range(4)]
    return TraceRequest(index, prompt, output, index, index, 0, None, None, 0)


def test_ideal_counts_the_served_requests_the_hit_rate_counts() -> None:
    requests = [request(index) for index in range(8)]
    options = SimulatorOptions(num_requests=len(requests), gpu_mib=32)
    result = simulate(options, workload=Workload(requests, workload_ideal(options, requests)))
    # Before: 4 rejected, hit rate 66.7% against an ideal (over all requests) of 8.4%.
    assert result.rejected == 4
    assert result.hit_rate > result.ideal_hit_rate_all_requests
    assert result.hit_rate <= result.ideal_hit_rate


def test_ideal_bounds_the_hit_rate_with_and_without_rejections() -> None:
    for seed, gpu_mib, host_mib in ((0, 24, 0), (1, 32, 64), (2, 384, 0)):
        options = SimulatorOptions(num_requests=24, seed=seed, gpu_mib=gpu_mib, host_mib=host_mib, check=False)
        result = simulate(options)
        assert result.hit_rate <= result.ideal_hit_rate, (seed, gpu_mib, host_mib)
        if not result.rejected:
            assert result.ideal_hit_rate == result.ideal_hit_rate_all_requests


def test_the_timeline_ends_at_the_run_hit_rate_when_the_last_request_is_rejected() -> None:
    """The last request reuses the first one's prefix, then outgrows the GPU tier alone: the step that rejects it
    computes nothing, so it took no sample, and the timeline (the plot's curve, the JSON's series) ended at a hit
    rate still counting it while the summary had taken it out."""
    requests = [request(0), TraceRequest(1, SHARED_PREFIX + list(range(20_000, 21_000)), [95_000], 50, 1)]
    options = SimulatorOptions(num_requests=len(requests), gpu_mib=32, chunk=64)  # its first chunk fits
    result = simulate(options, workload=Workload(requests, workload_ideal(options, requests)))
    assert result.rejected == 1 and result.hit_rate == 0.0
    assert result.timeline_hit_rate[-1] == result.hit_rate
    assert len(result.timeline_steps) == result.steps - result.idle_steps  # still one sample per busy step


def test_a_request_too_long_for_the_gpu_tier_is_named_and_costs_no_work(caplog: pytest.LogCaptureFixture) -> None:
    """A request longer than the GPU tier holds alone: the run's first warning quoted the workload's mean length as
    "typical_step's longest cache", a setting a simulator user never gave, and the request's prompt was prefilled
    as far as the tier held before it was rejected, those chunks counted as computed tokens."""
    requests = [request(0), TraceRequest(1, [20_000 + token for token in range(3000)], [95_000], 1, 1), request(2)]
    options = SimulatorOptions(num_requests=len(requests), gpu_mib=32, chunk=64)
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        result = simulate(options, workload=Workload(requests, workload_ideal(options, requests)))
    warnings = [record.getMessage() for record in caplog.records]
    assert not any("typical_step" in warning for warning in warnings), warnings
    assert any(warning.startswith("1 of 3 requests need more than the GPU tier holds") and "request 1, needs 3000" in
               warning and "--gpu-mib 32, --chunk 64" in warning for warning in warnings), warnings
    assert result.rejected == 1 and result.finished == 2
    served_prompts = sum(request.prompt_length for request in requests if request.request_id != 1)
    assert result.prompt_tokens == served_prompts
    assert result.prefill_tokens == served_prompts - result.reused_tokens  # nothing computed for the rejected one
