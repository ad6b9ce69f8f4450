"""Faults below the manager (``tests/fuzz/faulty_tiers.py``): an engine step while the disk tier's pool files fail
reads or writes, and a cold-page codec raising on its next calls. Either degrades to misses or, for a suspended
cache whose pages were lost, ``PageContentLostError`` from its resume (``FuzzWorld`` closes it); the content checks
after every operation prove no page whose bytes never arrived is served."""

from __future__ import annotations

from tests.fuzz.faulty_tiers import disk_fault
from tests.fuzz.lifecycle_ops import LifecycleOperations


class FaultOperations(LifecycleOperations):
    """Disk and codec faults around the life cycle's own operations."""

    def disk_fault(self, kind: int, index: int, chunk: int) -> None:
        """One ``serve`` step (resume, evictions, commits) or, odd ``chunk``, a placement hint (offload or
        prefetch of a suspended cache) while the pool files fail as ``kind`` says."""
        with self._operation("disk_fault"), disk_fault(kind):
            if chunk % 2:
                self.place(index, chunk % 3)
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
