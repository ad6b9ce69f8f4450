"""The serving simulator: builds a run's workload (the seeded multi-turn workload or a replayed
Mooncake trace, ``mooncake_trace.py``) and manager, and drives ``scheduler.Simulation`` to the end.

Bookkeeping-only mode (for large traces) turns the content checks off and divides every buffer and quota by one
power of two (``presets.bookkeeping_divisor``): the same slot counts and decisions, page copies of a few bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from typing import Callable, Sequence

from .. import KVCacheManager
from .._model.admission_limits import DECLARED_REQUEST_TOO_LONG
from ..cli.held_warnings import HeldWarnings
from .mooncake_trace import MooncakeRequest, hash_block_hit_rate, ideal_hit_rate, ideal_reuse, load_mooncake_trace
from .options import SimulatorOptions, build_config, seeded_workload
from .result import ProgressCallback, SimulationResult
from .reuse_sources import EventForward
from .scheduler import Simulation, Workload
from .workload import SimulatedRequest, TraceRequest, ideal_prefix_hit_rate

logger: logging.Logger = logging.getLogger("kv_cache_manager_v2")


def build_workload(options: SimulatorOptions) -> Workload:
    """The run's requests and their ideal hit rate over all of them: ``simulator_workload`` shaped by the
    options, or the trace file."""
    if options.trace is None:
        requests = seeded_workload(options, options.num_requests)
        return Workload(requests, workload_ideal(options, requests))
    trace = load_mooncake_trace(options.trace, options.trace_limit, options.trace_speed, options.closed_loop)
    ideal = ideal_reuse(trace, options.tokens_per_block, partial_reuse_enabled(options))
    return Workload(trace, ideal.hit_rate(trace), hash_block_hit_rate(trace), ideal)


def partial_reuse_enabled(options: SimulatorOptions) -> bool:
    """Whether the run's manager reuses part of a block (SSM layers turn it off): the ideal follows it."""
    return build_config(options, ".", ()).partial_reuse_enabled


def workload_ideal(
    options: SimulatorOptions, requests: Sequence[SimulatedRequest], served: Sequence[bool] | None = None
) -> float:
    """The infinite-cache hit rate of ``requests`` in arrival order, over the ``served`` ones (default: all),
    with the manager's block size and its partial-reuse setting (which SSM layers turn off)."""
    tpb = options.tokens_per_block
    partial_reuse = partial_reuse_enabled(options)
    traced = [request for request in requests if isinstance(request, MooncakeRequest)]
    if traced and len(traced) == len(requests):
        return ideal_hit_rate(traced, tpb, partial_reuse, served)
    seeded = [request for request in requests if isinstance(request, TraceRequest)]
    if len(seeded) != len(requests):
        raise TypeError("requests: expected all MooncakeRequest or all TraceRequest")
    return ideal_prefix_hit_rate(seeded, tpb, partial_reuse, served)


def warn_of_requests_too_long(
    options: SimulatorOptions, manager: KVCacheManager, requests: Sequence[SimulatedRequest]
) -> None:
    """Log which requests the GPU tier cannot hold even alone, computed in ``--chunk`` chunks from their first token
    (``max_admissible``): the run will reject them."""
    needs = [request.prompt_length + request.output_length - 1 for request in requests]
    if not needs:
        return
    fits = manager.max_admissible(options.chunk, max(needs))
    too_long = [index for index, need in enumerate(needs) if need > fits]
    if not too_long:
        return
    worst = max(too_long, key=lambda index: needs[index])
    logger.warning(
        "%d of %d requests need more than the GPU tier holds for one request alone (--gpu-mib %d, --chunk %d: at most "
        "%d tokens of prompt and output) and will be rejected; the longest, request %d, needs %d; raise --gpu-mib",
        len(too_long), len(needs), options.gpu_mib, options.chunk, fits, requests[worst].request_id, needs[worst],
    )


def build_manager(
    options: SimulatorOptions, disk_dir: str | None, request_lengths: Sequence[int], kv_events: bool, held: HeldWarnings
) -> KVCacheManager:
    """The run's manager, its GPU tier split for the requests' lengths (``build_config``). Where that split admits
    not even a one-token request (a hybrid on a small tier: the step's proportions left 1 SSM slot against dozens
    of attention blocks, and an admission may lock at most 0.97 of a pool group), it is split for the same requests
    at half their lengths, then a quarter...: an SSM state's bytes do not shrink with the length, so the SSM group's
    share grows. The first split that admits a request is kept (as the manager does for its own default step,
    while it keeps a declared one as declared), else the first; only one manager is alive at a time."""
    lengths = list(request_lengths)
    manager = KVCacheManager(build_config(options, disk_dir, lengths, kv_events))
    if manager.max_admissible(options.chunk, 1) > 0:
        return manager
    manager.shutdown()
    while max(lengths, default=0) >= 2 * options.tokens_per_block:
        lengths = [max(1, length // 2) for length in lengths]
        held.records.clear()
        manager = KVCacheManager(build_config(options, disk_dir, lengths, kv_events))
        if manager.max_admissible(options.chunk, 1) > 0:
            return manager
        manager.shutdown()
    held.records.clear()
    return KVCacheManager(build_config(options, disk_dir, request_lengths, kv_events))


def simulate(
    options: SimulatorOptions,
    progress: ProgressCallback | None = None,
    on_start: Callable[[KVCacheManager], None] | None = None,
    workload: Workload | None = None,
    kv_events: Callable[[KVCacheManager], EventForward] | None = None,
) -> SimulationResult:
    """Build the workload (unless given: a sweep loads a trace once) and the manager, run the loop to the end,
    shut the manager down.

    ``on_start`` sees the manager before the first step (e.g. to print its layout). ``kv_events`` turns the
    manager's KV events on and makes, from the manager, what receives them after every step (a publisher)."""
    if workload is None:
        workload = build_workload(options)
    requests = workload.requests
    lengths = [request.prompt_length + request.output_length for request in requests]
    temporary: tempfile.TemporaryDirectory[str] | None = None
    disk_dir = options.disk_dir
    if options.disk_mib > 0 and disk_dir is None:
        temporary = tempfile.TemporaryDirectory(prefix="kv_cache_manager_v2_disk_")
        disk_dir = temporary.name
    # Only the directory itself is created, and removed after (the disk tier removes its files): a run leaves no
    # directories behind, and a missing parent is an error (``simulate --disk-dir`` says so before any work).
    created = disk_dir is not None and options.disk_mib > 0 and not os.path.isdir(disk_dir)
    if created and disk_dir is not None:
        os.mkdir(disk_dir)
    try:
        with HeldWarnings() as held:
            manager = build_manager(options, disk_dir, lengths, kv_events is not None, held)
        # The typical step follows the workload's lengths up to a percentile, a split hint rather than a request:
        # what the GPU tier refuses is said of the run's own requests instead.
        warn_of_requests_too_long(options, manager, requests)
        held.release(lambda record: record.msg == DECLARED_REQUEST_TOO_LONG)
        try:
            simulation = Simulation(options, manager, workload, None if kv_events is None else kv_events(manager))
            if on_start is not None:
                on_start(manager)
            try:
                result = simulation.run(progress)
            finally:
                simulation.close_all()
            served = simulation.served
            del simulation
        finally:
            manager.shutdown()
    finally:
        if temporary is not None:
            temporary.cleanup()
        if created and disk_dir is not None:
            with contextlib.suppress(OSError):  # not empty: what else is in it is not the run's to remove
                os.rmdir(disk_dir)
    # The measured rate is over served requests: so is the ideal it is compared with. Computed once the manager
    # is gone, so its trie never adds to the run's peak memory.
    result.ideal_hit_rate_all_requests = workload.ideal_hit_rate
    if not all(served):
        ideal = workload.ideal_reuse  # a trace's, kept from the start: no second trie
        traced = [request for request in requests if isinstance(request, MooncakeRequest)]
        if ideal is not None and len(traced) == len(requests):
            result.ideal_hit_rate = ideal.hit_rate(traced, served)
        else:
            result.ideal_hit_rate = workload_ideal(options, requests, served)
    return result
