"""The continuous batcher rides through disk tier faults: a suspended request whose pages a failed read or write
lost is closed and computed again (``PageContentLostError`` from its resume), a new request whose match found such
pages waits a step and matches without them, and the FakeEngine checks every token the whole run reads. Before,
the first lost page ended the simulator with ``PageContentLostError``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2.sim.options import SimulatorOptions, build_config
from kv_cache_manager_v2.sim.scheduler import Simulation
from kv_cache_manager_v2.sim.simulator import build_workload
from tests.fuzz.faulty_tiers import disk_fault

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd (Linux)")


@pytest.mark.parametrize("kind", [0, 1], ids=["reads-fail", "reads-and-writes-fail"])
def test_requests_finish_with_checked_content_while_the_disk_fails_every_fourth_step(tmp_path: Path, kind: int) -> None:
    # A GPU tier too small for the batch (each request fits it alone: none is rejected on arrival) and no host tier:
    # preempted requests' pages go to the disk and come back.
    options = SimulatorOptions(num_requests=24, check=True, gpu_mib=320, host_mib=0, disk_mib=768,
                               disk_dir=str(tmp_path))
    workload = build_workload(options)
    lengths = [r.prompt_length + r.output_length for r in workload.requests]
    manager = KVCacheManager(build_config(options, str(tmp_path), lengths, False))
    simulation = Simulation(options, manager, workload, None)
    step = 0
    while not simulation.batcher.done:
        if step % 4 == 2:
            with disk_fault(kind):
                simulation.step()  # a ContentError here would be a page served without its bytes
        else:
            simulation.step()
        manager.check_invariants()
        step += 1
        assert step < 2000
    counters = manager.movement_counters
    assert counters.lost_pages > 0 and counters.onboarded_pages > 0  # the faults did hit pages in flight
    assert len(simulation.batcher.finished_ids) == options.num_requests and simulation.batcher.rejected == 0
    assert simulation.batcher.recomputes > 0
    simulation.close_all()
    manager.shutdown()
