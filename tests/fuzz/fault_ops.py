"""Faults below the manager (``tests/fuzz/faulty_tiers.py``): an engine step, a placement hint or a quota change of
the last tier while the disk tier's pool files fail reads or writes, and a cold-page codec raising on its next calls. Either degrades to misses or, for a suspended
cache whose pages were lost, ``PageContentLostError`` from its resume (``FuzzWorld`` closes it); the content checks
after every operation prove no page whose bytes never arrived is served."""

from __future__ import annotations

from tests.fuzz.faulty_tiers import disk_fault
from tests.fuzz.lifecycle_ops import LifecycleOperations
from tests.fuzz.manager_ops import ManagerOperations


class FaultOperations(LifecycleOperations, ManagerOperations):
    """Disk and codec faults around the life cycle's and the manager's own operations."""

    def disk_fault(self, kind: int, index: int, chunk: int) -> None:
        """One ``serve`` step (resume, evictions, commits), for odd ``chunk`` a placement hint (offload or prefetch
        of a suspended cache), for ``chunk % 4 == 2`` a quota change of the last tier (a shrink's compaction copies
        and the blocks it gives back) while the pool files fail as ``kind`` says."""
        with self._operation("disk_fault"), disk_fault(kind):
            if chunk % 2:
                self.place(index, chunk % 3)
            elif chunk % 4 == 2:
                self.change_quota(len(self.quotas) - 1, chunk // 4)
            else:
                self.serve(index, chunk)

    def codec_fault(self, count: int) -> None:
        """The codec raises on its next ``1 + count`` encode or decode calls; ``count`` 2: it interrupts its next
        call instead (``FuzzInterrupt``, out of whichever later operation moves a page through it)."""
        with self._operation("codec_fault"):
            assert self.codec is not None
            if count == 2:
                self.codec.interrupts += 1
            else:
                self.codec.failures += 1 + count
