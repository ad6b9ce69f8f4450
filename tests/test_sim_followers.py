"""Why a replayed trace's hit rate is below its ideal: the ideal serves one request at a time on an infinite cache,
so every request sharing a prefix with an earlier prompt ("a follower") finds it; a run may admit a follower while
that earlier request still runs, or after its pages were evicted. The summary tells the two apart per follower."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

from kv_cache_manager_v2.sim.mooncake_trace import HASH_BLOCK_TOKENS, MooncakeRequest, ideal_reuse
from kv_cache_manager_v2.sim.options import SimulatorOptions
from kv_cache_manager_v2.sim.report import result_json, summary_tables
from kv_cache_manager_v2.sim.result import SimulationResult
from kv_cache_manager_v2.sim.simulator import simulate


def request(index: int, hash_ids: list[int], input_length: int | None = None) -> MooncakeRequest:
    length = len(hash_ids) * HASH_BLOCK_TOKENS if input_length is None else input_length
    return MooncakeRequest(index, 0, length, 1, array("q", hash_ids), 2**45, 0)


def test_ideal_reuse_names_the_earliest_request_holding_the_longest_prefix() -> None:
    requests = [
        request(0, [1, 2]),
        request(1, [1, 2, 3, 4]),  # shares [1, 2] with 0
        request(2, [1, 2, 3, 5]),  # shares [1, 2, 3] with 1 (and [1, 2] with 0)
        request(3, [1, 2, 3, 4]),  # shares all with 1, at most its length - 1
        request(4, [9]),
        request(5, [1, 2], input_length=HASH_BLOCK_TOKENS + 100),  # shares 100 tokens of block 2 too, reuses 611
    ]
    ideal = ideal_reuse(requests, 32)
    assert list(ideal.donor) == [-1, 0, 1, 1, -1, 0]
    assert list(ideal.reusable) == [0, 1024, 1536, 2047, 0, 611]
    assert ideal.hit_rate(requests) == sum(ideal.reusable) / sum(r.input_length for r in requests)
    whole_blocks = ideal_reuse(requests, 32, partial_reuse=False)
    assert list(whole_blocks.reusable) == [0, 1024, 1536, 2016, 0, 608]


def replay(tmp_path: Path, follower_ms: int) -> SimulationResult:
    """A 16-block prompt, then at ``follower_ms`` the same prompt with one more block."""
    path = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 16 * HASH_BLOCK_TOKENS, "output_length": 4, "hash_ids": list(range(16))},
        {"timestamp": follower_ms, "input_length": 17 * HASH_BLOCK_TOKENS, "output_length": 4,
         "hash_ids": list(range(17))},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    options = SimulatorOptions(
        preset="llama", gpu_mib=4096, host_mib=0, backend="cpu", check=False, bookkeeping=True, trace=str(path),
    )
    return simulate(options)


def summary_line(result: SimulationResult) -> str:
    rows = [row for table in summary_tables(result) for row in table.rows if row[0] == "below the ideal"]
    assert len(rows) == 1
    return str(rows[0][1])


def test_a_follower_admitted_with_its_prefix_still_computing_is_told_apart(tmp_path: Path) -> None:
    result = replay(tmp_path, follower_ms=0)  # both arrive at step 0 and are admitted together
    followers = result.followers
    assert followers is not None and result.ideal_hit_rate > 0.0
    assert (followers.requests, followers.reusable_tokens, followers.overlapping) == (1, 16 * HASH_BLOCK_TOKENS, 1)
    assert followers.overlapping_reusable == followers.reusable_tokens
    assert followers.reused_tokens == followers.overlapping_reused == result.reused_tokens == 0
    assert "admitted while that earlier request still ran: 1, reusing 0 of 8,192" in summary_line(result)
    assert result_json(result)["followers"] == followers.as_dict()


def test_a_follower_after_its_prefix_finished_reaches_the_ideal(tmp_path: Path) -> None:
    result = replay(tmp_path, follower_ms=60_000)
    followers = result.followers
    assert followers is not None and followers.overlapping == 0
    assert followers.reused_tokens == followers.reusable_tokens == result.reused_tokens == 16 * HASH_BLOCK_TOKENS
    assert result.hit_rate == result.ideal_hit_rate
    assert summary_line(result).endswith("admitted after it finished: 1, reusing 8,192 of 8,192")


def test_the_seeded_workload_has_no_follower_figures() -> None:
    result = simulate(SimulatorOptions(num_requests=4, check=False, backend="cpu"))
    assert result.followers is None and result_json(result)["followers"] is None


def test_the_synthetic_traces_followers_reach_the_ideal_on_a_large_cache() -> None:
    """The trace's hash ids, block sizes and counters agree request by request: with nothing evicted and no
    follower admitted while its prefix is computed (one request at a time), each reuses what the ideal says."""
    trace = Path(__file__).resolve().parent.parent / "traces" / "mooncake_synthetic_trace.jsonl"
    options = SimulatorOptions(
        preset="llama", gpu_mib=1 << 20, host_mib=0, tokens_per_block=128, chunk=4096, backend="cpu", check=False,
        max_batch=1, bookkeeping=True, trace=str(trace), trace_limit=100,
    )
    result = simulate(options)
    followers = result.followers
    assert followers is not None and followers.requests > 0 and followers.overlapping == 0
    assert followers.reused_tokens == followers.reusable_tokens == result.reused_tokens
    assert result.hit_rate == result.ideal_hit_rate


def test_the_readmes_trace_figures_are_what_the_simulator_gives() -> None:
    """README.md's "why below the ideal" figures for gemma (first 100 requests of the synthetic trace, 8 GiB of GPU,
    no host tier) come from this run, so a change of the batcher that moves them fails here, not in a reader's run."""
    root = Path(__file__).resolve().parent.parent
    options = SimulatorOptions(
        preset="gemma", gpu_mib=8192, host_mib=0, backend="cpu", check=False, bookkeeping=True,
        trace=str(root / "traces" / "mooncake_synthetic_trace.jsonl"), trace_limit=100,
    )
    result = simulate(options)
    followers = result.followers
    assert followers is not None
    readme = " ".join((root / "README.md").read_text(encoding="utf-8").split())
    assert f"{followers.requests} requests share {followers.reusable_tokens:,} tokens " in readme
    assert f"(the {result.ideal_hit_rate:.1%} ideal)" in readme
    after = followers.requests - followers.overlapping
    assert f"with `gemma` {followers.overlapping} and {after} ({result.hit_rate:.1%})" in readme
