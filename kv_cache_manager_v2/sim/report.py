"""What the simulator shows: the planned layout, the end-of-run tables and one JSON object; for a sweep, one
table row and JSON object per run.

The tables are ``cli/tables.py``'s (rich when the optional ``cli`` extra is installed, else aligned plain text);
the plots are ``plot.py``.
"""

from __future__ import annotations

from typing import Final, Sequence

from .. import KVCacheManager
from ..cli.tables import Table
from .result import Distribution, FollowerReuse, SimulationResult

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


# ------------------------------------------------------------------------------------------------ figures
POOL_GROUP_MEANING = (
    "a pool group = the layers whose pages have the same size, sharing one set of slots; a slot = room for one "
    "page: one block of tokens for every layer of its pool group"
)


def plural(count: int, word: str, plural_word: str | None = None) -> str:
    """``1 slot``, ``2 slots`` (thousands separated)."""
    return f"{count:,} {word if count == 1 else (plural_word or word + 's')}"


def tier_name(level: int) -> str:
    """The words for a cache level: the manager's levels 0, 1, 2 are the GPU, host and disk tiers here."""
    return ("GPU", "host", "disk")[level] if level < 3 else f"tier {level}"


def describe_layout(manager: KVCacheManager) -> list[str]:
    """Human-readable lines: layer groups, pool groups and slot counts per tier."""
    lines: list[str] = [f"backend: {manager.backend}, tokens per block: {manager.tokens_per_block}"]
    for group_id, layers in enumerate(manager.layer_grouping):
        pool_group = manager.get_pool_group_index(group_id)
        lines.append(f"layer group {group_id}: {plural(len(layers), 'layer')} -> pool group {pool_group}")
    for level in range(manager.num_cache_levels):
        stats = manager.get_storage_statistics(level)
        for pool_group, stat in enumerate(stats):
            slot_bytes = manager.get_slot_bytes(pool_group)
            # In KiB only when exact: a small model's or --bookkeeping's 512-byte slots read "0 KiB".
            unit, unit_name = (KIB, "KiB") if all(size % KIB == 0 for size in slot_bytes) else (1, "bytes")
            lines.append(
                f"{tier_name(level)} tier, pool group {pool_group}: {plural(stat.total, 'slot')} of "
                f"{sum(slot_bytes) // unit:,} {unit_name} (pools of {[size // unit for size in slot_bytes]} {unit_name})"
            )
    lines.append(f"({POOL_GROUP_MEANING})")
    return lines


def _size(num_bytes: int) -> str:
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.1f} GiB"
    if num_bytes >= MIB:
        return f"{num_bytes / MIB:.1f} MiB"
    return f"{num_bytes / KIB:.1f} KiB"


def _percent(value: float) -> str:
    return f"{100.0 * value:.1f}%"


def _scratch_line(result: SimulationResult) -> str:
    if not result.options.scratch:
        return "off (--scratch turns it on)"
    parts: list[str] = []
    for pool in result.pool_groups:
        if pool.peak_without_scratch > pool.peak_in_use:
            saved = pool.peak_without_scratch - pool.peak_in_use
            parts.append(
                f"pool group {pool.pool_group}: peak {plural(pool.peak_in_use, 'slot')} vs "
                f"{pool.peak_without_scratch:,} without scratch (-{saved:,}, {_percent(saved / pool.peak_without_scratch)})"
            )
    return "; ".join(parts) if parts else "none (no prefill chunk reached past a window)"


IDEAL_WITHOUT_SNAPSHOTS: Final = "SSM snapshot positions ignored"


def ideal_label(result: SimulationResult) -> str:
    """The ideal's name in a plot's legend."""
    if result.ideal_ignores_ssm_snapshots:
        return f"ideal (infinite cache, {IDEAL_WITHOUT_SNAPSHOTS})"
    return "ideal (infinite cache)"


def _ideal_line(result: SimulationResult) -> str:
    line = f"{_percent(result.hit_rate)} (ideal for this workload {_percent(result.ideal_hit_rate)}"
    if result.rejected:
        line += f" over served requests, {_percent(result.ideal_hit_rate_all_requests)} over all requests"
    if result.ideal_ignores_ssm_snapshots:
        line += f", whole blocks: {IDEAL_WITHOUT_SNAPSHOTS}"
    if result.hash_block_hit_rate is not None:
        line += f"; the trace's own 512-token block figure {_percent(result.hash_block_hit_rate)}"
    return line + ")"


def _followers_line(followers: FollowerReuse, ssm: bool) -> str:
    """Where a trace's reusable prefixes went: the ideal serves one request at a time on an infinite cache, a run
    admits followers while their earlier request still runs and evicts what it has no room for."""
    if not followers.requests:
        return "no served request shares a prefix with an earlier prompt"
    later_reusable = followers.reusable_tokens - followers.overlapping_reusable
    later_reused = followers.reused_tokens - followers.overlapping_reused
    lost = f" (the rest evicted before they came{', or past their last SSM snapshot' if ssm else ''})"
    return (
        f"{plural(followers.requests, 'request')} sharing a prefix with an earlier prompt reused "
        f"{followers.reused_tokens:,} of the ideal's {followers.reusable_tokens:,} tokens; admitted while that earlier "
        f"request still ran: {followers.overlapping:,}, reusing {followers.overlapping_reused:,} of "
        f"{followers.overlapping_reusable:,} (what it had committed); admitted after it finished: "
        f"{followers.requests - followers.overlapping:,}, reusing {later_reused:,} of {later_reusable:,}"
        f"{lost if later_reused < later_reusable else ''}"
    )


def _tier_line(result: SimulationResult) -> str:
    """Reused tokens per tier they were found on, as shares of the prompt tokens."""
    parts = [
        f"{name} {_percent(tokens / result.prompt_tokens if result.prompt_tokens else 0.0)} ({tokens:,})"
        for name, tokens in zip(result.options.tier_names, result.reused_tokens_by_tier)
    ]
    return ", ".join(parts)


def _lengths(distribution: Distribution) -> str:
    return (
        f"{distribution.min:,} / {distribution.median:,} / {distribution.p90:,} / {distribution.max:,} "
        f"(mean {distribution.mean:,.0f})"
    )


def _trace_clock(first_timestamp_ms: int, step_ms: float | None) -> str:
    """Where the steps sit in the trace's time: its stamps as written, so that a step finds its log lines."""
    start = f"step 0 is timestamp {first_timestamp_ms} (the first request's, in ms)"
    if step_ms is None:
        return start + "; --closed-loop: every request arrives at step 0, whatever its timestamp"
    return start + f", each step {step_ms:.6g} ms of trace time after it"


def workload_table(result: SimulationResult) -> Table:
    """What was served: request count, length distributions, chats and turns, shared prefixes, arrivals."""
    summary = result.workload
    options = result.options
    if options.trace is None:
        source = "seeded multi-turn chats (--seed " + str(options.seed) + ")"
        shared = (
            f"{plural(summary.shared_prefixes, 'shared system prompt')} "
            f"({options.system_prompt_length[0]:,}-{options.system_prompt_length[1]:,} tokens), opening "
            f"{summary.with_shared_prefix:,} of {plural(summary.num_requests, 'request')}"
        )
    else:
        source = f"trace {options.trace}"
        shared = "from the trace's hash ids (see the ideal hit rate)"
    if summary.last_arrival == summary.first_arrival:
        arrivals = f"all at step {summary.first_arrival:,}"
    else:
        arrivals = (
            f"steps {summary.first_arrival:,} to {summary.last_arrival:,}, "
            f"{summary.arrival_rate:.3g} requests per step on average"
        )
    rows = [
        ["source", source + (", bookkeeping only" if options.bookkeeping else "")],
        ["model", options.model_name],
        ["requests", f"{summary.num_requests:,} in {plural(summary.num_chats, 'chat')}, up to "
                     f"{plural(summary.max_turns, 'turn')} each"],
        ["prompt tokens", _lengths(summary.prompt_length)],
        ["output tokens", _lengths(summary.output_length)],
        ["shared prefixes", shared],
        ["arrivals", arrivals],
    ]
    if summary.first_timestamp_ms is not None:
        rows.append(["trace clock", _trace_clock(summary.first_timestamp_ms, summary.step_ms)])
    note = (
        "lengths: min / median / 90th percentile / max, by nearest rank: each is one of the lengths, the median of "
        "an even count the lower middle one"
    )
    return Table("workload", ["", ""], rows, note)


def _manager_time_line(result: SimulationResult) -> str:
    return (
        f"{result.manager_ns / 1e9:.2f} s: bookkeeping {result.bookkeeping_ns / 1e9:.2f} s, page copies "
        f"{result.manager_copy_ns / 1e9:.2f} s; {result.manager_us_per_step:,.0f} µs/busy step, "
        f"{result.manager_us_per_request_step:,.0f} µs/request-step"
    )


def _no_reuse_line(result: SimulationResult) -> str:
    base = result.no_reuse
    assert base is not None
    saved = base.computed_tokens - result.computed_tokens
    share = saved / base.computed_tokens if base.computed_tokens else 0.0
    return (
        f"{base.computed_tokens:,} computed tokens in {plural(base.steps, 'step')}, manager "
        f"{base.manager_ns / 1e9:.2f} s: caching saved {saved:,} tokens ({_percent(share)}) and "
        f"{plural(base.steps - result.steps, 'step')} (its finished pages still move to colder tiers under "
        f"scopes nobody matches: compare tokens, steps and time, not pages moved)"
    )


def summary_tables(result: SimulationResult) -> list[Table]:
    """The end-of-run report: the workload, a summary, then one row per layer group and per pool group."""
    mode = "compiled" if result.compiled else "interpreted"
    busy = result.steps - result.idle_steps
    followers = result.followers
    below_ideal = [] if followers is None else [
        ["below the ideal", _followers_line(followers, result.ideal_ignores_ssm_snapshots)]
    ]
    summary = [
        ["requests", f"{result.num_requests:,} ({result.finished:,} finished, {result.rejected:,} rejected)"],
        ["steps", f"{result.steps:,} ({busy:,} busy, {result.idle_steps:,} idle; "
                  f"{result.request_steps:,} request-steps)"],
        ["prompt tokens", f"{result.prompt_tokens:,} of served requests ({result.reused_tokens:,} reused at first admission)"],
        ["computed tokens", f"{result.computed_tokens:,} ({result.prefill_tokens:,} prefill, "
                            f"{result.decode_tokens:,} decode; recomputation included)"],
        ["generated tokens", f"{result.generated_tokens:,}"],
        ["prefix hit rate", _ideal_line(result)],
        *below_ideal,
        ["hit rate per tier", _tier_line(result)],
        ["preemptions", f"{result.preemptions:,} ({result.resumes:,} resumed after suspension, {result.recomputes:,} recomputed)"],
        ["offloaded pages", f"{result.offloaded_pages:,} ({_size(result.offloaded_bytes)})"],
        ["onboarded pages", f"{result.onboarded_pages:,} ({_size(result.onboarded_bytes)}; "
                            f"{result.prefetched_pages:,} prefetched a step before their request resumed)"],
        ["copied / dropped pages", f"{result.copied_pages:,} / {result.dropped_pages:,} (copies: copy-on-write, SSM "
                                   f"snapshots; dropped: cached pages evicted out of the cache, their reuse lost)"],
        ["scratch savings", _scratch_line(result)],
        ["manager time", _manager_time_line(result)],
        ["content checks", f"{result.checked_tokens:,} token records verified" if result.options.check else "off"],
        ["wall time", f"{result.wall_s:.1f} s"],
    ]
    if result.no_reuse is not None:
        summary.insert(6, ["without prefix reuse", _no_reuse_line(result)])
    groups = [
        [
            str(group.group_id),
            _kind(group.kind, group.window),
            str(group.num_layers),
            str(group.pool_group),
            _percent(group.reused_tokens / result.prompt_tokens if result.prompt_tokens else 0.0),
            f"{group.reused_tokens:,}",
            f"{group.reused_pages:,}",
            " / ".join(f"{pages:,}" for pages in group.reused_pages_by_tier),
        ]
        for group in result.layer_groups
    ]
    pools = [
        [
            str(pool.pool_group),
            _size(pool.slot_bytes),
            f"{pool.gpu_slots:,}",
            f"{pool.peak_in_use:,}",
            f"{pool.peak_occupied:,}",
            f"{pool.peak_without_scratch:,}" if result.options.scratch else "-",
        ]
        for pool in result.pool_groups
    ]
    title = f"simulate: {result.options.model_name}, backend {result.backend}, {mode}"
    return [
        workload_table(result),
        Table(
            title,
            ["", ""],
            summary,
            "manager time: wall-clock time inside the manager's calls, not CPU time (on a busy machine it includes "
            "waiting for a core); page copies = time inside the page copies (on the cpu backend real memory "
            "copies, on cuda their launches); bookkeeping = the rest",
        ),
        Table(
            "prefix reuse per layer group",
            ["group", "kind", "layers", "pool group", "hit rate", "reused tokens", "reused pages",
             "found on " + " / ".join(result.options.tier_names)],
            groups,
            "hit rate = reused / prompt tokens of served (not rejected) requests, each counted at its first "
            "admission; reused pages = cached pages the group got back (SSM: snapshots), by the tier they were found "
            "on (copies count as GPU)",
        ),
        Table(
            "GPU slots per pool group",
            ["pool group", "slot size", "slots", "peak in use", "peak occupied", "w/o scratch"],
            pools,
            f"{POOL_GROUP_MEANING}; peaks per step, after the resizes and before the commits; in use = locked by "
            "running requests; occupied also counts cached pages; w/o scratch = what the same steps would need "
            "without scratch",
        ),
    ]


def _kind(kind: str, window: int) -> str:
    if kind == "swa":
        return f"SWA {window:,}"
    return "SSM" if kind == "ssm" else "full"


def result_json(result: SimulationResult, timeline: bool = True) -> dict[str, object]:
    """Every figure of the tables, machine-readable (``--json``), and the per-step timeline the plot draws."""
    report: dict[str, object] = {
        "preset": result.options.preset,
        "model": result.options.model_name,
        "backend": result.backend,
        "compiled": result.compiled,
        "options": result.options.as_dict(),
        "workload": result.workload.as_dict(),
        "requests": result.num_requests,
        "finished": result.finished,
        "rejected": result.rejected,
        "steps": result.steps,
        "idle_steps": result.idle_steps,
        "request_steps": result.request_steps,
        "prompt_tokens": result.prompt_tokens,
        "reused_tokens": result.reused_tokens,
        "computed_tokens": result.computed_tokens,
        "prefill_tokens": result.prefill_tokens,
        "decode_tokens": result.decode_tokens,
        "generated_tokens": result.generated_tokens,
        "hit_rate": result.hit_rate,
        "prefix_hit_rate": result.hit_rate,
        "ideal_hit_rate": result.ideal_hit_rate,
        "ideal_hit_rate_all_requests": result.ideal_hit_rate_all_requests,
        "ideal_ignores_ssm_snapshots": result.ideal_ignores_ssm_snapshots,
        "hash_block_hit_rate": result.hash_block_hit_rate,
        "followers": None if result.followers is None else result.followers.as_dict(),
        "reused_tokens_by_tier": dict(zip(result.options.tier_names, result.reused_tokens_by_tier)),
        "hit_rate_by_tier": {
            name: tokens / result.prompt_tokens if result.prompt_tokens else 0.0
            for name, tokens in zip(result.options.tier_names, result.reused_tokens_by_tier)
        },
        "layer_groups": [
            {
                "layer_group": group.group_id,
                "kind": group.kind,
                "window": group.window,
                "layers": group.num_layers,
                "pool_group": group.pool_group,
                "hit_rate": group.reused_tokens / result.prompt_tokens if result.prompt_tokens else 0.0,
                "reused_tokens": group.reused_tokens,
                "reused_pages": group.reused_pages,
                "reused_pages_by_tier": dict(zip(result.options.tier_names, group.reused_pages_by_tier)),
            }
            for group in result.layer_groups
        ],
        "pool_groups": [
            {
                "pool_group": pool.pool_group,
                "slot_bytes": pool.slot_bytes,
                "gpu_slots": pool.gpu_slots,
                "peak_in_use": pool.peak_in_use,
                "peak_occupied": pool.peak_occupied,
                "peak_without_scratch": pool.peak_without_scratch if result.options.scratch else None,
            }
            for pool in result.pool_groups
        ],
        "movement": {
            "offloaded_pages": result.offloaded_pages,
            "offloaded_bytes": result.offloaded_bytes,
            "onboarded_pages": result.onboarded_pages,
            "onboarded_bytes": result.onboarded_bytes,
            "copied_pages": result.copied_pages,
            "dropped_pages": result.dropped_pages,
            "prefetched_pages": result.prefetched_pages,
        },
        "preemptions": result.preemptions,
        "resumes": result.resumes,
        "recomputes": result.recomputes,
        "manager_seconds": result.manager_ns / 1e9,
        "manager_bookkeeping_seconds": result.bookkeeping_ns / 1e9,
        "manager_copy_seconds": result.manager_copy_ns / 1e9,
        "manager_us_per_step": result.manager_us_per_step,
        "manager_us_per_request_step": result.manager_us_per_request_step,
        "checked_tokens": result.checked_tokens,
        "wall_seconds": result.wall_s,
    }
    if timeline:
        report["timeline"] = {
            "step": result.timeline_steps,
            "hit_rate": result.timeline_hit_rate,
            "running": result.timeline_running,
            "preemptions": result.timeline_preemptions,
            "gpu_in_use": result.timeline_in_use,
            "gpu_occupied": result.timeline_occupied,
            "colder_occupied": {
                name: [sample[tier] for sample in result.timeline_colder]
                for tier, name in enumerate(result.options.tier_names[1:])
            },
        }
    if result.no_reuse is not None:
        report["no_reuse"] = result_json(result.no_reuse, timeline=False)
    return report


# ---------------------------------------------------------------------------------------------- the sweep
# A sweep over a tier's quota already shows it in its first column: that tier's own column is left out.
SWEPT_QUOTA_COLUMNS: Final = {"capacity (GPU MiB)": "GPU MiB", "--gpu-mib": "GPU MiB", "--host-mib": "host MiB"}


def sweep_table(parameter: str, values: Sequence[str], results: Sequence[SimulationResult]) -> Table:
    """One row per run of a sweep over ``parameter`` (the flag), each run's value first."""
    rows: list[list[str]] = []
    for value, result in zip(values, results):
        options = result.options
        gpu_slots = sum(pool.gpu_slots for pool in result.pool_groups)
        rows.append(
            [
                value,
                f"{options.gpu_mib:,}",
                f"{gpu_slots:,}",
                f"{options.host_mib:,}" if options.host_mib else "-",
                _percent(result.hit_rate),
                _percent(result.ideal_hit_rate),
                _tier_line(result),
                f"{result.computed_tokens:,}",
                f"{result.steps:,}",
                f"{result.preemptions:,}",
                f"{result.rejected:,}",
                f"{result.manager_us_per_request_step:,.1f}",
                f"{result.wall_s:.1f}",
            ]
        )
    mode = "compiled" if results and results[0].compiled else "interpreted"
    model = results[0].options.model_name if results else "-"
    ideal = "an infinite cache with the manager's reuse rules"
    if results and results[0].ideal_ignores_ssm_snapshots:
        ideal += f" ({IDEAL_WITHOUT_SNAPSHOTS})"
    headers = [parameter, "GPU MiB", "GPU slots", "host MiB", "hit rate", "ideal", "by tier", "computed tokens", "steps",
               "preemptions", "rejected", "µs/request-step", "wall s"]
    repeated = SWEPT_QUOTA_COLUMNS.get(parameter)
    kept = [index for index, header in enumerate(headers) if header != repeated]
    return Table(
        f"hit rate against {parameter}: {model}, {mode}",
        [headers[index] for index in kept],
        [[row[index] for index in kept] for row in rows],
        f"hit rate = reused / prompt tokens of served requests; ideal = {ideal}, over each run's served requests; µs of "
        "manager time per request-step",
    )


def sweep_json(parameter: str, values: Sequence[str], results: Sequence[SimulationResult]) -> dict[str, object]:
    """The sweep's runs, each as ``result_json`` gives it (no timeline), with the workload's ideal at the top."""
    first = results[0] if results else None
    return {
        "parameter": parameter,
        "ideal_hit_rate": first.ideal_hit_rate_all_requests if first is not None else None,
        "ideal_ignores_ssm_snapshots": first.ideal_ignores_ssm_snapshots if first is not None else None,
        "hash_block_hit_rate": first.hash_block_hit_rate if first is not None else None,
        "points": [{"value": value, **result_json(result, timeline=False)} for value, result in zip(values, results)],
    }
