"""The simulator's PNG plots (``--plot``): one run over time, or a sweep's hit rate against the swept value.

matplotlib is part of the optional ``cli`` extra, imported where used (the CLI checks for it before a run); the
figures are drawn on the Agg canvas, without pyplot's global state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Sequence

from .report import ideal_label, plural
from .result import SimulationResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# One dash pattern and width per pool group, widest first: two pool groups at the same value (both full at 1.0) stay
# visible as a wide solid line with a narrower dashed one on top.
LINE_STYLES: tuple[tuple[str, float], ...] = (("-", 3.0), ("--", 1.8), (":", 1.4), ("-.", 1.2))


def new_figure(size: tuple[float, float]) -> Figure:
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


def _fraction_axes(axes: Axes, ylabel: str, title: str) -> None:
    axes.set_ylabel(ylabel)
    axes.set_ylim(0.0, 1.08)
    axes.set_title(title)
    axes.legend(fontsize="small", loc="best")
    axes.grid(True)


def run_figure(result: SimulationResult) -> Figure:
    """Four panels over the steps: GPU slots locked by running requests, GPU slots occupied including cached
    pages (each pool group as a fraction of its slots, one dash pattern per pool group), the host and disk tiers'
    occupied slots, and the cumulative prefix hit rate against the ideal with the preemptions so far."""
    from matplotlib.ticker import MaxNLocator

    figure = new_figure((10.0, 11.0))
    in_use_axes, occupied_axes, colder_axes, hits = figure.subplots(4, 1, sharex=True)
    steps = result.timeline_steps
    for pool in result.pool_groups:
        total = max(1, pool.gpu_slots)
        style, width = LINE_STYLES[pool.pool_group % len(LINE_STYLES)]
        color = f"C{pool.pool_group % 10}"
        label = f"pool group {pool.pool_group} ({plural(pool.gpu_slots, 'slot')})"
        in_use = [sample[pool.pool_group] / total for sample in result.timeline_in_use]
        occupied = [sample[pool.pool_group] / total for sample in result.timeline_occupied]
        in_use_axes.plot(steps, in_use, label=label, color=color, linestyle=style, linewidth=width)
        occupied_axes.plot(steps, occupied, label=label, color=color, linestyle=style, linewidth=width)
    _fraction_axes(in_use_axes, "fraction of GPU slots", "GPU slots in use (locked by running requests)")
    _fraction_axes(occupied_axes, "fraction of GPU slots", "GPU slots occupied (in use + cached pages kept for reuse)")
    colder_names = result.options.tier_names[1:]
    for tier, name in enumerate(colder_names):
        for pool_group, total in enumerate(result.colder_slots[tier]):
            style, width = LINE_STYLES[pool_group % len(LINE_STYLES)]
            occupied = [sample[tier][pool_group] / max(1, total) for sample in result.timeline_colder]
            colder_axes.plot(
                steps, occupied, label=f"{name}, pool group {pool_group} ({plural(total, 'slot')})",
                color=f"C{(tier + 3) % 10}", linestyle=style, linewidth=width,
            )
    if colder_names:
        _fraction_axes(colder_axes, "fraction of tier slots", "host / disk tier slots occupied (offloaded pages)")
    else:
        colder_axes.set_title("host / disk tier slots occupied: no host or disk tier in this run")
        colder_axes.set_ylim(0.0, 1.0)
    hits.plot(steps, result.timeline_hit_rate, label="prefix hit rate so far")
    hits.axhline(result.ideal_hit_rate, linestyle=":", color="grey", label=ideal_label(result))
    _hit_rate_axes(hits, "step", "prefix hit rate over time; preemptions so far (right axis)", "lower right")
    preemptions = hits.twinx()
    preemptions.step(steps, result.timeline_preemptions, where="post", color="C3", linewidth=1.0, label="preemptions")
    preemptions.set_ylabel("preemptions so far", color="C3")
    preemptions.yaxis.set_major_locator(MaxNLocator(integer=True))
    mode = "compiled" if result.compiled else "interpreted"
    figure.suptitle(
        f"kv_cache_manager_v2 simulate: {result.options.model_name}, {plural(result.num_requests, 'request')} ({mode})"
    )
    return figure


def write_plot(result: SimulationResult, path: str) -> None:
    """``run_figure`` as a PNG file. Needs matplotlib."""
    run_figure(result).savefig(path, dpi=100)


def sweep_figure(parameter: str, values: Sequence[float], results: Sequence[SimulationResult]) -> Figure:
    """Prefix hit rate against the swept value: one line per host quota (a GPU sweep runs without and with the
    host tier), and the workload's ideal."""
    figure = new_figure((8.0, 5.0))
    axes = figure.add_subplot()
    host_quotas = sorted({result.options.host_mib for result in results})
    for host_mib in host_quotas:
        points = sorted((value, result.hit_rate) for value, result in zip(values, results) if result.options.host_mib == host_mib)
        label = f"host tier {host_mib:,} MiB" if host_mib else "no host tier"
        axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
    if results:
        axes.axhline(
            results[0].ideal_hit_rate_all_requests, linestyle=":", color="grey", label=ideal_label(results[0]) + ", all requests"
        )
    _hit_rate_axes(axes, parameter, f"prefix hit rate against {parameter}", "best")
    model = results[0].options.model_name if results else "-"
    figure.suptitle(f"kv_cache_manager_v2 simulate: {model}, {plural(results[0].num_requests if results else 0, 'request')}")
    return figure


def write_sweep_plot(parameter: str, values: Sequence[float], results: Sequence[SimulationResult], path: str) -> None:
    """``sweep_figure`` as a PNG file. Needs matplotlib."""
    sweep_figure(parameter, values, results).savefig(path, dpi=100)
