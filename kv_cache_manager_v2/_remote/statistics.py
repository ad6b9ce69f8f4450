"""What the remote tier counts: ``RemoteTierStatistics``, read through ``KVCacheManager.get_remote_tier_statistics``."""

from __future__ import annotations

from typing import final

from .._base.types import Sealed


@final
class RemoteTierStatistics(Sealed):
    """What the remote tier did since the manager started (pages are one block of one layer group).

    ``stored_*``: sent and acknowledged; ``store_failures``: pages the store refused (full) or could not take
    (down); ``probed_pages`` / ``found_pages``: pages looked up after a local miss and how many existed;
    ``probe_failures``: of the pages looked up, those whose lookup failed (the store raised, or answered with
    something else than a bool for the page): a miss that says nothing about the store's content;
    ``fetched_*``: read back, verified and installed; ``fetched_previous_secret_pages``: of those, found under one of
    ``previous_secret_keys`` (stored again under ``secret_key`` with write-through; once it stays 0, a rotation is
    over: the previous secrets can go); ``rejected_pages``: read back but wrong size, format or digest
    (corrupt, or forged without the secret; removed, so an honest copy can take the key); ``fetch_failures``: found
    but not readable (evicted meanwhile, store down); ``no_room_pages``: not fetched for lack of a local slot;
    ``skipped_while_down``: operations not tried during a back-off; ``dropped_by_bulk_write_back``: pages a bulk
    write-back (``shutdown``, ``clear_reusable_blocks``) left unsent, its ``bulk_write_back_deadline_s`` passed or
    a put failed during it; ``warnings``: warnings logged (one per failure)."""

    def __init__(self) -> None:
        self.stored_pages = 0
        self.stored_bytes = 0
        self.store_failures = 0
        self.probed_pages = 0
        self.found_pages = 0
        self.probe_failures = 0
        self.fetched_pages = 0
        self.fetched_bytes = 0
        self.fetched_previous_secret_pages = 0
        self.rejected_pages = 0
        self.fetch_failures = 0
        self.no_room_pages = 0
        self.skipped_while_down = 0
        self.dropped_by_bulk_write_back = 0
        self.warnings = 0

    def snapshot(self) -> RemoteTierStatistics:
        """A copy that later activity does not change."""
        copy = RemoteTierStatistics()
        copy.stored_pages = self.stored_pages
        copy.stored_bytes = self.stored_bytes
        copy.store_failures = self.store_failures
        copy.probed_pages = self.probed_pages
        copy.found_pages = self.found_pages
        copy.probe_failures = self.probe_failures
        copy.fetched_pages = self.fetched_pages
        copy.fetched_bytes = self.fetched_bytes
        copy.fetched_previous_secret_pages = self.fetched_previous_secret_pages
        copy.rejected_pages = self.rejected_pages
        copy.fetch_failures = self.fetch_failures
        copy.no_room_pages = self.no_room_pages
        copy.skipped_while_down = self.skipped_while_down
        copy.dropped_by_bulk_write_back = self.dropped_by_bulk_write_back
        copy.warnings = self.warnings
        return copy

    def __repr__(self) -> str:
        return (
            f"RemoteTierStatistics(stored_pages={self.stored_pages}, stored_bytes={self.stored_bytes}, "
            f"store_failures={self.store_failures}, probed_pages={self.probed_pages}, found_pages={self.found_pages}, "
            f"probe_failures={self.probe_failures}, "
            f"fetched_pages={self.fetched_pages}, fetched_bytes={self.fetched_bytes}, "
            f"fetched_previous_secret_pages={self.fetched_previous_secret_pages}, rejected_pages={self.rejected_pages}, "
            f"fetch_failures={self.fetch_failures}, no_room_pages={self.no_room_pages}, "
            f"skipped_while_down={self.skipped_while_down}, "
            f"dropped_by_bulk_write_back={self.dropped_by_bulk_write_back}, warnings={self.warnings})"
        )
