"""The remote tier's operations (``remote_fills`` config only): a closed request asked again (its blocks come
back from the store), the same request served by a second instance sharing the store (of the same deployment, of
another model, of another deployment: without the world's ``secret_key``, or of the same deployment rotated to a new
secret, the world's listed as previous), a store answering its next calls badly, and a store restarting empty."""

from __future__ import annotations

from dataclasses import replace
from typing import Final, Sequence

from kv_cache_manager_v2 import AttentionLayerConfig, KVCacheManager, KVCacheManagerConfig
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine, contextual_tokens
from tests.fuzz.event_replay import EventReplay
from tests.fuzz.flaky_store import STORE_FAULTS
from tests.fuzz.model import CacheModel, pick, scope_context
from tests.fuzz.world import FuzzWorld

# ``twin_serves``' instances: the same deployment, another model, another deployment (the same model, no secret),
# the same deployment rotated (a new secret, the world's one previous: it reads the world's pages).
TWIN_KINDS: Final = 4
TWIN_CONTEXTS: Final = ("", "other model/", "other deployment/", "")
ROTATED_SECRET: Final = bytes(range(64, 96))


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

    def twin_serves(self, index: int, suffix: int, kind: int) -> None:
        """A second instance sharing the store serves a closed request's committed tokens and a few more; what it
        fetches is checked against its own contextual records, what it computes is written through (for
        ``refetch`` to fetch into the first instance). ``kind`` (of ``TWIN_KINDS``) 0: the same deployment, which
        reads the first instance's pages; 1: another model (each windowed layer attends over one more sink token,
        the same whole sink blocks: pages of other bytes); 2: another deployment of the same model (no
        ``secret_key``: another key space; its records are told apart as another model's would be, so reading
        the first instance's pages fails the check); 3: the same deployment rotated to a new secret with the
        world's as ``previous_secret_keys``, which reads the first instance's pages (checked with the world's
        secret) and stores them again under its own. 1 and 2 must never read them. Store faults hit every
        instance's calls."""
        with self._operation("twin_serves"):
            old = pick(self.closed, index)
            assert old is not None
            kind %= TWIN_KINDS
            twin = self.twins.get(kind)
            if twin is None:  # the same FlakyStoreConfig: the same objects
                twin = KVCacheManager(twin_config(self.manager.config, kind))
                self.twins[kind] = twin
                self.twin_events[kind] = EventReplay(twin)
            prompt = old.tokens[: old.committed] + self._fresh(suffix % 9)
            written = contextual_tokens(prompt, TWIN_CONTEXTS[kind] + scope_context(old.scope))
            engine = FakeEngine(twin, self.config.index_mode)
            cache = twin.create_kv_cache(old.scope, prompt)
            try:
                reused = cache.num_committed_tokens
                if cache.resume():
                    before = engine.tokens_checked
                    engine.check(cache, written)
                    self.stats.tokens_checked += engine.tokens_checked - before
                    if reused < len(prompt) and cache.resize(len(prompt)):
                        engine.step(cache, written)
                        cache.commit(prompt[reused:])
            finally:
                cache.close()
            twin.check_invariants()

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


def twin_config(config: KVCacheManagerConfig, kind: int) -> KVCacheManagerConfig:
    """The config of ``twin_serves``' instance of ``kind``."""
    if kind == 1:
        return replace(config, layers=more_sinks(config.layers))
    remote = config.remote_tier
    if kind == 0 or remote is None:
        return config
    if kind == 3:
        secret = remote.secret_key
        if secret is None:
            return config
        remote = replace(remote, secret_key=ROTATED_SECRET, previous_secret_keys=(secret,))
    else:
        remote = replace(remote, secret_key=None)
    return replace(config, cache_tiers=[*config.cache_tiers[:-1], remote])


def more_sinks(layers: Sequence[LayerConfig]) -> list[LayerConfig]:
    """``layers`` with one more sink token in each windowed layer."""
    return [
        replace(layer, num_sink_tokens=(layer.num_sink_tokens or 0) + 1)
        if isinstance(layer, AttentionLayerConfig) and layer.sliding_window_size is not None
        else layer
        for layer in layers
    ]
