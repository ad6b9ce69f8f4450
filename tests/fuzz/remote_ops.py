"""The remote tier's operations (``remote_fills`` config only): a closed request asked again (its blocks come
back from the store), a store answering its next calls badly, and a store restarting empty."""

from __future__ import annotations

from tests.fuzz.flaky_store import STORE_FAULTS
from tests.fuzz.model import CacheModel, pick
from tests.fuzz.world import FuzzWorld


class RemoteOperations(FuzzWorld):
    """Fills from the shared store and the store's faults."""

    def refetch(self, index: int, suffix: int) -> None:
        """A closed request's committed tokens again, in its scope, resumed at once: most of its blocks left the
        small GPU tier, so they come back from the store, evicting for their slots; their content is checked."""
        with self._operation("refetch"):
            old = pick(self.closed, index)
            assert old is not None
            prompt = old.tokens[: old.committed] + self._fresh(suffix % 9)
            probe = self.manager.probe_reuse(old.scope, prompt)
            cache = self.manager.create_kv_cache(old.scope, prompt)
            model = CacheModel(cache, prompt, old.scope, cache.num_committed_tokens)
            assert probe <= model.committed <= len(prompt), (probe, cache)
            self.live.append(model)
            self.stats.caches_created += 1
            if cache.resume():
                model.active = True
                self._check_content(model)

    def store_fault(self, kind: int, count: int) -> None:
        """The store answers its next ``count`` batch calls badly (``FlakyStore``): a miss, never an error; the
        remote tier's statistics stay consistent."""
        with self._operation("store_fault"):
            assert self.store is not None
            self.store.faults.extend([kind % STORE_FAULTS] * (1 + count % 3))
            stats = self.manager.get_remote_tier_statistics()
            assert stats is not None and stats.found_pages <= stats.probed_pages, stats
            assert stats.fetched_pages + stats.rejected_pages + stats.fetch_failures <= stats.found_pages, stats

    def restart_store(self) -> None:
        """The store loses every object (a restart): pages computed afterwards are stored again."""
        with self._operation("restart_store"):
            assert self.store is not None
            self.store.memory.restart()
