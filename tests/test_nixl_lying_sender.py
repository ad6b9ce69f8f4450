"""A prefill side that lies in its sources: each lie must be refused on the decode side (a ``TransferError`` or
the plan's ``ValueError``, the receiving cache closed) before any byte is READ, never land a wrong page.

The lying child does a genuine handshake and computes each prompt, then doctors the ``SourcePlan`` of its first
answer (addresses inside its own registered pools, slots sent twice, short or missing blocks); its later answers
are honest, and the next request arrives intact. What no check here can catch (a whole slot of the sender's own
pool holding another request's KV) is said in README's handoff section.
"""

from __future__ import annotations

import dataclasses
from multiprocessing.connection import Connection

import pytest

from kv_cache_manager_v2._handoff.control_messages import Sources, send
from kv_cache_manager_v2._handoff.transfer import KVSlice, SourcePlan
from kv_cache_manager_v2.disagg import TransferError, plan_source
from tests.nixl_helpers import DecodeSide, PrefillSide, child_side, prefill, require_nixl, tokens_of

PROMPTS = [tokens_of(901, 300), tokens_of(902, 250)]
LIES = {
    "misaligned": (TransferError, "is not a slot of the sender's pool"),  # every address 8 bytes on: two slots' halves
    "past_the_pool": (TransferError, "is not a slot of the sender's pool"),  # a slot beyond its pool
    "slot_twice": (TransferError, "is sent twice"),  # two blocks from one slot
    "short": (ValueError, "has slot bytes"),  # fewer bytes than a slot
    "block_missing": (ValueError, "the plan lacks block"),  # a slot would keep other bytes
    "block_extra": (ValueError, "twice"),  # one block more
}


def doctored(plan: SourcePlan, lie: str) -> SourcePlan:
    sources = list(plan.sources)
    first = sources[0]
    if lie == "misaligned":
        sources = [dataclasses.replace(item, src_address=item.src_address + 8) for item in sources]
    elif lie == "past_the_pool":
        slot = first.src_slot + 1_000_000
        sources[0] = dataclasses.replace(first, src_slot=slot, src_address=first.src_address + 1_000_000 * first.num_bytes)
    elif lie == "slot_twice":
        pool_of = [(item.pool_group, item.pool) for item in sources]
        second = next(i for i in range(1, len(sources)) if pool_of[i] in pool_of[:i])  # a pool's second source
        one = sources[pool_of.index(pool_of[second])]
        sources[second] = dataclasses.replace(sources[second], src_slot=one.src_slot, src_address=one.src_address)
    elif lie == "short":
        sources[0] = dataclasses.replace(first, num_bytes=first.num_bytes // 2)
    elif lie == "block_missing":
        del sources[0]
    else:
        sources.append(sources[-1])
    return dataclasses.replace(plan, sources=tuple(sources))


def lying_prefill_side(connection: Connection, lie: str) -> None:
    """Answers the first request with a doctored plan (and waits for the decode side to give it up), the rest
    honestly."""
    side = PrefillSide(connection)
    sender = side.sender
    lied = False
    while (request := sender.next_request()) is not None:
        cache = prefill(side.manager, side.engine, request)
        cache.commit(request.tokens)
        if lied:
            sender.send_sources(request, cache)
        else:
            plan = plan_source(side.manager, cache, KVSlice(len(request.tokens)), request.cached_per_group)
            send(connection, Sources(request.request_id, doctored(plan, lie), None))
            lied = True
        sender.wait_released(request)
        cache.close()
    side.close()


@pytest.mark.parametrize("lie", list(LIES))
def test_a_sender_lying_in_its_sources_is_refused_before_anything_lands(lie: str) -> None:
    require_nixl()
    error, message = LIES[lie]
    with child_side(lying_prefill_side, lie) as side:
        decode = DecodeSide(side.connection)
        cache, counts = decode.open(PROMPTS[0])
        with pytest.raises(error, match=message):
            decode.receiver.receive(cache, PROMPTS[0], counts)
        assert cache.status.name == "CLOSED"
        decode.manager.check_invariants()
        cache, counts = decode.open(PROMPTS[1])
        decode.receiver.receive(cache, PROMPTS[1], counts)
        decode.engine.check(cache, PROMPTS[1])
        cache.close()
        decode.close()
        assert side.wait_exit() == 0
