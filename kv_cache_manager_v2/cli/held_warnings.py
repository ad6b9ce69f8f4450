"""The package's log records held while an app builds a manager: the manager warns in its config's words (a
``typical_step`` the user of the app never wrote), so the app checks the same thing first, says it in its own flags'
words, and lets through only what its check did not replace."""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Callable


class HeldWarnings:
    """A context: while inside it, the package logger's records are kept instead of emitted; ``release`` emits
    them afterwards, less those ``replaced`` says the app has said better."""

    def __init__(self) -> None:
        self.records: list[logging.LogRecord] = []
        self._logger = logging.getLogger("kv_cache_manager_v2")

    def __enter__(self) -> HeldWarnings:
        self._logger.addFilter(self._hold)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._logger.removeFilter(self._hold)

    def release(self, replaced: Callable[[logging.LogRecord], bool] = lambda record: False) -> None:
        records, self.records = self.records, []
        for record in records:
            if not replaced(record):
                self._logger.handle(record)

    def _hold(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False
