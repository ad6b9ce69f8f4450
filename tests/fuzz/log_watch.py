"""The fuzzer's logging handler (``FuzzWorld.log_watch``): the warnings the manager logs (a failed page move, a
remote store failing or answering a bad object, a disk pool file refusing; ``fault_ops`` and the flaky store cause
them) must reach the handlers once the call has ended, never in the middle of it. So this handler, like a monitor
would, calls the manager on every warning: ``check_invariants``, which a call in flight refuses with
``RuntimeError`` (raised out of the call that logged, failing the operation) and which otherwise checks the state
that call left."""

from __future__ import annotations

import logging

from kv_cache_manager_v2 import KVCacheManager

LOGGER = "kv_cache_manager_v2"


class LogWatch(logging.Handler):
    """Attached to the package's logger for a world's life (``close`` detaches it)."""

    def __init__(self, manager: KVCacheManager) -> None:
        super().__init__(logging.WARNING)
        self.manager = manager
        self.records = 0
        logging.getLogger(LOGGER).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records += 1
        if not self.manager.is_shut_down:
            self.manager.check_invariants()

    def close(self) -> None:
        logging.getLogger(LOGGER).removeHandler(self)
        super().close()
