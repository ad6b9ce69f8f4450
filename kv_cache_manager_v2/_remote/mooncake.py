"""Mooncake Store as the remote tier's backend: ``MooncakeDistributedStore`` over its zero-copy batch calls.

Needs the ``mooncake`` extra (``mooncake-transfer-engine-non-cuda``, which needs Debian's ``libibverbs1`` even over
tcp) and a running ``mooncake_master`` with its HTTP metadata server. Objects move straight between the store and
the tier's staging arrays (``batch_put_from`` / ``batch_get_into`` take their addresses): no Python ``bytes``
copies. Over tcp the arrays need no registration; RDMA would want them registered (``register_buffer``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Final, final

from mypy_extensions import mypyc_attr

from .._base.remote_store import FAILED, MISSING, TOO_LARGE, HostBuffer, RemoteStore, RemoteStoreError
from .._base.validation import as_float, coerce_fields, refuse_subclass
from .._base.wording import counted

OBJECT_NOT_FOUND: Final = -704  # Mooncake's ErrorCode::OBJECT_NOT_FOUND
BUFFER_TOO_SMALL: Final = -600  # what get_into answers (0.3.13) for an object larger than the buffer
TRANSFER_FAIL: Final = -800  # Mooncake's ErrorCode::TRANSFER_FAIL: the bytes may still move after the call
RPC_FAIL: Final = -900  # Mooncake's ErrorCode::RPC_FAIL: the master did not answer (a dead one: after ~4.3 s)
MAX_HELD_BYTES: Final = 256 << 20
"""Bytes of buffers a client keeps for transfers that failed (``MooncakeStore``); past it, it makes no more."""
CLOSE_WAIT_S: Final = 1.0
"""How long ``MooncakeStore.close`` (the manager's ``shutdown``) waits for transfers left past their deadline."""
DEFAULT_LOCAL_BUFFER: Final = 16 << 20

# Buffers of transfers that failed or were abandoned: Mooncake may still write into (or read) them once a stalled
# storage node answers, also after the client and its manager are closed or dropped, so they live as long as the
# process (each client stops transferring once it kept ``MAX_HELD_BYTES``).
_KEPT_FOR_LATE_TRANSFERS: Final[list[HostBuffer]] = []


@final
@mypyc_attr(native_class=False)
@dataclass
class MooncakeStoreConfig:
    """Where the Mooncake master and its metadata server run, and how this client joins them.

    ``master_address`` is ``host:port`` of ``mooncake_master``'s RPC service, ``metadata_url`` its HTTP metadata
    server (``http://host:port/metadata``); ``local_hostname`` is the address other clients reach this one at;
    ``protocol`` ``"tcp"`` (or ``"rdma"`` with ``device_names``); ``local_buffer_size`` the client's own transfer
    buffer in bytes. ``get_deadline_s``: a get not done by then is a miss and the store counts as down (the tier's
    ``retry_after_s``): a storage node cut off while the master still lists it otherwise holds the fetch for
    Mooncake's transfer timeouts, 60 s by default. ``put_deadline_s`` bounds a put the same way (the pages are not
    stored, the store counts as down). Two fields, as the two weigh different things: past a get's deadline the
    request computes its prefix instead (the wait is traded against prefill time), while a put blocks the commit
    writing through for nothing the caller waits on (a deployment may want it much shorter), and a put's batch
    (up to 64 MiB) may take longer than a prefix's get.
    """

    master_address: str
    metadata_url: str
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_names: str = ""
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER
    get_deadline_s: float = 10.0
    put_deadline_s: float = 10.0

    @classmethod
    def __init_subclass__(cls) -> None:
        refuse_subclass(cls, "MooncakeStoreConfig")

    def __post_init__(self) -> None:
        coerce_fields(
            self,
            ints=("local_buffer_size",),
            strs=("master_address", "metadata_url", "local_hostname", "protocol", "device_names"),
        )
        for name in ("master_address", "metadata_url", "local_hostname", "protocol"):
            if not getattr(self, name):
                raise ValueError(f"MooncakeStoreConfig.{name} must be a non-empty string")
        if self.local_buffer_size <= 0:
            raise ValueError(f"MooncakeStoreConfig.local_buffer_size must be > 0, got {self.local_buffer_size}")
        self.get_deadline_s = _deadline(self.__dict__["get_deadline_s"], "get_deadline_s")
        self.put_deadline_s = _deadline(self.__dict__["put_deadline_s"], "put_deadline_s")

    def open(self, quota: int) -> RemoteStore:
        """Connect, lending ``quota`` bytes to the store (its global segment); ``RemoteStoreError`` if it fails."""
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as error:
            raise RemoteStoreError(
                f"the Mooncake remote tier needs the mooncake extra (pip install 'kv_cache_manager_v2[mooncake]' "
                f"and apt-get install libibverbs1): {error}"
            ) from error
        client: Any = MooncakeDistributedStore()
        code: int | None = None
        try:
            code = client.setup(
                self.local_hostname,
                self.metadata_url,
                quota,
                self.local_buffer_size,
                self.protocol,
                self.device_names,
                self.master_address,
            )
            if code != 0:
                raise RemoteStoreError(
                    f"Mooncake setup failed with code {code} (master {self.master_address}, metadata "
                    f"{self.metadata_url})"
                )
            return MooncakeStore(client, self.get_deadline_s, self.put_deadline_s)
        except BaseException:
            # Setup holds the GIL: a Ctrl-C during it is raised as it returns, the client connected and lending
            # ``quota`` bytes to the store. A failed setup cleans up after itself; closing one never set up is safe.
            if code is None or code == 0:
                client.close()
            raise


class MooncakeStore:
    """A set-up ``MooncakeDistributedStore`` client behind the ``RemoteStore`` interface.

    Mooncake moves bytes straight from and into the caller's buffers, and a transfer it reports failed
    (``TRANSFER_FAIL``: a storage node that stopped answering for Mooncake's 60 s) may still complete once the node
    answers again: it wrote into the buffers of a get that had failed a minute before. Those buffers are the tier's
    transient arrays, freed and reused once the call returns, so that late write corrupted the heap (glibc abort)
    or could land in another object's bytes. Every buffer of a failed transfer is kept for the process's life (also
    past ``close``, or the store dropped unclosed: ``_KEPT_FOR_LATE_TRANSFERS``); once a client kept
    ``MAX_HELD_BYTES`` it makes no more transfers (``RemoteStoreError``: the tier's misses).
    """

    def __init__(
        self, client: Any, get_deadline_s: float = 10.0, put_deadline_s: float = 10.0,
        close_wait_s: float = CLOSE_WAIT_S,
    ) -> None:
        self._client: Any = client
        self._held_bytes = 0
        self._get_deadline_s = get_deadline_s
        self._put_deadline_s = put_deadline_s
        self._close_wait_s = close_wait_s
        self._stalled: list[threading.Thread] = []  # transfers past their deadline, still inside Mooncake

    @property
    def held_bytes(self) -> int:
        """Bytes of buffers kept because a transfer into or out of them failed and may still complete."""
        return self._held_bytes

    def put_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[bool]:
        """Bounded by ``put_deadline_s`` (``_bounded``): a stalled put may still read its buffers, which the tier
        drops once the call returns, so they are kept."""
        self._check_room()
        codes = self._bounded("batch_put_from", self._client.batch_put_from, keys, buffers, "put_deadline_s",
                              self._put_deadline_s)
        if any(code != 0 for code in codes):
            self._check_reachable("batch_put_from", codes)
        return [code == 0 for code in codes]

    def get_batch(self, keys: list[str], buffers: list[HostBuffer]) -> list[int]:
        """Bounded by ``get_deadline_s`` (``_bounded``): a miss after which the tier stays away."""
        self._check_room()
        codes = self._bounded("batch_get_into", self._client.batch_get_into, keys, buffers, "get_deadline_s",
                              self._get_deadline_s)
        if any(code < 0 and code not in (OBJECT_NOT_FOUND, BUFFER_TOO_SMALL) for code in codes):
            self._check_reachable("batch_get_into", codes)
        return [_get_result(code) for code in codes]

    def _bounded(
        self, name: str, call: Callable[[list[str], list[int], list[int]], list[int]], keys: list[str],
        buffers: list[HostBuffer], deadline_field: str, deadline_s: float,
    ) -> list[int]:
        """``call`` (a zero-copy batch transfer) on its own thread, its per-object codes. Past ``deadline_s`` the
        thread is left inside Mooncake (``close`` joins it), every buffer is kept, as the transfer may still read
        or write it, and it raises ``RemoteStoreError``. The buffers of objects that failed are kept too; what
        ``call`` raised comes out here, not as a stall."""
        answer: list[list[int]] = []
        raised: list[BaseException] = []
        addresses, sizes = _addresses(buffers), _sizes(buffers)

        def transfer_codes() -> None:
            try:
                answer.append(call(keys, addresses, sizes))
            except BaseException as error:  # re-raised on the caller's thread
                raised.append(error)

        transfer = threading.Thread(target=transfer_codes, name=f"mooncake-{name}", daemon=True)
        transfer.start()
        transfer.join(deadline_s)
        if raised:
            raise raised[0]
        if not answer:
            self._stalled.append(transfer)
            self._hold_failed_transfers([TRANSFER_FAIL] * len(buffers), buffers)
            raise RemoteStoreError(
                f"Mooncake {name} of {counted(len(keys), 'object')} did not answer within {deadline_field}="
                f"{deadline_s} s (a storage node cut off?)"
            )
        codes = answer[0]
        self._hold_failed_transfers(codes, buffers)
        return codes

    def exists_batch(self, keys: list[str]) -> list[bool]:
        codes: list[int] = self._client.batch_is_exist(keys)
        if any(code < 0 for code in codes):
            raise RemoteStoreError(f"Mooncake batch_is_exist failed (codes {sorted(set(codes))})")
        return [code == 1 for code in codes]

    def remove_batch(self, keys: list[str]) -> list[bool]:
        codes: list[int] = self._client.batch_remove(keys, True)
        return [code == 0 for code in codes]

    def close(self) -> None:
        """Waits at most ``close_wait_s`` (``CLOSE_WAIT_S``) for transfers left past their deadline: one stalled on a
        stopped storage node runs until Mooncake's transfer timeouts (60 s by default), and a serving engine shutting
        down must not hang that long. The client is closed once they end (on a thread of its own if they outlast the
        wait: closing it under a running call is not safe); the buffers kept for failed transfers outlive it."""
        deadline = time.monotonic() + self._close_wait_s
        for transfer in self._stalled:
            transfer.join(max(0.0, deadline - time.monotonic()))
        running = [transfer for transfer in self._stalled if transfer.is_alive()]
        self._stalled = []
        if running:
            closing = threading.Thread(target=_close_after, args=(self._client, running), name="mooncake-close",
                                       daemon=True)
            closing.start()
        else:
            self._client.close()

    def _hold_failed_transfers(self, codes: list[int], buffers: list[HostBuffer]) -> None:
        for code, buffer in zip(codes, buffers):
            if code == TRANSFER_FAIL:
                _KEPT_FOR_LATE_TRANSFERS.append(buffer)
                self._held_bytes += int(buffer.nbytes)

    def _check_room(self) -> None:
        if self._held_bytes >= MAX_HELD_BYTES:
            raise RemoteStoreError(
                f"Mooncake transfers that failed may still move {self._held_bytes} bytes of this client's buffers; "
                f"it makes no more transfers"
            )

    def _check_reachable(self, call: str, codes: list[int]) -> None:
        """A batch with failures: ``RemoteStoreError`` when the master did not answer, so the tier stays away for a
        while. ``health_check`` alone answers 0 with the master dead, and every later call of the client waited
        ~4.3 s for it: a commit writing through stalled that long, again and again."""
        if RPC_FAIL in codes:
            raise RemoteStoreError(f"Mooncake {call}: the master did not answer (RPC_FAIL)")
        status = self._client.health_check()
        if status != 0:
            raise RemoteStoreError(f"Mooncake store unreachable (health_check {status})")


def _close_after(client: Any, transfers: list[threading.Thread]) -> None:
    """Close ``client`` once ``transfers`` (calls inside it) ended."""
    for transfer in transfers:
        transfer.join()
    client.close()


def _get_result(code: int) -> int:
    if code >= 0:
        return code
    if code == OBJECT_NOT_FOUND:
        return MISSING
    return TOO_LARGE if code == BUFFER_TOO_SMALL else FAILED


def _addresses(buffers: list[HostBuffer]) -> list[int]:
    return [int(buffer.ctypes.data) for buffer in buffers]


def _sizes(buffers: list[HostBuffer]) -> list[int]:
    return [int(buffer.nbytes) for buffer in buffers]


def _deadline(value: object, name: str) -> float:
    deadline = as_float(value, f"MooncakeStoreConfig.{name}")
    if deadline <= 0:
        raise ValueError(f"MooncakeStoreConfig.{name} must be a finite float > 0, got {deadline!r}")
    return deadline
