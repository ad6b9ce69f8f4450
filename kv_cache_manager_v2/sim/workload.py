"""Seeded synthetic request traces: the bookkeeping benchmark's (``tools/bench_manager.py``) and the simulator's.

Pure data generation (nothing here imports the manager), so benchmarks, the simulator and tests replay exactly
the same requests. Randomness comes only from ``random.Random(seed)`` through integer draws and float
comparisons, never NumPy or libm, so a seed gives the same trace in fast and compiled mode on every machine.

Token ids are handed out by one counter per trace: every token that is not part of a shared system prompt or of
an earlier turn of the same chat is globally unique, so any prefix hit a cache finds is one the generator meant.
"""

from __future__ import annotations

import bisect
import random
from typing import Final, Protocol, Sequence

from .._base.validation import as_int, as_non_negative_int, as_positive_int
from .workload_size import check_workload_size

BENCH_NUM_REQUESTS: Final = 2000
BENCH_PROMPT_LENGTH: Final = (256, 4096)
BENCH_OUTPUT_LENGTH: Final = (32, 256)
BENCH_NUM_SYSTEM_PROMPTS: Final = 20
BENCH_SYSTEM_PROMPT_LENGTH: Final = 1024
BENCH_MIN_UNIQUE_SUFFIX: Final = 32
# The most shared system prompts of the simulator's workload: each is built up front (--shared-prefixes 10**23 hung).
MAX_SYSTEM_PROMPTS: Final = 10_000


class SimulatedRequest(Protocol):
    """What the simulator needs of a request, whether generated here (``TraceRequest``) or replayed from a trace
    file (``mooncake_trace.MooncakeRequest``, which builds its tokens only when asked).

    ``arrival_step`` is the first scheduler step at which it may be admitted; ``parent_id`` the request that
    must finish first (a previous chat turn), or None.
    """

    @property
    def request_id(self) -> int: ...

    @property
    def arrival_step(self) -> int: ...

    @property
    def parent_id(self) -> int | None: ...

    @property
    def prompt_length(self) -> int: ...

    @property
    def output_length(self) -> int: ...

    @property
    def shared_prefix_length(self) -> int:
        """Leading prompt tokens other requests share by design (a system prompt); 0 when unknown."""
        ...

    def token_ids(self) -> list[int]:
        """The prompt, then the output tokens (a new list)."""
        ...


class TraceRequest:
    """One request of a trace: what the engine is asked (``prompt``) and what the "model" answers.

    ``output_tokens`` is the model's output, fixed by the seed, so a simulator can feed it back step by step and
    a later chat turn (whose prompt embeds it) finds it in the prefix cache. ``arrival_step`` is the first
    scheduler step at which the request may be admitted; list order is FCFS order. ``parent_id`` is the request
    id of the previous turn of the same chat (None for a first turn): a simulator should not start a turn before
    its parent has finished, even when the trace's arrival step (an estimate of the earliest finish) has passed.
    """

    def __init__(
        self,
        request_id: int,
        prompt: list[int],
        output_tokens: list[int],
        arrival_step: int = 0,
        conversation_id: int = -1,
        turn: int = 0,
        parent_id: int | None = None,
        system_prompt_id: int | None = None,
        shared_prefix_length: int = 0,
    ) -> None:
        """``shared_prefix_length``: the system prompt's length (0 without one)."""
        self.request_id = request_id
        self.prompt = prompt
        self.output_tokens = output_tokens
        self.arrival_step = arrival_step
        self.conversation_id: int = request_id if conversation_id < 0 else conversation_id
        self.turn = turn
        self.parent_id = parent_id
        self.system_prompt_id = system_prompt_id
        self.shared_prefix_length = shared_prefix_length

    @property
    def prompt_length(self) -> int:
        return len(self.prompt)

    @property
    def output_length(self) -> int:
        """Tokens the model generates (decode steps), including the last one whose KV is never computed."""
        return len(self.output_tokens)

    def token_ids(self) -> list[int]:
        return self.prompt + self.output_tokens

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TraceRequest):
            return NotImplemented
        return (
            self.request_id == other.request_id
            and self.arrival_step == other.arrival_step
            and self.conversation_id == other.conversation_id
            and self.turn == other.turn
            and self.parent_id == other.parent_id
            and self.system_prompt_id == other.system_prompt_id
            and self.shared_prefix_length == other.shared_prefix_length
            and self.prompt == other.prompt
            and self.output_tokens == other.output_tokens
        )

    def __repr__(self) -> str:
        return (
            f"TraceRequest(id={self.request_id}, prompt_length={self.prompt_length}, "
            f"output_length={self.output_length}, arrival_step={self.arrival_step}, "
            f"conversation={self.conversation_id}, turn={self.turn}, parent={self.parent_id}, "
            f"system_prompt={self.system_prompt_id})"
        )


class _TokenCounter:
    """Hands out fresh, never repeated token ids."""

    def __init__(self, start: int) -> None:
        self.next_id = start

    def take(self, count: int) -> list[int]:
        start = self.next_id
        self.next_id = start + count
        return list(range(start, start + count))


def _check_range(value: tuple[int, int], name: str, minimum: int) -> tuple[int, int]:
    """A closed ``(low, high)`` range of ints with ``minimum <= low <= high``; errors name the argument."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(f"{name} must be a (low, high) tuple, got {value!r}")
    low = as_int(value[0], f"{name}[0]")
    high = as_int(value[1], f"{name}[1]")
    if low < minimum or high < low:
        raise ValueError(f"{name} must satisfy {minimum} <= low <= high, got {value!r}")
    return (low, high)


def _check_fraction(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in [0, 1], got {value!r}")
    result = float(value)
    if not 0.0 <= result <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return result


def _uniform(rng: _Rng, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


class _Rng:
    """``random.Random`` behind a typed face (mypyc calls it through the interpreter either way)."""

    def __init__(self, seed: int) -> None:
        self.inner = random.Random(seed)

    def randint(self, low: int, high: int) -> int:
        return self.inner.randint(low, high)

    def random(self) -> float:
        return self.inner.random()

    def sample(self, population: int, count: int) -> list[int]:
        return self.inner.sample(range(population), count)

    def chance(self, probability: float) -> bool:
        return self.inner.random() < probability

    def geometric(self, mean: float) -> int:
        """Failures before the first success at ``p = 1 / (1 + mean)``: the discrete analogue of an exponential gap.

        Only float comparisons, no ``log``, so the draw is bit-identical everywhere.
        """
        if mean <= 0.0:
            return 0
        p = 1.0 / (1.0 + mean)
        count = 0
        while self.inner.random() >= p:
            count += 1
        return count


# Every token of the seeded workload is a Python int in a list (~36 bytes): --output-len 10,100000000 with the
# default 32 requests was killed by the OOM killer. 128 Ki tokens, a long context, bounds a prompt and an answer.
MAX_SEQUENCE_TOKENS: int = 1 << 17
# A gap is drawn by counting failures (``geometric``: no ``log``, bit-identical everywhere), so one costs its
# length: a mean of 1e300 steps never ended; 1,000 steps (50 s at 50 ms a step) costs ~0.1 ms a chat.
MAX_MEAN_ARRIVAL_GAP: float = 1000.0


def bench_trace(
    seed: int = 0,
    num_requests: int = BENCH_NUM_REQUESTS,
    *,
    prompt_length: tuple[int, int] = BENCH_PROMPT_LENGTH,
    output_length: tuple[int, int] = BENCH_OUTPUT_LENGTH,
    num_system_prompts: int = BENCH_NUM_SYSTEM_PROMPTS,
    system_prompt_length: int = BENCH_SYSTEM_PROMPT_LENGTH,
    system_prompt_fraction: float = 0.5,
    min_unique_suffix: int = BENCH_MIN_UNIQUE_SUFFIX,
) -> list[TraceRequest]:
    """The bookkeeping benchmark's trace (``tools/bench_manager.py``); the defaults are the standard trace.

    Every request draws a length ``L`` uniform in ``prompt_length``. ``round(num_requests *
    system_prompt_fraction)`` requests, chosen at random, start with one of ``num_system_prompts`` shared system
    prompts (uniform choice) followed by ``max(L - system_prompt_length, min_unique_suffix)`` unique tokens, so
    their length is ``max(L, system_prompt_length + min_unique_suffix)``; the others are ``L`` unique tokens.
    Output lengths are uniform in ``output_length``. All requests arrive at step 0 in list (FCFS) order.

    System prompt ``s`` holds token ids ``[s * system_prompt_length, (s + 1) * system_prompt_length)``; every other
    token id, output tokens included, is unique in the trace.
    """
    seed = as_int(seed, "seed")
    num_requests = as_non_negative_int(num_requests, "num_requests")
    prompt_bounds = _check_range(prompt_length, "prompt_length", 1)
    output_bounds = _check_range(output_length, "output_length", 1)
    num_system_prompts = as_positive_int(num_system_prompts, "num_system_prompts")
    system_prompt_length = as_positive_int(system_prompt_length, "system_prompt_length")
    fraction = _check_fraction(system_prompt_fraction, "system_prompt_fraction")
    min_unique_suffix = as_positive_int(min_unique_suffix, "min_unique_suffix")
    if system_prompt_length + min_unique_suffix > prompt_bounds[1]:
        raise ValueError(
            f"system_prompt_length {system_prompt_length} + min_unique_suffix {min_unique_suffix} exceeds "
            f"the longest prompt {prompt_bounds[1]}"
        )

    rng = _Rng(seed)
    with_system = set(rng.sample(num_requests, round(num_requests * fraction)))
    system_prompts = [
        list(range(s * system_prompt_length, (s + 1) * system_prompt_length)) for s in range(num_system_prompts)
    ]
    tokens = _TokenCounter(num_system_prompts * system_prompt_length)
    requests: list[TraceRequest] = []
    for request_id in range(num_requests):
        length = _uniform(rng, prompt_bounds)
        system_prompt_id: int | None = None
        if request_id in with_system:
            system_prompt_id = rng.randint(0, num_system_prompts - 1)
            suffix = max(length - system_prompt_length, min_unique_suffix)
            prompt = system_prompts[system_prompt_id] + tokens.take(suffix)
        else:
            prompt = tokens.take(length)
        output = tokens.take(_uniform(rng, output_bounds))
        shared = 0 if system_prompt_id is None else system_prompt_length
        requests.append(TraceRequest(request_id, prompt, output, 0, request_id, 0, None, system_prompt_id, shared))
    return requests


def ideal_prefix_hit_rate(
    requests: Sequence[TraceRequest],
    tokens_per_block: int,
    partial_reuse: bool = False,
    served: Sequence[bool] | None = None,
) -> float:
    """Fraction of prompt tokens an infinite cache would serve with the manager's reuse rules, requests taken in
    list order.

    After each request the cache holds the blocks of ``prompt + output_tokens[:-1]``: the tokens whose KV an
    engine has computed once the request finishes (the last output token is never fed back), the last block
    possibly short. Full blocks whose whole prefix matches are reused (chained per block, like a radix tree).
    Without ``partial_reuse`` that is all, and the hit is not capped at ``prompt_length - 1``: a prompt identical
    to an earlier block-aligned sequence counts whole (an upper bound). With it (the manager's default without SSM
    layers), a request also reuses the leading tokens it shares with one more cached block, full or short, and at
    most ``prompt_length - 1`` tokens, as the trace's ``ideal_hit_rate`` counts; the full-block figure alone fell
    below what the manager reached, so the "ideal" was false. 0.0 for a trace without prompt tokens.

    ``served`` (one flag per request) counts only the served requests' prompts, as the measured rate does; every
    request still fills the cache, since a request rejected mid-run may have committed blocks others reused.
    """
    tokens_per_block = as_positive_int(tokens_per_block, "tokens_per_block")
    # (parent node, block tokens) -> node; node 0 is the root.
    nodes: dict[tuple[int, tuple[int, ...]], int] = {}
    # parent node -> its cached blocks (full and short), sorted: the longest shared start with any of them is
    # shared with a neighbour of where the request's block would sort.
    children: dict[int, list[tuple[int, ...]]] = {}
    hit_tokens = 0
    prompt_tokens = 0
    for index, request in enumerate(requests):
        prompt = request.prompt
        counted = served is None or served[index]
        if counted:
            prompt_tokens += len(prompt)
        sequence = prompt + request.output_tokens[:-1]
        full_prompt_blocks = len(prompt) // tokens_per_block
        parent = 0
        matched = 0  # prompt tokens reused
        cached = True  # the blocks so far are in the cache (else this request adds them)
        counting = True  # every block so far was a reused full prompt block
        for ordinal in range(-(-len(sequence) // tokens_per_block)):
            beg = ordinal * tokens_per_block
            block = tuple(sequence[beg : beg + tokens_per_block])
            key = (parent, block)
            node = nodes.get(key, -1) if cached else -1
            if counting and node >= 0 and ordinal < full_prompt_blocks:
                matched += tokens_per_block
            elif counting:
                counting = False
                if partial_reuse and beg < len(prompt):
                    matched += _longest_shared_start(children.get(parent, []), tuple(prompt[beg : beg + tokens_per_block]))
            if node < 0:
                cached = False
                node = len(nodes) + 1
                nodes[key] = node
                bisect.insort(children.setdefault(parent, []), block)
            parent = node
        if partial_reuse:  # the engine computes at least the last prompt token
            matched = max(0, min(matched, len(prompt) - 1))
        if counted:
            hit_tokens += matched
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0


def _longest_shared_start(blocks: list[tuple[int, ...]], query: tuple[int, ...]) -> int:
    """The most leading tokens ``query`` shares with one of the sorted ``blocks``."""
    where = bisect.bisect_left(blocks, query)
    best = 0
    for neighbour in blocks[max(0, where - 1) : where + 1]:
        shared = 0
        for mine, theirs in zip(query, neighbour):
            if mine != theirs:
                break
            shared += 1
        best = max(best, shared)
    return best


class _Turn:
    """A chat turn before request ids are known (ids follow arrival order, which is only known at the end)."""

    def __init__(
        self, conversation: int, turn: int, arrival: int, prompt: list[int], output: list[int], system: int | None
    ) -> None:
        self.conversation = conversation
        self.turn = turn
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.system = system


def simulator_workload(
    seed: int = 0,
    num_requests: int = 200,
    *,
    max_prompt_length: int = 4096,
    num_system_prompts: int = 4,
    system_prompt_length: tuple[int, int] = (256, 1024),
    system_prompt_fraction: float = 0.6,
    max_turns: int = 4,
    user_length: tuple[int, int] = (16, 256),
    long_user_length: tuple[int, int] = (768, 2048),
    long_user_fraction: float = 0.2,
    output_length: tuple[int, int] = (8, 64),
    long_output_length: tuple[int, int] = (128, 384),
    long_output_fraction: float = 0.2,
    mean_arrival_gap: float = 2.0,
    burst_fraction: float = 0.1,
    burst_size: tuple[int, int] = (4, 12),
    think_steps: tuple[int, int] = (1, 32),
    prefill_chunk: int = 2048,
) -> list[TraceRequest]:
    """The serving simulator's seeded workload: shared system prompts, multi-turn chats, mixed lengths.

    Chats start at steps drawn as a discrete Poisson process from step 0 (geometric gaps of mean
    ``mean_arrival_gap`` steps); with probability ``burst_fraction`` a chat opens a burst of ``burst_size`` chats
    arriving together. A chat has 1..``max_turns`` turns (uniform); with probability ``system_prompt_fraction``
    its first prompt starts with one of ``num_system_prompts`` shared system prompts (lengths drawn once from
    ``system_prompt_length``). Turn ``k + 1``'s prompt is turn ``k``'s prompt + output + new user tokens, so a
    prefix cache that keeps committed output hits it; it arrives no earlier than turn ``k`` could finish
    (``ceil(prompt / prefill_chunk)`` prefill steps + one step per output token) plus ``think_steps``. User
    segments are short (``user_length``) or, with probability ``long_user_fraction``, long; outputs likewise.
    Prompts never exceed ``max_prompt_length``: the user segment is clipped to fit, and a chat ends early when
    not even one new user token fits.

    Chats are generated until ``num_requests`` turns exist (the last chat may lose turns), then sorted by
    (arrival step, chat, turn) and numbered: list order is FCFS order and a parent always precedes its child.
    The defaults (200 requests, ~1k-token prompts, ~80-token outputs) keep a cpu simulation short.
    """
    seed = as_int(seed, "seed")
    num_requests = as_non_negative_int(num_requests, "num_requests")
    max_prompt_length = as_positive_int(max_prompt_length, "max_prompt_length")
    num_system_prompts = as_non_negative_int(num_system_prompts, "num_system_prompts")
    if num_system_prompts > MAX_SYSTEM_PROMPTS:
        raise ValueError(f"num_system_prompts must be <= {MAX_SYSTEM_PROMPTS:,}, got {num_system_prompts:,}")
    system_bounds = _check_range(system_prompt_length, "system_prompt_length", 1)
    system_fraction = _check_fraction(system_prompt_fraction, "system_prompt_fraction")
    max_turns = as_positive_int(max_turns, "max_turns")
    short_user = _check_range(user_length, "user_length", 1)
    long_user = _check_range(long_user_length, "long_user_length", 1)
    long_user_p = _check_fraction(long_user_fraction, "long_user_fraction")
    short_output = _check_range(output_length, "output_length", 1)
    long_output = _check_range(long_output_length, "long_output_length", 1)
    for name, longest in (("max_prompt_length", max_prompt_length), ("output_length", short_output[1]),
                          ("long_output_length", long_output[1])):
        if longest > MAX_SEQUENCE_TOKENS:
            raise ValueError(f"{name} must be <= {MAX_SEQUENCE_TOKENS:,} tokens, got {longest:,}")
    long_output_p = _check_fraction(long_output_fraction, "long_output_fraction")
    if (
        isinstance(mean_arrival_gap, bool)
        or not isinstance(mean_arrival_gap, (int, float))
        or not 0 <= mean_arrival_gap <= MAX_MEAN_ARRIVAL_GAP  # NaN fails too
    ):
        raise ValueError(f"mean_arrival_gap must be a number from 0 to {MAX_MEAN_ARRIVAL_GAP:,.0f}, got {mean_arrival_gap!r}")
    mean_gap = float(mean_arrival_gap)
    burst_p = _check_fraction(burst_fraction, "burst_fraction")
    burst_bounds = _check_range(burst_size, "burst_size", 1)
    think_bounds = _check_range(think_steps, "think_steps", 0)
    prefill_chunk = as_positive_int(prefill_chunk, "prefill_chunk")
    if num_system_prompts > 0 and system_fraction > 0.0 and system_bounds[1] >= max_prompt_length:
        raise ValueError(
            f"system_prompt_length {system_prompt_length!r} leaves no room for user tokens within "
            f"max_prompt_length {max_prompt_length}"
        )

    check_workload_size(num_requests, max_prompt_length, short_output, long_output, num_system_prompts, system_bounds)
    rng = _Rng(seed)
    system_prompts: list[list[int]] = []
    next_token = 0
    for _ in range(num_system_prompts):
        length = _uniform(rng, system_bounds)
        system_prompts.append(list(range(next_token, next_token + length)))
        next_token += length
    tokens = _TokenCounter(next_token)

    turns: list[_Turn] = []
    step = 0
    burst_left = 0
    conversation = 0
    while len(turns) < num_requests:
        if burst_left > 0:
            burst_left -= 1
        else:
            if conversation > 0:
                step += rng.geometric(mean_gap)
            if rng.chance(burst_p):
                burst_left = _uniform(rng, burst_bounds) - 1
        system: int | None = None
        prompt: list[int] = []
        if system_prompts and rng.chance(system_fraction):
            system = rng.randint(0, len(system_prompts) - 1)
            prompt = list(system_prompts[system])
        num_turns = min(rng.randint(1, max_turns), num_requests - len(turns))
        arrival = step
        for turn in range(num_turns):
            room = max_prompt_length - len(prompt)
            if room < 1:
                break
            user = _uniform(rng, long_user if rng.chance(long_user_p) else short_user)
            prompt = prompt + tokens.take(min(user, room))
            output = tokens.take(_uniform(rng, long_output if rng.chance(long_output_p) else short_output))
            turns.append(_Turn(conversation, turn, arrival, prompt, output, system))
            earliest_finish = arrival + -(-len(prompt) // prefill_chunk) + len(output)
            arrival = earliest_finish + _uniform(rng, think_bounds)
            prompt = prompt + output
        conversation += 1

    turns.sort(key=_turn_order)
    requests: list[TraceRequest] = []
    ids: dict[tuple[int, int], int] = {}
    for request_id, item in enumerate(turns):
        ids[(item.conversation, item.turn)] = request_id
        parent = ids[(item.conversation, item.turn - 1)] if item.turn > 0 else None
        shared = 0 if item.system is None else len(system_prompts[item.system])
        request = TraceRequest(
            request_id, item.prompt, item.output, item.arrival, item.conversation, item.turn, parent, item.system, shared
        )
        requests.append(request)
    return requests


def _turn_order(item: _Turn) -> tuple[int, int, int]:
    return (item.arrival, item.conversation, item.turn)
