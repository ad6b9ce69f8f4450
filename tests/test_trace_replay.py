"""Replaying a Mooncake-format trace: loading and token synthesis, the ideal hit rate (recomputed here on tokens,
independently of the library's hash-id computation), and the replay's hit rate against capacity and tiers.

The trace is the synthetic one of Mooncake's FAST'25 release, shipped in the repository's ``traces/`` (Apache-2.0).
Replays use its first 300 requests (3.85 M prompt tokens), the ``llama`` preset at 128 tokens per block and
bookkeeping-only mode, so each run takes seconds.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import subprocess
import sys
import tracemalloc
from array import array
from pathlib import Path

import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2.sim.mooncake_trace import (
    HASH_BLOCK_TOKENS, STEP_MS, MooncakeRequest, TraceFormatError, hash_block_hit_rate, ideal_hit_rate,
    load_mooncake_trace,
)
from kv_cache_manager_v2.sim.presets import PRESET_NAMES
from kv_cache_manager_v2.sim.options import SimulatorOptions, build_config
from kv_cache_manager_v2.sim.result import SimulationResult
from kv_cache_manager_v2.sim.simulator import simulate

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "traces" / "mooncake_synthetic_trace.jsonl"
IMPORT_ROOT = os.path.dirname(os.path.dirname(str(kv_cache_manager_v2.__file__)))
SLICE = 300
TPB = 128


def trace_path() -> str:
    return str(TRACE)


@pytest.fixture(scope="module")
def requests() -> list[MooncakeRequest]:
    return load_mooncake_trace(trace_path(), SLICE)


def replay(
    gpu_mib: int, host_mib: int = 0, disk_mib: int = 0, preset: str = "llama", trace_limit: int = SLICE
) -> SimulationResult:
    options = SimulatorOptions(
        preset=preset, gpu_mib=gpu_mib, host_mib=host_mib, disk_mib=disk_mib, tokens_per_block=TPB, max_batch=16,
        chunk=4096, backend="cpu", check=False, bookkeeping=True, trace=trace_path(), trace_limit=trace_limit,
    )
    return simulate(options)


# --------------------------------------------------------------------------------------- the independent ideal
def tokens_of(request: dict[str, object], output_base: int) -> tuple[list[int], list[int]]:
    """The test's own token synthesis: ids stand for (hash id, position); outputs are negative and unique."""
    hash_ids = request["hash_ids"]
    length = request["input_length"]
    assert isinstance(hash_ids, list) and isinstance(length, int)
    prompt = [hash_ids[position // HASH_BLOCK_TOKENS] * HASH_BLOCK_TOKENS + position % HASH_BLOCK_TOKENS
              for position in range(length)]
    output_length = request["output_length"]
    assert isinstance(output_length, int)
    return prompt, [-(output_base + i) for i in range(1, output_length + 1)]


def reference_ideal(lines: list[dict[str, object]], tpb: int, partial_reuse: bool) -> float:
    """An infinite radix tree of ``tpb``-token blocks fed request by request with every computed token (the last
    block may be short), matched the way the manager matches a prompt: its first ``prompt_length - 1`` tokens,
    full blocks, then the longest common start of one cached child block, full or short."""
    children: dict[int, dict[tuple[int, ...], int]] = {0: {}}
    reused = 0
    prompt_tokens = 0
    output_base = 0
    for line in lines:
        prompt, output = tokens_of(line, output_base)
        output_base += len(output)
        prompt_tokens += len(prompt)
        query = prompt[:-1]
        node = 0
        matched = 0
        while matched + tpb <= len(query):
            child = children[node].get(tuple(query[matched : matched + tpb]))
            if child is None:
                break
            node = child
            matched += tpb
        if partial_reuse:
            rest = query[matched : matched + tpb]
            best = 0
            for block in children[node]:
                common = 0
                while common < len(rest) and block[common] == rest[common]:
                    common += 1
                best = max(best, common)
            matched += best
        reused += matched
        computed = prompt + output[:-1]
        node = 0
        for start in range(0, len(computed), tpb):
            key = tuple(computed[start : start + tpb])
            child = children[node].get(key)
            if child is None:
                child = len(children)
                children[child] = {}
                children[node][key] = child
            node = child
    return reused / prompt_tokens


@pytest.fixture(scope="module")
def lines() -> list[dict[str, object]]:
    with open(trace_path(), encoding="utf-8") as trace:
        return [json.loads(next(trace)) for _ in range(SLICE)]


@pytest.mark.parametrize(("tpb", "partial_reuse"), [(TPB, True), (32, True), (32, False)])
def test_ideal_hit_rate_matches_a_token_level_radix_tree(
    requests: list[MooncakeRequest], lines: list[dict[str, object]], tpb: int, partial_reuse: bool
) -> None:
    expected = reference_ideal(lines, tpb, partial_reuse)
    assert 0.04 < expected < 0.06  # the slice's reuse: mostly early turns of conversations
    assert ideal_hit_rate(requests, tpb, partial_reuse) == pytest.approx(expected, rel=1e-12)


def test_the_readme_figure_is_the_share_of_hash_blocks_seen_before() -> None:
    full = load_mooncake_trace(trace_path())
    assert len(full) == 3993
    assert hash_block_hit_rate(full) == pytest.approx(0.640, abs=0.0005)  # the trace README's 64.0%
    # Weighing blocks by their tokens (short last blocks count less) and the manager's rules give a little more.
    assert ideal_hit_rate(full, 32) == pytest.approx(0.6512, abs=0.0005)


# ------------------------------------------------------------------------------------------- the loader
def test_tokens_come_from_hash_ids_and_outputs_are_unique(requests: list[MooncakeRequest]) -> None:
    seen_blocks: dict[int, list[int]] = {}
    prompt_tokens: set[int] = set()
    output_tokens: set[int] = set()
    for request in requests:
        tokens = request.token_ids()
        assert len(tokens) == request.prompt_length + request.output_length
        prompt, output = tokens[: request.prompt_length], tokens[request.prompt_length :]
        for position, hash_id in enumerate(request.hash_ids):
            block = prompt[position * HASH_BLOCK_TOKENS : (position + 1) * HASH_BLOCK_TOKENS]
            known = seen_blocks.setdefault(hash_id, block)
            shorter = min(len(known), len(block))
            assert known[:shorter] == block[:shorter]  # equal hash ids: equal tokens (the last block cut short)
        prompt_tokens.update(prompt)
        assert output_tokens.isdisjoint(output) and len(set(output)) == len(output)
        output_tokens.update(output)
    assert prompt_tokens.isdisjoint(output_tokens)
    # Different hash ids differ at every position.
    first, second = requests[0].token_ids()[:HASH_BLOCK_TOKENS], requests[1].token_ids()[:HASH_BLOCK_TOKENS]
    assert requests[0].hash_ids[0] != requests[1].hash_ids[0]
    assert all(a != b for a, b in zip(first, second))


def test_arrival_steps_follow_timestamps_speed_and_closed_loop(requests: list[MooncakeRequest]) -> None:
    assert [request.arrival_step for request in requests] == [
        int(request.timestamp_ms / STEP_MS) for request in requests
    ]
    faster = load_mooncake_trace(trace_path(), SLICE, speed=4.0)
    assert [request.arrival_step for request in faster] == [
        int(request.timestamp_ms / (4 * STEP_MS)) for request in requests
    ]
    assert requests[-1].arrival_step > faster[-1].arrival_step > 0
    closed = load_mooncake_trace(trace_path(), 5, closed_loop=True)
    assert [request.arrival_step for request in closed] == [0] * 5


@pytest.mark.parametrize(("speed", "timestamps", "steps"), [
    (1.1, [4839, 4840, 4895], [87, 88, 89]), (2.2, [9679, 9680], [87, 88]), (0.3, [14, 15], [0, 1]),
    (1e-6, [1, 3], [20_000, 60_000])])
def test_arrival_steps_are_exact_at_step_starts(
    tmp_path: Path, speed: float, timestamps: list[int], steps: list[int]
) -> None:
    """floor(timestamp / speed / 50 ms) for the decimal speed typed: float division put a request arriving on a
    step's start (4,840 ms at 1.1x: step 88) into the step before (80 of the synthetic trace's at 1.1x)."""
    path = tmp_path / "boundary.jsonl"
    line = '{"timestamp": %d, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
    path.write_text("".join(line % timestamp for timestamp in [0, *timestamps]))  # steps count from the first
    assert [request.arrival_step for request in load_mooncake_trace(str(path), speed=speed)] == [0, *steps]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        # A missing field read "input_length must be an integer, got None", as a JSON null would.
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [0]}', "no input_length .a Mooncake trace line holds "
         "timestamp, input_length, output_length, hash_ids."),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "no hash_ids"),
        ('{"timestamp": 0, "input_length": null, "output_length": 1, "hash_ids": [0]}',
         "input_length must be an integer, got None"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length must be >= 1"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": [0]}', "output_length must be >= 1"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}', "timestamp must be >= 0"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}', "needs 2 hash ids"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]}', "hash_ids must hold"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "0"}', "hash_ids must be a list"),
        # Sizes past every sane bound, each named with its field (not a traceback, not a blame on --gpu-mib).
        pytest.param('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [%s]}' % ("7" * 5000),
                     "hash_ids must hold integers in .* got a 5000-digit integer", id="5000-digit-hash-id"),
        pytest.param('{"timestamp": %s, "input_length": 10, "output_length": 1, "hash_ids": [0]}' % ("9" * 400),
                     "timestamp must be <= 10,000,000,000,000 .*got a 400-digit integer", id="400-digit-timestamp"),
        ('{"timestamp": 0, "input_length": %s, "output_length": 1, "hash_ids": [0]}' % ("-" + "9" * 30),
         "input_length must be >= 1, got a 30-digit negative integer"),
        ('{"timestamp": 0, "input_length": 10, "output_length": %d, "hash_ids": [0]}' % 10**18,
         "output_length must be <= 16,777,216"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [%d]}' % (2**40 + 1),
         "hash_ids must hold integers in"),
        pytest.param('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": %s0%s}'
                     % ("[" * 100_000, "]" * 100_000), "hash_ids is nested too deeply", id="deeply-nested"),
        ('{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
         '{"timestamp": 4, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "before the previous"),
        ("", "no requests"),
        # json.loads kept the last of two values silently (other readers keep the first): the run used timestamp 5.
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0], "timestamp": 5}',
         ": the key 'timestamp' appears twice in one object .which value counts is ambiguous.$"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0], "x": {"a": 1, "a": 2}}',
         ": the key 'a' appears twice in one object"),
    ],
)
def test_malformed_traces_are_refused_naming_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceFormatError, match=message) as error:
        load_mooncake_trace(str(path))
    if line:
        assert f"{path}:" in str(error.value)


GOOD_LINE = b'{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'


@pytest.mark.parametrize(
    ("content", "message"),
    [
        # A non-UTF-8 line was a bare UnicodeDecodeError naming neither the file nor the line.
        (GOOD_LINE + b'{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0], "x": "\xff"}\n',
         r":2: not UTF-8 \(byte 0xff at column 81\)"),
        # A BOM is not silently dropped either; it was "Unexpected UTF-8 BOM (decode using utf-8-sig)".
        (b"\xef\xbb\xbf" + GOOD_LINE, r":1: not JSON \(a byte order mark at column 1: save the file as UTF-8 without"),
        # A partly written last line: "not JSON (Unterminated string starting at)", at no column.
        (GOOD_LINE + b'{"timestamp": 0, "input_len', r":2: not JSON \(Unterminated string starting at column 18\)"),
        # A compressed trace was "not UTF-8 (byte 0x8b at column 2)".
        (gzip.compress(GOOD_LINE), r": gzip-compressed: decompress it first \(gunzip "),
        (bz2.compress(GOOD_LINE), r": bzip2-compressed: decompress it first \(bunzip2 "),
        (lzma.compress(GOOD_LINE), r": xz-compressed: decompress it first \(unxz "),
    ],
    ids=["non-utf8", "bom", "partial-last-line", "gzip", "bzip2", "xz"],
)
def test_malformed_bytes_are_refused_naming_the_line(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=f"{path}{message}"):
        load_mooncake_trace(str(path))


def test_what_the_loader_tolerates_loads_as_the_plain_trace(tmp_path: Path) -> None:
    """README's list: blank lines, CRLF, extra keys, equal timestamps, repeated and unordered hash ids."""
    plain = ['{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [7, 7]}',
             '{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [7, 3, 7]}']
    tolerant = [plain[0][:-1] + ', "session": "a", "extra": [1, {"x": null}]}', "   ", "", plain[1]]
    (tmp_path / "plain.jsonl").write_text("\n".join(plain) + "\n")
    (tmp_path / "tolerant.jsonl").write_bytes(("\r\n".join(tolerant) + "\r\n").encode())
    expected, loaded = (load_mooncake_trace(str(tmp_path / name)) for name in ("plain.jsonl", "tolerant.jsonl"))
    assert [repr(request) for request in loaded] == [repr(request) for request in expected]
    assert [request.token_ids() for request in loaded] == [request.token_ids() for request in expected]
    # The second prompt shares 512 tokens, then ids 3 and 7 differ: the repeated id 7 further on is no prefix.
    assert ideal_hit_rate(loaded, 32) == 512 / 1700


def test_bad_loader_arguments() -> None:
    with pytest.raises(ValueError, match="limit"):
        load_mooncake_trace(trace_path(), 0)
    with pytest.raises(ValueError, match="speed"):
        load_mooncake_trace(trace_path(), 1, speed=0.0)
    with pytest.raises(ValueError, match="trace_limit"):
        SimulatorOptions(trace=trace_path(), trace_limit=0, check=False)
    with pytest.raises(ValueError, match="need a trace"):
        SimulatorOptions(trace_limit=3)
    with pytest.raises(ValueError, match="content checks"):
        SimulatorOptions(bookkeeping=True)


def test_trace_speed_is_bounded_both_ways(tmp_path: Path) -> None:
    path = tmp_path / "late.jsonl"
    path.write_text("".join('{"timestamp": %d, "input_length": 4, "output_length": 1, "hash_ids": [0]}\n' % t for t in (0, 1000)))
    with pytest.raises(ValueError, match="speed must be between"):
        load_mooncake_trace(str(path), speed=1e-320)  # the timestamp over it was inf: an OverflowError
    assert load_mooncake_trace(str(path), speed=1e-6)[1].arrival_step == 20_000_000  # 1000 ms after the first
    with pytest.raises(ValueError, match="trace_speed must be between"):
        SimulatorOptions(trace=str(path), trace_speed=1e7, check=False)


# ------------------------------------------------------------------------------------------- the replays
def test_bookkeeping_mode_plans_the_same_slots_as_the_real_sizes() -> None:
    from kv_cache_manager_v2._manager.manager import KVCacheManager

    for preset in PRESET_NAMES:
        real = SimulatorOptions(preset=preset, gpu_mib=2048, host_mib=1024, backend="cpu", check=False)
        tiny = SimulatorOptions(preset=preset, gpu_mib=2048, host_mib=1024, backend="cpu", check=False,
                                bookkeeping=True)
        slots = []
        for options in (real, tiny):
            manager = KVCacheManager(build_config(options, None, [4096]))
            slots.append([[stat.total for stat in manager.get_storage_statistics(level)] for level in range(2)])
            manager.shutdown()
        assert slots[0] == slots[1], preset
        assert min(slots[0][0]) > 0


def test_a_large_cache_reaches_the_ideal(requests: list[MooncakeRequest], lines: list[dict[str, object]]) -> None:
    result = replay(gpu_mib=1 << 20)
    assert result.finished == SLICE and result.rejected == 0 and result.preemptions == 0
    assert result.ideal_hit_rate == pytest.approx(reference_ideal(lines, TPB, True), rel=1e-12)
    assert result.hit_rate == pytest.approx(result.ideal_hit_rate, rel=1e-12)
    assert result.prompt_tokens == sum(request.prompt_length for request in requests)
    assert result.reused_tokens_by_tier == [result.reused_tokens]  # a GPU-only run: every hit from the GPU
    assert result.hash_block_hit_rate == pytest.approx(hash_block_hit_rate(requests))
    assert result.manager_us_per_request_step > 0


def test_a_small_cache_hits_less_and_a_host_tier_wins_hits_back() -> None:
    small = replay(gpu_mib=32 << 10)
    with_host = replay(gpu_mib=32 << 10, host_mib=64 << 10)
    assert small.rejected == 0 and with_host.rejected == 0
    assert 0.0 < small.hit_rate < with_host.hit_rate < with_host.ideal_hit_rate
    assert small.reused_tokens_by_tier == [small.reused_tokens]
    gpu_tokens, host_tokens = with_host.reused_tokens_by_tier
    assert host_tokens > 0 and gpu_tokens + host_tokens == with_host.reused_tokens
    (group,) = with_host.layer_groups
    assert sum(group.reused_pages_by_tier) == group.reused_pages and group.reused_pages_by_tier[1] > 0
    assert host_tokens <= group.reused_pages_by_tier[1] * TPB
    assert with_host.offloaded_pages > 0 and with_host.onboarded_pages >= group.reused_pages_by_tier[1]


def test_a_disk_tier_behind_a_small_host_tier_serves_hits_too() -> None:
    """With host and disk, KV events tell the two apart: some reused pages come back from each."""
    result = replay(gpu_mib=24000, host_mib=8 << 10, disk_mib=64 << 10)
    assert result.rejected == 0
    gpu_tokens, host_tokens, disk_tokens = result.reused_tokens_by_tier
    assert host_tokens > 0 and disk_tokens > 0 and gpu_tokens + host_tokens + disk_tokens == result.reused_tokens
    (group,) = result.layer_groups
    assert sum(group.reused_pages_by_tier) == group.reused_pages


@pytest.mark.parametrize("preset", ["gemma", "hybrid-ssm"])
def test_other_presets_replay_the_trace(preset: str) -> None:
    result = replay(gpu_mib=1 << 20, host_mib=1 << 10, preset=preset, trace_limit=120)
    assert result.finished == 120 and result.rejected == 0
    assert 0.0 < result.hit_rate <= result.ideal_hit_rate
    kinds = sorted(group.kind for group in result.layer_groups)
    assert kinds == sorted({"gemma": ["swa", "full"], "hybrid-ssm": ["ssm", "full"]}[preset])


# ------------------------------------------------------------------------------------------------ the CLI
def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = IMPORT_ROOT
    return subprocess.run(
        [sys.executable, "-m", "kv_cache_manager_v2", "simulate", *args],
        capture_output=True, text=True, env=env, cwd=IMPORT_ROOT, timeout=600,
    )


def test_cli_replays_a_trace_to_json() -> None:
    result = cli("--preset", "llama", "--trace", trace_path(), "--trace-limit", "60", "--bookkeeping",
                 "--tokens-per-block", str(TPB), "--chunk", "4096", "--gpu-mib", "65536", "--host-mib", "0", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["requests"] == 60 and report["finished"] == 60
    assert report["prefix_hit_rate"] == pytest.approx(report["ideal_hit_rate"]) and report["ideal_hit_rate"] > 0
    assert 0.0 < report["hash_block_hit_rate"] < 1.0
    assert report["reused_tokens_by_tier"] == {"GPU": report["reused_tokens"]}
    assert report["options"]["trace_limit"] == 60 and report["options"]["bookkeeping"] is True
    assert report["checked_tokens"] == 0 and report["compiled"] is kv_cache_manager_v2.COMPILED


def test_cli_sweeps_gpu_capacity_with_and_without_a_host_tier(tmp_path: Path) -> None:
    plot = tmp_path / "sweep.png"
    common = ["--preset", "llama", "--trace", trace_path(), "--trace-limit", "120", "--bookkeeping",
              "--tokens-per-block", str(TPB), "--chunk", "4096", "--host-mib", "65536"]
    result = cli(*common, "--sweep-gpu-mib", "24000,65536", "--json", "--plot", str(plot))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    points = report["points"]
    assert [(p["options"]["gpu_mib"], p["options"]["host_mib"]) for p in points] == [
        (24000, 0), (24000, 65536), (65536, 0), (65536, 65536)
    ]
    assert all(p["ideal_hit_rate"] == report["ideal_hit_rate"] for p in points)
    assert points[0]["prefix_hit_rate"] <= points[1]["prefix_hit_rate"]
    assert points[0]["prefix_hit_rate"] <= points[2]["prefix_hit_rate"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = cli(*common, "--sweep-gpu-mib", "65536", "--plain")
    assert table.returncode == 0, table.stderr[-3000:]
    assert "hit rate against capacity" in table.stdout and "µs/request-step" in table.stdout
    assert "GPU 65,536 MiB, host 65,536 MiB" in table.stderr  # one progress label per run


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace-limit", "5"], "--trace-limit needs --trace"),
        (["--closed-loop"], "--closed-loop needs --trace"),
        (["--trace", "TRACE", "--requests", "5"], "--trace-limit"),
        # The seeded workload's flags were ignored without a word with --trace (the run replayed the trace as is).
        (["--trace", "TRACE", "--seed", "5", "--user-len", "5,6"], "--seed, --user-len shape the seeded workload"),
        (["--trace", "TRACE", "--arrival-rate", "inf"], "--arrival-rate shapes the seeded workload"),
        (["--trace", "TRACE", "--sweep", "seed=1,2"], "--sweep seed=1,2: --seed shapes the seeded workload"),
        (["--trace", "TRACE", "--closed-loop", "--trace-speed", "2"], "drop --trace-speed"),
        (["--trace", "TRACE", "--trace-limit", "0"], "--trace-limit must be >= 1"),
        (["--trace", "TRACE", "--trace-speed", "0"], "--trace-speed must be a finite number > 0"),
        (["--trace", "BAD", "--trace-speed", "1e-320"], "--trace-speed must be between 1e-06 and 1e+06"),
        (["--trace", "BAD", "--trace-speed", "1e300"], "--trace-speed must be between 1e-06 and 1e+06"),
        (["--trace", "HUGE"], "HUGE.jsonl:1: hash_ids must hold integers in [0, 2**40], got a 5000-digit integer"),
        (["--trace", "NESTED"], "NESTED.jsonl:1: hash_ids is nested too deeply"),
        (["--trace", "LONG"], "LONG.jsonl:1: output_length must be <= 16,777,216"),
        (["--trace", "MISSING"], "no such file"),
        (["--trace", "BAD"], "BAD.jsonl:2: input_length must be >= 1"),
        # The run's report replaced the trace it replayed (exit 0, the trace gone).
        (["--trace", "COPY", "--json", "COPY"], "result.json: that is the --trace file, which the run would overwrite"),
        (["--trace", "COPY", "--output-dir", "DIR"], "result.json: that is the --trace file"),
        (["--trace", "TRACE", "--sweep-gpu-mib", "1,x"], "comma-separated"),
        (["--trace", "TRACE", "--sweep-gpu-mib", "0"], ">= 1"),
        (["--trace", "TRACE", "--sweep-gpu-mib", "1024", "--host-mib", "0"], "give --host-mib > 0"),
    ],
)
def test_cli_trace_flag_errors(tmp_path: Path, args: list[str], message: str) -> None:
    bad = tmp_path / "BAD.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}\n'
                   '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}\n')
    names = {"MISSING": str(tmp_path / "missing.jsonl"), "BAD": str(bad), "COPY": str(tmp_path / "result.json"),
             "DIR": str(tmp_path)}
    Path(names["COPY"]).write_text('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [0]}\n')
    if "TRACE" in args:
        names["TRACE"] = trace_path()
    for name, hash_ids, output_length in (("HUGE", "[%s]" % ("7" * 5000), 1),
                                          ("NESTED", "%s0%s" % ("[" * 100_000, "]" * 100_000), 1),
                                          ("LONG", "[0]", 10**18)):
        names[name] = str(tmp_path / f"{name}.jsonl")
        Path(names[name]).write_text('{"timestamp": 0, "input_length": 4, "output_length": %d, "hash_ids": %s}\n'
                                     % (output_length, hash_ids))
    result = cli("--bookkeeping", *[names.get(arg, arg) for arg in args])
    assert result.returncode == 2, result.stdout[-2000:]
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert Path(names["COPY"]).read_text().startswith('{"timestamp": 0,')  # the trace is still there


def test_the_ideal_holds_a_long_trace_in_little_memory_per_distinct_block() -> None:
    """An infinite cache's ideal must remember every distinct block seen, so its memory grows with a long trace's
    length: keep that growth small (a flat trie; an object and a dict per node took ~3x as much, a 200k-request
    trace's ideal 650 MB)."""
    blocks_per_request, num_requests = 8, 2_000
    requests = [
        MooncakeRequest(
            index, index, blocks_per_request * HASH_BLOCK_TOKENS, 1,
            array("q", range(index * blocks_per_request, (index + 1) * blocks_per_request)), 2**50, 0,
        )
        for index in range(num_requests)
    ]
    tracemalloc.start()
    try:
        assert ideal_hit_rate(requests, 32) == 0.0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_block = peak / (blocks_per_request * num_requests)
    assert per_block < 160, f"{per_block:.0f} bytes per distinct block"


def test_a_loaded_trace_holds_its_hash_ids_in_8_bytes_each(tmp_path: Path) -> None:
    """The requests stay loaded for the whole run: with ``hash_ids`` as lists of ints and a ``__dict__`` per request
    a 200k-request trace held 330 MB ("1383 bytes per request beyond 8 per hash id" here), now ~380 bytes."""
    num_requests, ids = 2_000, 32
    path = tmp_path / "trace.jsonl"
    with path.open("w") as lines:
        for index in range(num_requests):
            first = 10**6 + index * ids  # ids above the small ints CPython shares
            line = {"timestamp": 10**6 + index, "input_length": ids * HASH_BLOCK_TOKENS, "output_length": 300,
                    "hash_ids": list(range(first, first + ids))}
            lines.write(json.dumps(line) + "\n")
    tracemalloc.start()
    try:
        requests = load_mooncake_trace(str(path))
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(requests) == num_requests and list(requests[-1].hash_ids) == list(range(first, first + ids))
    overhead = held / num_requests - 8 * ids
    assert overhead < 512, f"{overhead:.0f} bytes per request beyond 8 per hash id"
