"""A replayed trace starts at its first request, whatever its clock: production logs (an engine's request log, a
converted Azure or BurstGPT trace) stamp requests in Unix-epoch milliseconds (~1.7e12), which the loader refused,
and a trace whose first request came late ran from step 0 through every idle step up to it. What is bounded is the
span from the first request (the arrival steps), and the stamps' unit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kv_cache_manager_v2.sim.mooncake_trace import (
    MAX_TIMESTAMP_MS,
    MAX_TRACE_SPAN_MS,
    STEP_MS,
    TraceFormatError,
    load_mooncake_trace,
)
from kv_cache_manager_v2.sim.options import SimulatorOptions
from kv_cache_manager_v2.sim.report import result_json, workload_table
from kv_cache_manager_v2.sim.simulator import simulate

EPOCH_MS = 1_732_000_000_037  # 2024-11-19 in Unix-epoch ms, 37 ms past a step's start
# From 0: gaps under a step, one ending on a step's start (1,100 ms at 1.1x: step 20), idle steps before the last.
FROM_ZERO = [0, 40, 1_099, 1_100, 1_160, 9_000]


def write_trace(path: Path, timestamps: list[int]) -> str:
    """Requests sharing a first block (a prefix hit each) and differing in their second."""
    path.write_text("".join(
        json.dumps({"timestamp": stamp, "input_length": 600, "output_length": 3, "hash_ids": [1, 2 + index]}) + "\n"
        for index, stamp in enumerate(timestamps)
    ))
    return str(path)


@pytest.mark.parametrize("offset", [10**7 + 37, EPOCH_MS], ids=["late-start", "epoch-ms"])
@pytest.mark.parametrize(("speed", "step_of_1100_ms"), [(1.0, 22), (1.1, 20)])
def test_a_trace_arrives_as_the_same_trace_stamped_from_zero(
    tmp_path: Path, offset: int, speed: float, step_of_1100_ms: int
) -> None:
    """Before: the epoch-stamped trace was refused ("timestamp must be <= 1,000,000,000,000, got
    1,732,000,000,037") and the late one arrived from step 200,000 on."""
    plain = load_mooncake_trace(write_trace(tmp_path / "zero.jsonl", FROM_ZERO), speed=speed)
    shifted = load_mooncake_trace(
        write_trace(tmp_path / "shifted.jsonl", [offset + stamp for stamp in FROM_ZERO]), speed=speed
    )
    assert [request.arrival_step for request in shifted] == [request.arrival_step for request in plain]
    assert plain[3].arrival_step == step_of_1100_ms  # the trace's own figure, exact at 1.1x
    assert [request.timestamp_ms for request in shifted] == [offset + stamp for stamp in FROM_ZERO]  # as written


@pytest.mark.parametrize("offset", [10**7 + 37, EPOCH_MS], ids=["late-start", "epoch-ms"])
def test_a_late_trace_runs_the_steps_of_the_same_trace_from_zero(tmp_path: Path, offset: int) -> None:
    """The same run, content checked: steps, idle steps, arrival steps, the timeline and the tokens. Before, the late
    trace's run counted 200,000 idle steps before its first request (200,182 steps against 182; its JSON's
    ``first_arrival_step`` was 200,000)."""
    runs = [
        simulate(SimulatorOptions(trace=write_trace(tmp_path / f"{index}.jsonl", [shift + s for s in FROM_ZERO])))
        for index, shift in enumerate((0, offset))
    ]
    plain, shifted = runs
    assert plain.finished == shifted.finished == len(FROM_ZERO) and plain.checked_tokens > 0
    assert shifted.workload.first_arrival == 0
    assert shifted.workload.last_arrival == plain.workload.last_arrival == 9_000 // STEP_MS
    for figure in ("steps", "idle_steps", "timeline_steps", "prefill_tokens", "reused_tokens", "checked_tokens"):
        assert getattr(shifted, figure) == getattr(plain, figure), figure


def test_the_span_from_the_first_request_is_bounded_not_the_stamps(tmp_path: Path) -> None:
    """Arrival steps stay within MAX_TRACE_SPAN_MS / 50 ms at 1x wherever the trace starts; a stamp past the year
    2286 in ms is another unit (microseconds here), refused at its line."""
    longest = load_mooncake_trace(write_trace(tmp_path / "longest.jsonl", [EPOCH_MS, EPOCH_MS + MAX_TRACE_SPAN_MS]))
    assert [request.arrival_step for request in longest] == [0, MAX_TRACE_SPAN_MS // STEP_MS]
    too_long = write_trace(tmp_path / "too_long.jsonl", [EPOCH_MS, EPOCH_MS, EPOCH_MS + MAX_TRACE_SPAN_MS + 1])
    with pytest.raises(TraceFormatError, match=(
        r"too_long.jsonl:3: timestamp 2,732,000,000,038 is 1,000,000,000,001 ms after the first request's "
        r"1,732,000,000,037: a trace spans at most 1,000,000,000,000 ms \(~32 years\)$"
    )):
        load_mooncake_trace(too_long)
    micro = write_trace(tmp_path / "micro.jsonl", [EPOCH_MS * 1000])
    with pytest.raises(TraceFormatError, match=(
        r"micro.jsonl:1: timestamp must be <= 10,000,000,000,000 \(milliseconds: the year 2286 since the Unix "
        r"epoch\), got 1,732,000,000,037,000$"
    )):
        load_mooncake_trace(micro)
    assert load_mooncake_trace(write_trace(tmp_path / "last.jsonl", [MAX_TIMESTAMP_MS]))[0].arrival_step == 0
    closed = load_mooncake_trace(write_trace(tmp_path / "closed.jsonl", [EPOCH_MS, EPOCH_MS + 10**6]), closed_loop=True)
    assert [request.arrival_step for request in closed] == [0, 0]


@pytest.mark.parametrize(
    ("speed", "closed_loop", "step_ms", "clock"),
    [
        (1.0, False, 50.0, "step 0 is timestamp 1732000000037 (the first request's, in ms), each step 50 ms of trace "
         "time after it"),
        (1.1, False, 50 / 1.1, "each step 45.4545 ms of trace time after it"),
        (1.0, True, None, "step 0 is timestamp 1732000000037 (the first request's, in ms); --closed-loop: every "
         "request arrives at step 0, whatever its timestamp"),
    ],
)
def test_a_replay_says_where_its_steps_sit_in_the_traces_time(
    tmp_path: Path, speed: float, closed_loop: bool, step_ms: float | None, clock: str
) -> None:
    """The first request's timestamp as written and the step length, in the JSON and the workload table; before,
    neither showed them (``KeyError: 'trace_first_timestamp_ms'``), so steps could not be mapped back to the log."""
    trace = write_trace(tmp_path / "epoch.jsonl", [EPOCH_MS + stamp for stamp in FROM_ZERO])
    result = simulate(SimulatorOptions(trace=trace, trace_speed=speed, closed_loop=closed_loop, trace_limit=3))
    workload = result_json(result)["workload"]
    assert isinstance(workload, dict)
    assert (workload["trace_first_timestamp_ms"], workload["trace_step_ms"]) == (EPOCH_MS, step_ms)
    rows = {row[0]: row[1] for row in workload_table(result).rows}
    assert clock in rows["trace clock"], rows
    seeded = simulate(SimulatorOptions(num_requests=2))  # the seeded workload has no trace clock
    assert "trace clock" not in {row[0] for row in workload_table(seeded).rows}
    seeded_workload = result_json(seeded)["workload"]
    assert isinstance(seeded_workload, dict)
    assert (seeded_workload["trace_first_timestamp_ms"], seeded_workload["trace_step_ms"]) == (None, None)
