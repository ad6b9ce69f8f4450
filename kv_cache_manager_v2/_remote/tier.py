"""The remote tier: committed pages shared through a store many instances use (Mooncake Store), keyed by content.

It is not a tier of slots: the store keeps objects, not rows of a pool this process could address, and a page
read back must land in a local slot before a kernel can see it. So pages leave by being copied out into a
staging array (when the coldest local tier drops them, and at commit with ``write_through``) and are sent in one
batch when the manager's call ends; they come back when a prefix match misses locally: the store is probed for the
missing blocks' keys and what one servable prefix needs is fetched into slots of the coldest local tier, where the
blocks become ordinary cached tree blocks that ``resume`` onboards like any other.

Keys: ``kvm2/<layout digest>/lg<life cycle>/pg<pool group>/<block name>``. The block name is the chained SHA-256
over the reuse scope and every token so far (the one prefix reuse uses), or with the config's ``secret_key`` an HMAC
of it; the layout digest covers tokens per block, every life cycle's kind, every field of every layer config (a
layer's bytes depend on the layers before it), the pool slot sizes and the config's ``namespace`` (model, dtype), so
no other model's object is read as ours. Objects are framed: magic, format version, payload size and a digest of key
and payload (BLAKE2b, or with a secret a MAC, whose identifier the layout digest covers too: another secret, another
key space, ``objects.KeySpace``); anything else (short, long, corrupt, forged, another key's object) is rejected and
removed from the store. Pages are written in the current secret's key space and looked up there first, then in each
of ``previous_secret_keys``' (one probe batch), each checked with its own secret.
Store failures are misses, counted and logged, never errors: after one the tier stays away ``retry_after_s``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Final, Sequence

import numpy as np

from .._base.hashing import ReuseScope, Token, block_key, root_key
from .._base.interrupts import DeferredInterrupts
from .._model.life_cycle import LifeCycle
from .._pages.page import Block, Page
from .._pages.radix_tree import RadixTree
from .._pages.partial_siblings import leave_tree
from .objects import HEADER, frame, key_spaces, unframe
from .page_bytes import read_slot, write_slot
from .statistics import RemoteTierStatistics
from .._base.remote_store import FAILED, MISSING, TOO_LARGE, HostBuffer, RemoteStore, answered_flags, answered_lengths
from .._base.types import DEFAULT_PRIORITY, LifeCycleId
from .._base.wording import counted

if TYPE_CHECKING:
    from .._model.layout import StorageLayout
    from .._pages.page_store import PageStore
    from ..config import LayerConfig, RemoteCacheTierConfig

# Keys this instance stored or fetched, so a page is not sent twice (bounded: forgetting one costs a re-send;
# forgotten all at once when a probe misses one of them).
MAX_KNOWN_KEYS: Final = 1 << 16
# Captured bytes that trigger a send before the call ends (a shutdown or a big eviction drops many pages at once).
MAX_PENDING_BYTES: Final = 64 << 20

logger = logging.getLogger("kv_cache_manager_v2.remote")


class RemoteTier:
    """Moves committed pages between this manager's coldest tier and a shared store (see the module docstring)."""

    def __init__(
        self,
        store: RemoteStore,
        config: RemoteCacheTierConfig,
        layers: Sequence[LayerConfig],
        life_cycles: list[LifeCycle],
        layout: StorageLayout,
        tokens_per_block: int,
        page_store: PageStore,
        tree: RadixTree,
        interrupts: DeferredInterrupts,
    ) -> None:
        self._store = store
        # Where an interrupt the store raised goes: the end of the call (``DeferredInterrupts``).
        self._interrupts = interrupts
        self._write_through = config.write_through
        self._retry_after_s = config.retry_after_s
        self._bulk_write_back_deadline_s = config.bulk_write_back_deadline_s
        # A bulk write-back sends nothing from then on (``begin_bulk_write_back``); inf outside one.
        self._close_by = math.inf
        self._life_cycles = life_cycles
        self._tokens_per_block = tokens_per_block
        self._page_store = page_store
        self._tree = tree
        # Where pages are written (the first) and looked up (in order): one per secret (``objects.KeySpace``).
        self._spaces = key_spaces(config, tokens_per_block, layers, life_cycles, layout)
        groups = [layout.pool_groups[layout.life_cycle_pool_group[lc.id]] for lc in life_cycles]
        self._pool_slot_bytes = [list(group.pool_slot_bytes) for group in groups]
        self._pending_keys: list[str] = []
        self._pending: list[HostBuffer] = []
        self._pending_bytes = 0
        self._known: dict[str, None] = {}
        self._down_until = 0.0
        self.stats: RemoteTierStatistics = RemoteTierStatistics()

    # ----------------------------------------------------------------------------------------------- writing
    def committed(self, page: Page) -> None:
        """A page just became a tree block's content: stored now with ``write_through``."""
        if self._write_through:
            self.capture(page)

    def capture(self, page: Page) -> None:
        """Copy a committed full block's page out for the next ``send`` (its slot may be reused right after)."""
        key = self._key(page)
        if key is None or key in self._known:
            return
        if time.monotonic() >= self._close_by:
            self.stats.dropped_by_bulk_write_back += 1
            return
        if self._backing_off():
            self.stats.skipped_while_down += 1
            return
        order = self._page_store.stream_order
        with order.host_access():  # an engine's stream may still be writing the page it commits (write-through)
            self._page_store.run_recorded_copies()  # the slot's bytes may still be on their way in
            if page.lost:  # ... and never arrived
                return
            with order.copies_on(0):  # after those copies, which ran on stream 0
                try:
                    pools = self._page_store.pools(page.level, page.pool_group)
                    payload = read_slot(pools, self._pool_slot_bytes[page.life_cycle], page.slot)
                except OSError as error:  # a failing disk tier file: the page is not stored, nothing else changes
                    self.stats.warnings += 1
                    # Text, not the error: a handler keeping the record would keep its traceback's frames.
                    self._interrupts.warn(
                        logger, "remote tier: reading a disk tier page to store it failed: %s", str(error)
                    )
                    return
        framed: HostBuffer = np.empty(HEADER.size + payload.nbytes, dtype=np.uint8)
        frame(self._spaces[0].hasher, key, payload, framed)
        self._pending_keys.append(key)
        self._pending.append(framed)
        self._pending_bytes += framed.nbytes
        if self._pending_bytes >= MAX_PENDING_BYTES:
            self.send()

    def send(self) -> None:
        """Store the pages captured since the last send, in one batch."""
        if not self._pending_keys:
            return
        keys, buffers = self._pending_keys, self._pending
        self._pending_keys, self._pending = [], []
        self._pending_bytes = 0
        if time.monotonic() >= self._close_by:
            self.stats.dropped_by_bulk_write_back += len(keys)
            return
        try:  # the answer is read inside: a result that raises as it is read is the store's failure too
            answer: object = self._store.put_batch(keys, buffers)
            stored, _, well_formed = answered_flags(answer, len(keys))
        except BaseException as error:  # any store failure is a miss, never the caller's error
            self._interrupts.defer(error)
            self.stats.store_failures += len(keys)
            self._fail(f"storing {counted(len(keys), 'page')} failed: {error}")
            return
        if not well_formed:
            self._malformed("put_batch", len(keys), answer)
        refused = 0
        for key, buffer, ok in zip(keys, buffers, stored):
            if ok:
                self._remember(key)
                self.stats.stored_pages += 1
                self.stats.stored_bytes += buffer.nbytes
            else:
                refused += 1
        if refused:
            self.stats.store_failures += refused
            self.stats.warnings += 1
            self._interrupts.warn(
                logger, "remote tier: the store refused %d of %s (full?)", refused, counted(len(keys), "page")
            )

    # ----------------------------------------------------------------------------------------------- reading
    def fetch_prefix(
        self, scope: ReuseScope | None, tokens: list[Token], local_length: int, partial_blocks: Sequence[Block] = ()
    ) -> bool:
        """After a local match of ``local_length`` tokens, fetch from the store the pages that extend it the
        furthest (a servable length for every life cycle) into the coldest local tier, as cached tree blocks; whether
        it changed the tree (else the local match stands). The local match's pages (its ``partial_blocks``' too) are
        kept while eviction makes room: a failed fetch must leave that match intact. A fill planned on objects the
        store lost after the probe found them (a get answering MISSING) is planned once more from what it fetched:
        it would otherwise end where the hole is, or serve nothing where a layer group reads only the prefix's end
        (an SSM snapshot, a window's last blocks), though the store holds a shorter prefix whole."""
        changed, lost = self._fetch(scope, tokens, local_length, partial_blocks)
        if lost:
            changed = self._fetch(scope, tokens, local_length, partial_blocks)[0] or changed
        return changed

    def _fetch(
        self, scope: ReuseScope | None, tokens: list[Token], local_length: int, partial_blocks: Sequence[Block]
    ) -> tuple[bool, int]:
        """One fill (``fetch_prefix``): whether it changed the tree, and how many of its pages the store no longer
        held when they were read."""
        tpb = self._tokens_per_block
        num_full = len(tokens) // tpb
        if local_length >= num_full * tpb:
            return False, 0
        if self._backing_off():
            self.stats.skipped_while_down += 1
            return False, 0
        keys = self._block_keys(scope, tokens, num_full)
        local = self._local_blocks(scope, tokens, num_full)
        # A page not covering its block (a shorter sibling's, partial reuse) serves no match past it: probed like a
        # missing one, and a fetched page takes its place (``_read_into``).
        probes: list[tuple[int, int]] = []
        for ordinal in range(num_full):
            block = local[ordinal] if ordinal < len(local) else None
            for life_cycle in self._life_cycles:
                page = None if block is None else block.pages[life_cycle.id]
                if page is None or not page.covers_its_block:
                    probes.append((ordinal, life_cycle.id))
        first = probes[0][0] if probes else num_full  # probes go by ordinal: each block named once per key space
        probe_keys: list[str] = []
        for key_space in self._spaces:  # the current secret's keys first, then each previous secret's
            names = [key_space.name(key) for key in keys[first:]]
            probe_keys += [key_space.prefixes[lc] + names[ordinal - first] for ordinal, lc in probes]
        self.stats.probed_pages += len(probes)
        try:
            answer: object = self._store.exists_batch(probe_keys)
            exists, answered, well_formed = answered_flags(answer, len(probe_keys))
        except BaseException as error:  # a failure is a miss; an interrupt comes out at the call's end
            self._interrupts.defer(error)
            self.stats.probe_failures += len(probes)
            self._fail(f"probing {counted(len(probe_keys), 'key')} failed: {error}")
            return False, 0
        if not well_formed:
            self._malformed("exists_batch", len(probe_keys), answer)
            self.stats.probe_failures += _unanswered_pages(exists, answered, len(probes))
        if any(valid and not hit and key in self._known for key, hit, valid in zip(probe_keys, exists, answered)):
            self._known.clear()  # the store lost objects it had from us (restarted empty, evicted): store anew
        found: list[tuple[int, int, str, int]] = []  # (ordinal, life cycle, key, key space): the first space holding it
        for index, (ordinal, lc) in enumerate(probes):
            for space in range(len(self._spaces)):
                at = space * len(probes) + index
                if exists[at]:
                    found.append((ordinal, lc, probe_keys[at], space))
                    break
        self.stats.found_pages += len(found)
        target = self._servable_blocks(local, found, num_full, local_length // tpb)
        if target == 0:
            return False, 0
        target_length = target * tpb
        life_cycles = self._life_cycles
        wanted = [hit for hit in found if hit[0] < target and life_cycles[hit[1]].reads_block(hit[0], target_length)]
        kept = local[:target] + list(partial_blocks)
        return True, self._install(scope, tokens, kept, wanted, target)

    def _servable_blocks(
        self, local: list[Block], found: list[tuple[int, int, str, int]], num_full: int, floor: int
    ) -> int:
        """The most full blocks (more than ``floor``) every life cycle can serve with local and found pages."""
        present = [[False] * num_full for _ in self._life_cycles]
        for ordinal, block in enumerate(local):
            for lc, page in enumerate(block.pages):
                if page is not None and page.covers_its_block:
                    present[lc][ordinal] = True
        for ordinal, lc, _, _ in found:
            present[lc][ordinal] = True
        counts: list[list[int]] = []
        for flags in present:
            running = [0]
            for flag in flags:
                running.append(running[-1] + (1 if flag else 0))
            counts.append(running)
        for blocks in range(num_full, floor, -1):
            length = blocks * self._tokens_per_block
            if all(life_cycle.servable(length, counts[life_cycle.id]) for life_cycle in self._life_cycles):
                return blocks
        return 0

    def _install(
        self,
        scope: ReuseScope | None,
        tokens: list[Token],
        kept: list[Block],
        wanted: list[tuple[int, int, str, int]],
        target: int,
    ) -> int:
        """Fetch ``wanted`` (ordinal, life cycle, key, key space) pages into new cold-tier slots and hang them in the
        tree; the pages of ``kept`` blocks are claimed meanwhile. How many the store no longer held
        (``_read_into``)."""
        store = self._page_store
        tpb = self._tokens_per_block
        claimed: list[Page] = []
        for block in kept:
            for page in block.pages:
                if page is not None:
                    store.claim(page)  # eviction for the new slots must not take the prefix being extended
                    claimed.append(page)
        by_ordinal: list[list[tuple[int, str, int]]] = [[] for _ in range(target)]
        for ordinal, lc, key, space in wanted:
            by_ordinal[ordinal].append((lc, key, space))
        parent = self._tree.root(scope)
        # The fill pins every block on its path until it ends: evicting for its slots may empty one of them (a block
        # whose pages were dropped, kept only by a child), and a pruned block object is soon another prompt's.
        pinned = [parent]
        parent.users += 1
        deepest = parent
        fetches: list[tuple[Block, Page, str, int]] = []
        for ordinal in range(target):
            block = self._tree.add_child(parent, tuple(tokens[ordinal * tpb : (ordinal + 1) * tpb]))
            block.users += 1
            pinned.append(block)
            deepest = block
            short = False
            for lc, key, space in by_ordinal[ordinal]:
                page = store.obtain_cold_page(LifeCycleId(lc), DEFAULT_PRIORITY)
                if page is None:
                    short = True
                    break
                store.claim(page)
                claimed.append(page)
                fetches.append((block, page, key, space))
            if short:
                self.stats.no_room_pages += len(wanted) - len(fetches)
                break
            parent = block
        order = store.stream_order
        with order.host_access():  # the fetched bytes land before any stream reads the slots
            store.run_recorded_copies()  # slots just freed by eviction may have copies still reading them
            with order.copies_on(0):
                lost = self._read_into(fetches)
        for page in claimed:
            store.unclaim(page)
            if page.block is None:  # a rejected fetch, or a shorter sibling's page that gave way to a fetched one
                store.free_if_unused(page)
        for block in pinned:
            block.users -= 1
        self._tree.prune(deepest)
        return lost

    def _read_into(self, fetches: list[tuple[Block, Page, str, int]]) -> int:
        """Fill the fetched pages and hang them in the tree; those that could not be filled stay out of it (still
        claimed: the caller frees them once it lets go of its claims). How many the store answered MISSING for."""
        if not fetches:
            return 0
        sizes = [HEADER.size + sum(self._pool_slot_bytes[page.life_cycle]) for _, page, _, _ in fetches]
        buffers: list[HostBuffer] = [np.empty(size, dtype=np.uint8) for size in sizes]
        keys = [key for _, _, key, _ in fetches]
        answer: object = [FAILED] * len(keys)
        try:
            answer = self._store.get_batch(keys, buffers)
            lengths, well_formed = answered_lengths(answer, len(keys))
        except BaseException as error:  # a failure is a miss; an interrupt comes out at the call's end
            self._interrupts.defer(error)
            self._fail(f"fetching {counted(len(keys), 'page')} failed: {error}")
            lengths, well_formed = [FAILED] * len(keys), True
        if not well_formed:
            self._malformed("get_batch", len(keys), answer)
        rejected: list[str] = []
        lost = 0
        for (block, page, key, space), buffer, length in zip(fetches, buffers, lengths):
            hasher = self._spaces[space].hasher  # the secret of the key space it was found in
            payload = None if length in (MISSING, FAILED, TOO_LARGE) else unframe(hasher, key, buffer, length)
            if payload is None:
                if length in (MISSING, FAILED):
                    self.stats.fetch_failures += 1
                    if length == MISSING:  # found by the probe, gone since
                        lost += 1
                else:
                    if length == TOO_LARGE or 0 <= length <= buffer.nbytes:  # what the store holds, not a bad answer
                        rejected.append(key)
                    self.stats.rejected_pages += 1
                    self.stats.warnings += 1
                    self._interrupts.warn(
                        logger, "remote tier: rejected object %s (%d bytes: wrong size, format or digest)", key, length
                    )
                continue
            try:
                pools = self._page_store.pools(page.level, page.pool_group)
                write_slot(pools, self._pool_slot_bytes[page.life_cycle], page.slot, payload)
            except OSError as error:  # a failing disk tier file: a miss, the page stays out of the tree
                self.stats.fetch_failures += 1
                self.stats.warnings += 1
                self._interrupts.warn(
                    logger, "remote tier: writing fetched page %s to the disk tier failed: %s", key, str(error)
                )
                continue
            if space == 0:
                self._remember(key)  # before attaching: write-through must not send it back
            else:  # attaching stores it under the current secret with write-through, as if just committed
                self.stats.fetched_previous_secret_pages += 1
            shorter = block.pages[page.life_cycle]
            if shorter is not None:
                leave_tree(self._page_store, shorter)  # a shorter sibling's page, moved in (partial_siblings.py)
            self._tree.attach(block, page)
            self.stats.fetched_pages += 1
            self.stats.fetched_bytes += length
        if rejected:
            self._remove_rejected(rejected)
        return lost

    def _remove_rejected(self, keys: list[str]) -> None:
        """Remove objects no instance can accept: a store keeping a key's first object (Mooncake) refuses the rest."""
        for key in keys:
            self._known.pop(key, None)
        try:
            self._store.remove_batch(keys)
        except BaseException as error:  # a failure is a miss; an interrupt comes out at the call's end
            self._interrupts.defer(error)
            self._fail(f"removing {counted(len(keys), 'rejected object')} failed: {error}")

    # ---------------------------------------------------------------------------------------------- plumbing
    def begin_bulk_write_back(self) -> None:
        """Every cached page is dropped next (``shutdown``, ``clear_reusable_blocks``): until
        ``end_bulk_write_back`` no put starts past ``bulk_write_back_deadline_s`` or after a failed one (a short
        ``retry_after_s`` would let each 64 MiB batch wait a stalled store's whole put deadline)."""
        self._close_by = time.monotonic() + self._bulk_write_back_deadline_s

    def end_bulk_write_back(self) -> None:
        """Send what the drops left pending, still under the bound, then let puts run as usual again (the manager
        goes on after ``clear_reusable_blocks``: neither the deadline nor a failed put's stop may stick)."""
        self.send()
        self._close_by = math.inf

    def close(self) -> None:
        """Send what is pending, then disconnect."""
        self.send()
        try:
            self._store.close()
        except BaseException as error:  # a failure is a miss; an interrupt comes out at the call's end
            self._interrupts.defer(error)
            self._fail(f"closing the store client failed: {error}")

    def _key(self, page: Page) -> str | None:
        block = page.block
        if block is None or len(block.tokens) != self._tokens_per_block or page.num_tokens != len(block.tokens):
            return None  # a partial block, or a shorter sibling's page moved into a full one
        space = self._spaces[0]
        return space.prefixes[page.life_cycle] + space.name(block.key)

    def _block_keys(self, scope: ReuseScope | None, tokens: list[Token], num_blocks: int) -> list[bytes]:
        tpb = self._tokens_per_block
        keys: list[bytes] = []
        key = root_key(scope)
        for ordinal in range(num_blocks):
            key = block_key(key, tokens[ordinal * tpb : (ordinal + 1) * tpb])
            keys.append(key)
        return keys

    def _local_blocks(self, scope: ReuseScope | None, tokens: list[Token], num_blocks: int) -> list[Block]:
        """The tree's full blocks along the first ``num_blocks`` blocks of ``tokens`` from the scope's root, as far
        as they go."""
        tpb = self._tokens_per_block
        blocks: list[Block] = []
        node: Block | None = self._tree.find_root(scope)
        for ordinal in range(num_blocks):
            if node is None:
                break
            node = self._tree.child(node, tuple(tokens[ordinal * tpb : (ordinal + 1) * tpb]))
            if node is not None:
                blocks.append(node)
        return blocks

    def _remember(self, key: str) -> None:
        known = self._known
        known[key] = None
        if len(known) > MAX_KNOWN_KEYS:
            del known[next(iter(known))]

    def _backing_off(self) -> bool:
        return self._down_until > 0.0 and time.monotonic() < self._down_until

    def _malformed(self, call: str, count: int, answer: object) -> None:
        """A backend answered a batch of ``count`` keys with something else than one result per key: what is
        missing or of the wrong type counts as a failure for its key (``answered_flags`` / ``answered_lengths``)."""
        self.stats.warnings += 1
        self._interrupts.warn(
            logger, "remote tier: the store's %s answered %s with %.200r", call, counted(count, "key"), answer
        )

    def _fail(self, message: str) -> None:
        """A store failure: count, warn, and stay away for ``retry_after_s``."""
        self.stats.warnings += 1
        self._down_until = time.monotonic() + self._retry_after_s
        if self._close_by < math.inf:  # in a bulk write-back: it ends here
            self._close_by = 0.0
        self._interrupts.warn(
            logger, "remote tier: %s; treating the store as down for %.1f s", message, self._retry_after_s
        )


def _unanswered_pages(exists: list[bool], answered: list[bool], num_pages: int) -> int:
    """Of a probe's ``num_pages`` pages (each looked up once per key space, the spaces one after another), those
    found under no key space and not answered under at least one: their lookup failed, not only missed."""
    failed = 0
    for page in range(num_pages):
        keys = range(page, len(exists), num_pages)
        if not any(exists[key] for key in keys) and not all(answered[key] for key in keys):
            failed += 1
    return failed
