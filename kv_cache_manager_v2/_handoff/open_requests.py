"""The decode side's requests whose sources it has not read yet: which cache each was made for and what it asked.

``KVReceiver.request`` sends a prompt and the receiving cache's counts; ``KVReceiver.read`` later pairs the
sender's answer with a cache's slots and READs into them. Nothing else ties the two calls together, so without
this record a read with another cache (one of the same length opened since, maybe in the very slots of the
request's cache, closed meanwhile) would receive a prompt's KV it was never computed for, and the sender's answer
would be trusted to cover what was asked. Here a read names its request's own cache or is refused before anything
is received, and the answer must be for the whole prompt at the counts sent. The sender may answer ahead and in any
order: an answer waits here for its read; one for a request given up (its read failed first, or its cache was
closed before the read) is dropped when it comes.

Nothing is kept for a request given up: the ids are handed out here, in increasing order, so an answer naming an id
handed out and no longer open is one to drop (given up, abandoned, or a second answer to one read), and one naming
an id never handed out is a ``TransferError``. A set of the ids given up, kept until their answers came, grew by
one id for each request dropped by the sender before it was served (never answered) or whose sender hung, for the
receiver's whole life.
"""

from __future__ import annotations

from typing import final

from .._base.hashing import Token
from .._cache.handle import state_of
from .._cache.cache_view import KVCacheStatus
from .._cache.kv_cache import CacheState
from .._manager.manager import KVCache
from .control_messages import ControlMessage, Failed, Sources, TransferError
from .transfer import KVSlice, SourcePlan
from .._base.wording import counted


@final
class AskedFor:
    """One request sent: the receiving cache's state (its identity: a cache id may be reused after a close, a
    state never is), the prompt (``read`` checks the cache still holds it: the engine may commit in between), the
    per-group counts, and the ``time.monotonic`` by which its READ must
    be done: ``timeout_s`` after the request went out, so before the sender's own wait (which starts later, at its
    answer) may give up and hand the pages it offered to another request, however late the engine reads."""

    def __init__(self, state: CacheState, tokens: list[Token], counts: list[int], deadline: float, thread: int) -> None:
        self.state = state
        self.thread = thread  # the thread that sent it: the one driving the manager
        self.tokens = tokens
        self.prompt_len = len(tokens)
        self.counts = counts
        self.deadline = deadline


@final
class OpenRequests:
    """Requests sent and not read yet, by request id."""

    def __init__(self) -> None:
        self._asked: dict[int, AskedFor] = {}
        self._answers: dict[int, Sources | Failed] = {}  # answers that came before their read
        self._request_of: dict[CacheState, int] = {}  # by identity: a state is never equal to another
        self.issued: int = 0  # ids handed out: 0 .. issued - 1

    def new_id(self) -> int:
        """The next request id (each larger than the last: the sender refuses one used before)."""
        self.issued += 1
        return self.issued - 1

    @property
    def kept(self) -> int:
        """Entries held: one per request still to read, one per answer waiting for its read (and nothing else)."""
        return len(self._asked) + len(self._answers)

    def refuse_a_second(self, cache: KVCache) -> None:
        """``ValueError`` when ``cache`` has a request still to read: two answers would land in the same slots."""
        request_id = self._request_of.get(state_of(cache))
        if request_id is not None:
            raise ValueError(f"cache {cache.id} has request {request_id} still to read: one request per cache")

    def note(self, request_id: int, cache: KVCache, tokens: list[Token], counts: list[int], deadline: float, thread: int) -> None:
        state = state_of(cache)
        self._asked[request_id] = AskedFor(state, tokens, counts, deadline, thread)
        self._request_of[state] = request_id

    def thread_of(self, request_id: int) -> int | None:
        """The thread that sent ``request_id`` while it is still to read; None once it is not."""
        asked = self._asked.get(request_id)
        return None if asked is None else asked.thread

    def take(self, request_id: int, cache: KVCache) -> AskedFor:
        """What ``request_id`` asked for, forgotten here (a request is read once). ``ValueError``, nothing
        forgotten, for an id this receiver has no unread request of or a cache other than the request's."""
        asked = self._asked.get(request_id)
        if asked is None:
            raise ValueError(f"request_id {request_id!r} names no request of this receiver still to read")
        if state_of(cache) is not asked.state:
            raise ValueError(
                f"cache {cache.id} is not the cache request {request_id} was made for: its sources belong in that "
                "cache's slots only"
            )
        del self._asked[request_id]
        del self._request_of[asked.state]
        return asked

    def abandoned(self) -> list[int]:
        """Forget the requests whose cache was closed before their read (the engine gave them up; their answers
        are dropped, now or when they come) and return their ids: the sender should hear it at once, not hold its
        pages until its own timeout."""
        gone = [request_id for request_id, asked in self._asked.items() if asked.state.status == KVCacheStatus.CLOSED]
        for request_id in gone:
            del self._request_of[self._asked.pop(request_id).state]
            self._answers.pop(request_id, None)
        return gone

    def abandon(self, request_id: int, cache: KVCache) -> bool:
        """Forget ``request_id`` if it is still to read (its answer dropped, now or when it comes): True; False
        when it is not (read, failed or given up before). ``ValueError``, nothing forgotten, when ``cache`` is not
        the request's."""
        asked = self._asked.get(request_id)
        if asked is None:
            return False
        if state_of(cache) is not asked.state:
            raise ValueError(f"cache {cache.id} is not the cache request {request_id} was made for")
        del self._asked[request_id]
        del self._request_of[asked.state]
        self._answers.pop(request_id, None)
        return True

    def forget_all(self) -> list[int]:
        """Every request still to read, forgotten (the receiver closes): their ids, for the sender to hear."""
        ids = list(self._asked)
        self._asked.clear()
        self._request_of.clear()
        self._answers.clear()
        return ids

    def answer_of(self, request_id: int) -> Sources | Failed | None:
        """The answer to ``request_id`` that came before its read (forgotten here), or None."""
        return self._answers.pop(request_id, None)

    def keep_answer(self, message: ControlMessage, reading: int | None) -> Sources | Failed | None:
        """``message`` when it answers ``reading`` (the request being read); an answer to a request still to read
        is kept for that read, one to a request no longer open (its read failed or returned, it was abandoned)
        dropped (None). ``TransferError`` for anything else: an answer to an id never handed out, a second answer
        before the read, another kind of message."""
        if isinstance(message, (Sources, Failed)):
            request_id = message.request_id
            if request_id == reading:
                return message
            if request_id in self._asked:
                if request_id not in self._answers:
                    self._answers[request_id] = message
                    return None
            elif request_id < self.issued:
                return None
        waiting = "while a READ ran" if reading is None else f"while waiting for the sources of request {reading}"
        raise TransferError(f"unexpected control message {waiting}: {message!r}")


def check_answer(request_id: int, asked: AskedFor, plan: SourcePlan) -> None:
    """``TransferError`` unless the sender's plan is for the whole prompt at the counts the request sent: a plan
    for a shorter slice or other counts would leave blocks of the receiving cache unwritten."""
    if plan.kv_slice != KVSlice(asked.prompt_len):
        raise TransferError(
            f"the prefill side answered request {request_id} with {plan.kv_slice!r}, not the whole prompt of "
            f"{counted(asked.prompt_len, 'token')}"
        )
    counts = [group.cached_tokens for group in plan.groups]
    if counts != asked.counts:
        raise TransferError(
            f"the prefill side answered request {request_id} for cached counts {counts}, not the {asked.counts} sent"
        )


def check_source_addresses(request_id: int, plan: SourcePlan, pools: tuple[tuple[tuple[int, int], ...], ...]) -> None:
    """``TransferError`` unless every source lies where the sender's hello declared its GPU pools (``pools``: per
    pool group, per pool, ``(address, nbytes)``): at ``address + src_slot * num_bytes``, whole inside the pool, no
    slot of a pool sent twice. A sender (a bug, or a peer that lies) could otherwise point a block at any bytes of
    its registered memory: a neighbour's half page, another block of this prompt. What stays possible: a whole slot
    of its own pool that holds other KV (another request's): nothing the decode side sees tells one slot's content
    from another's (README, the handoff section)."""
    seen: set[tuple[int, int, int]] = set()
    for item in plan.sources:
        where = f"request {request_id}'s source of block {item.block} (layer group {item.layer_group}, pool {item.pool})"
        if not 0 <= item.pool_group < len(pools) or not 0 <= item.pool < len(pools[item.pool_group]):
            raise TransferError(f"{where} names pool group {item.pool_group} pool {item.pool}, which the sender's hello did not declare")
        base, nbytes = pools[item.pool_group][item.pool]
        if item.src_address != base + item.src_slot * item.num_bytes or (item.src_slot + 1) * item.num_bytes > nbytes:
            raise TransferError(
                f"{where}: slot {item.src_slot} of {item.num_bytes} bytes at address {item.src_address:#x} is not a slot of "
                f"the sender's pool at {base:#x} ({nbytes} bytes)"
            )
        key = (item.pool_group, item.pool, item.src_slot)
        if key in seen:
            raise TransferError(f"{where}: slot {item.src_slot} of pool group {item.pool_group} pool {item.pool} is sent twice")
        seen.add(key)
