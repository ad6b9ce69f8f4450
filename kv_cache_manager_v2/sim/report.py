"""What the simulator shows: the planned layout, the end-of-run tables, one JSON object and a PNG plot; for a
capacity sweep, one table row, JSON object and plotted point per run.

rich (tables) and matplotlib (plot) are the optional ``cli`` extra, imported inside the functions that use them;
without rich the tables are printed as aligned plain text, without matplotlib ``--plot`` is a usage error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Sequence

from .. import KVCacheManager
from .result import SimulationResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


class Table:
    """A titled table of strings with an optional note below: rendered by rich when installed, else plain."""

    def __init__(self, title: str, headers: list[str], rows: list[list[str]], note: str = "") -> None:
        self.title = title
        self.headers = headers
        self.rows = rows
        self.note = note


# ------------------------------------------------------------------------------------------------ figures
def describe_layout(manager: KVCacheManager) -> list[str]:
    """Human-readable lines: layer groups, pool groups and slot counts per tier."""
    lines: list[str] = [f"backend: {manager.backend}, tokens per block: {manager.tokens_per_block}"]
    for group_id, layers in enumerate(manager.layer_grouping):
        pool_group = manager.get_pool_group_index(group_id)
        lines.append(f"layer group {group_id}: {len(layers)} layer(s) -> pool group {pool_group}")
    for level in range(manager.num_cache_levels):
        stats = manager.get_storage_statistics(level)
        for pool_group, stat in enumerate(stats):
            slot_bytes = manager.get_slot_bytes(pool_group)
            lines.append(
                f"level {level} pool group {pool_group}: {stat.total} slots of {sum(slot_bytes) // KIB} KiB "
                f"(pools of {[size // KIB for size in slot_bytes]} KiB)"
            )
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
                f"pool group {pool.pool_group}: peak {pool.peak_in_use} slots vs {pool.peak_without_scratch} "
                f"without scratch (-{saved}, {_percent(saved / pool.peak_without_scratch)})"
            )
    return "; ".join(parts) if parts else "none (no prefill chunk reached past a window)"


def _ideal_line(result: SimulationResult) -> str:
    line = f"{_percent(result.hit_rate)} (ideal for this workload {_percent(result.ideal_hit_rate)}"
    if result.hash_block_hit_rate is not None:
        line += f"; the trace's own 512-token block figure {_percent(result.hash_block_hit_rate)}"
    return line + ")"


def _tier_line(result: SimulationResult) -> str:
    """Reused tokens per tier they were found on, as shares of the prompt tokens."""
    parts = [
        f"{name} {_percent(tokens / result.prompt_tokens if result.prompt_tokens else 0.0)} ({tokens:,})"
        for name, tokens in zip(result.options.tier_names, result.reused_tokens_by_tier)
    ]
    return ", ".join(parts)


def summary_tables(result: SimulationResult) -> list[Table]:
    """The end-of-run report: a summary, then one row per layer group and per pool group."""
    mode = "compiled" if result.compiled else "interpreted"
    computed_prompt = result.prompt_tokens - result.reused_tokens
    workload = "seeded workload" if result.options.trace is None else f"trace {result.options.trace}"
    summary = [
        ["workload", workload + (", bookkeeping only" if result.options.bookkeeping else "")],
        ["requests", f"{result.num_requests:,} ({result.finished:,} finished, {result.rejected:,} rejected)"],
        ["steps", f"{result.steps:,} ({result.request_steps:,} request-steps, {result.idle_steps:,} idle)"],
        ["prompt tokens", f"{result.prompt_tokens:,} ({result.reused_tokens:,} reused, {computed_prompt:,} computed)"],
        ["generated tokens", f"{result.generated_tokens:,}"],
        ["prefix hit rate", _ideal_line(result)],
        ["hit rate per tier", _tier_line(result)],
        ["preemptions", f"{result.preemptions:,} by suspension ({result.resumes:,} resumed, {result.recomputes:,} recomputed)"],
        ["offloaded pages", f"{result.offloaded_pages:,} ({_size(result.offloaded_bytes)})"],
        ["onboarded pages", f"{result.onboarded_pages:,} ({_size(result.onboarded_bytes)})"],
        ["copied / dropped pages", f"{result.copied_pages:,} / {result.dropped_pages:,}"],
        ["scratch savings", _scratch_line(result)],
        [
            "manager CPU time",
            f"{result.manager_us_per_step:,.0f} µs/step, {result.manager_us_per_request_step:,.0f} µs/request-step, "
            f"{result.manager_ns / 1e9:.2f} s",
        ],
        ["content checks", f"{result.checked_tokens:,} token records verified" if result.options.check else "off"],
        ["wall time", f"{result.wall_s:.1f} s"],
    ]
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
    title = f"simulate: preset {result.options.preset}, backend {result.backend}, {mode}"
    return [
        Table(
            title,
            ["", ""],
            summary,
            "manager CPU time: only manager calls, timed; on the cpu backend it includes the real page copies",
        ),
        Table(
            "prefix reuse per layer group",
            ["group", "kind", "layers", "pool group", "hit rate", "reused tokens", "reused pages",
             "found on " + " / ".join(result.options.tier_names)],
            groups,
            "hit rate = reused / prompt tokens, each request counted at its first admission; reused pages = cached "
            "pages the group got back (SSM: snapshots), by the tier they were found on (copies count as GPU)",
        ),
        Table(
            "GPU slots per pool group",
            ["pool group", "slot", "slots", "peak in use", "peak occupied", "w/o scratch"],
            pools,
            "peaks per step, after the resizes and before the commits; in use = locked by running requests; "
            "occupied also counts cached pages; w/o scratch = what the same steps would need without scratch",
        ),
    ]


def _kind(kind: str, window: int) -> str:
    if kind == "swa":
        return f"SWA {window:,}"
    return "SSM" if kind == "ssm" else "full"


def render_plain(tables: Sequence[Table]) -> str:
    """Aligned plain-text tables (the fallback when rich is not installed)."""
    blocks: list[str] = []
    for table in tables:
        widths = [len(header) for header in table.headers]
        for row in table.rows:
            for column, cell in enumerate(row):
                widths[column] = max(widths[column], len(cell))
        lines = [table.title]
        if any(table.headers):
            lines.append("  ".join(header.ljust(width) for header, width in zip(table.headers, widths)).rstrip())
            lines.append("  ".join("-" * width for width in widths))
        for row in table.rows:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if table.note:
            lines.append(f"({table.note})")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def print_tables(tables: Sequence[Table], plain: bool = False) -> None:
    """Print the tables with rich when it is installed (and ``plain`` is False), else as plain text."""
    if not plain:
        try:
            from rich.console import Console
            from rich.table import Table as RichTable
        except ImportError:
            plain = True
    if plain:
        print(render_plain(tables))
        return
    console = Console()
    for table in tables:
        headers = any(table.headers)
        rich_table = RichTable(
            title=table.title,
            caption=table.note or None,
            show_header=headers,
            title_justify="left",
            caption_justify="left",
        )
        for position, header in enumerate(table.headers):
            rich_table.add_column(header, justify="left" if position < 2 else "right")
        for row in table.rows:
            rich_table.add_row(*row)
        console.print(rich_table)
        console.print()


# --------------------------------------------------------------------------------------------------- JSON
def result_json(result: SimulationResult) -> dict[str, object]:
    """Every figure of the tables, machine-readable (``--json``)."""
    return {
        "preset": result.options.preset,
        "backend": result.backend,
        "compiled": result.compiled,
        "options": result.options.as_dict(),
        "requests": result.num_requests,
        "finished": result.finished,
        "rejected": result.rejected,
        "steps": result.steps,
        "idle_steps": result.idle_steps,
        "request_steps": result.request_steps,
        "prompt_tokens": result.prompt_tokens,
        "reused_tokens": result.reused_tokens,
        "computed_tokens": result.computed_tokens,
        "generated_tokens": result.generated_tokens,
        "hit_rate": result.hit_rate,
        "prefix_hit_rate": result.hit_rate,
        "ideal_hit_rate": result.ideal_hit_rate,
        "hash_block_hit_rate": result.hash_block_hit_rate,
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
        },
        "preemptions": result.preemptions,
        "resumes": result.resumes,
        "recomputes": result.recomputes,
        "manager_seconds": result.manager_ns / 1e9,
        "manager_us_per_step": result.manager_us_per_step,
        "manager_us_per_request_step": result.manager_us_per_request_step,
        "checked_tokens": result.checked_tokens,
        "wall_seconds": result.wall_s,
    }


# --------------------------------------------------------------------------------------------------- plot
def _new_figure(size: tuple[float, float]) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'kv_cache_manager_v2[cli]'") from None
    figure = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(figure)  # the Agg canvas: no display, no global pyplot state
    return figure


def _hit_rate_axes(axes: Axes, xlabel: str, title: str, legend_at: Literal["best", "lower right"]) -> None:
    """Labels, the 0-1 range and the legend of a prefix-hit-rate panel."""
    axes.set_xlabel(xlabel)
    axes.set_ylabel("reused / prompt tokens")
    axes.set_ylim(0.0, 1.0)
    axes.set_title(title)
    axes.legend(fontsize="small", loc=legend_at)
    axes.grid(True)


def write_plot(result: SimulationResult, path: str) -> None:
    """A PNG: GPU slots per pool group over the steps (in use solid, occupied dashed, as a fraction of the
    group's slots) and the cumulative prefix hit rate against the workload's ideal. Needs matplotlib."""
    figure = _new_figure((10.0, 7.0))
    memory, hits = figure.subplots(2, 1, sharex=True)
    steps = result.timeline_steps
    for pool in result.pool_groups:
        total = max(1, pool.gpu_slots)
        in_use = [sample[pool.pool_group] / total for sample in result.timeline_in_use]
        occupied = [sample[pool.pool_group] / total for sample in result.timeline_occupied]
        label = f"pool group {pool.pool_group} ({pool.gpu_slots} slots of {_size(pool.slot_bytes)})"
        color = f"C{pool.pool_group % 10}"
        memory.plot(steps, in_use, label=f"{label}: in use", color=color, linewidth=1.2)
        memory.plot(steps, occupied, label=f"{label}: occupied incl. cached", color=color, linestyle="--", linewidth=0.8)
    memory.set_ylabel("GPU slots used (fraction)")
    memory.set_ylim(0.0, 1.05)
    memory.set_title("memory over time")
    memory.legend(fontsize="small", loc="best")
    memory.grid(True)
    hits.plot(steps, result.timeline_hit_rate, label="prefix hit rate so far")
    hits.axhline(result.ideal_hit_rate, linestyle=":", color="grey", label="ideal (infinite cache)")
    _hit_rate_axes(hits, "step", "prefix hit rate over time", "lower right")
    mode = "compiled" if result.compiled else "interpreted"
    figure.suptitle(f"kv_cache_manager_v2 simulate: preset {result.options.preset}, {result.num_requests} requests ({mode})")
    figure.savefig(path, dpi=100)


# ---------------------------------------------------------------------------------------------- the sweep
def sweep_table(results: Sequence[SimulationResult]) -> Table:
    """One row per run of a capacity sweep: hit rate against GPU (and host) capacity."""
    rows: list[list[str]] = []
    for result in results:
        options = result.options
        gpu_slots = sum(pool.gpu_slots for pool in result.pool_groups)
        rows.append(
            [
                f"{options.gpu_mib:,}",
                f"{gpu_slots:,}",
                f"{options.host_mib:,}" if options.host_mib else "-",
                _percent(result.hit_rate),
                _percent(result.ideal_hit_rate),
                _tier_line(result),
                f"{result.preemptions:,}",
                f"{result.rejected:,}",
                f"{result.manager_us_per_request_step:,.1f}",
                f"{result.wall_s:.1f}",
            ]
        )
    mode = "compiled" if results and results[0].compiled else "interpreted"
    preset = results[0].options.preset if results else "-"
    return Table(
        f"hit rate against capacity: preset {preset}, {mode}",
        ["GPU MiB", "GPU slots", "host MiB", "hit rate", "ideal", "by tier", "preemptions", "rejected",
         "µs/request-step", "wall s"],
        rows,
        "hit rate = reused / prompt tokens; ideal = an infinite cache with the manager's reuse rules; µs of "
        "manager time per request-step",
    )


def sweep_json(results: Sequence[SimulationResult]) -> dict[str, object]:
    """The sweep's runs, each as ``result_json`` gives it, with the workload's ideal once at the top."""
    first = results[0] if results else None
    return {
        "ideal_hit_rate": first.ideal_hit_rate if first is not None else None,
        "hash_block_hit_rate": first.hash_block_hit_rate if first is not None else None,
        "points": [result_json(result) for result in results],
    }


def write_sweep_plot(results: Sequence[SimulationResult], path: str) -> None:
    """A PNG: prefix hit rate against the GPU quota, one line without and one with the host tier, and the
    workload's ideal. Needs matplotlib."""
    figure = _new_figure((8.0, 5.0))
    axes = figure.add_subplot()
    for with_host in (False, True):
        points = sorted(
            (result.options.gpu_mib, result.hit_rate) for result in results if (result.options.host_mib > 0) == with_host
        )
        if not points:
            continue
        host = f"host tier {results[-1].options.host_mib:,} MiB" if with_host else "no host tier"
        axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=host)
    if results:
        axes.axhline(results[0].ideal_hit_rate, linestyle=":", color="grey", label="ideal (infinite cache)")
    _hit_rate_axes(axes, "GPU quota (MiB)", "prefix hit rate against GPU capacity", "best")
    preset = results[0].options.preset if results else "-"
    figure.suptitle(f"kv_cache_manager_v2 simulate: preset {preset}, {results[0].num_requests if results else 0} requests")
    figure.savefig(path, dpi=100)
