"""``LruOrder``: eviction-list positions remembered so that a refused batch request leaves the LRU order as it
found it."""

from __future__ import annotations

from .page import Page, PriorityLru


class LruOrder:
    """Eviction-list positions of pages remembered before a step that may end up refused (a request a batch
    admission rejects), so that step can leave the LRU order as it found it."""

    def __init__(self) -> None:
        self._seen: set[int] = set()
        self._entries: list[tuple[Page, int, int, PriorityLru]] = []

    def remember(self, page: Page) -> None:
        queue = page.queue
        if queue is not None and id(page) not in self._seen:
            self._seen.add(id(page))
            self._entries.append((page, page.generation, page.stamp, queue))

    def restore(self, used: set[int] | None = None) -> None:
        """Every remembered page that is back in the list it was in returns to its old position there (not one
        dropped meanwhile whose object holds other content now, nor one in ``used``: ids of pages a step that
        was not refused used, such as the snapshot an admitted request copied, filed as used now)."""
        kept = used or set()
        queues: list[PriorityLru] = []
        moved: list[list[tuple[int, Page]]] = []
        for page, generation, stamp, queue in self._entries:
            if page.generation != generation or page.queue is not queue or page.stamp == stamp or id(page) in kept:
                continue
            for position, known in enumerate(queues):
                if known is queue:
                    moved[position].append((stamp, page))
                    break
            else:
                queues.append(queue)
                moved.append([(stamp, page)])
        for queue, entries in zip(queues, moved):
            queue.restore(entries)
