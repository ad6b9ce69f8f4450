"""How large the simulator's seeded workload may be. ``simulator_workload`` builds it whole before the first step
(chats are sorted into arrival order, and the ideal hit rate and the typical step read every request), each request
holding its prompt and output as lists of ints, and every shared system prompt built up front: ~25 KB per request
at the default lengths (100,000 requests: 2.4 GB, built in ~17 s). Past these bounds it would exhaust the memory
while being built; a larger run replays a trace (``--trace``), which builds each request's tokens only while it
runs."""

from __future__ import annotations

from typing import Final

MAX_REQUESTS: Final = 100_000
# What MAX_REQUESTS requests of the default lengths (prompts up to 2,048 tokens, outputs up to 96) may hold: list
# slots of 8 bytes, the prompts of a chat's turns sharing their token objects.
MAX_WORKLOAD_TOKENS: Final = MAX_REQUESTS * (2048 + 96)
# The shared system prompts' tokens, each its own int object (~36 bytes): 2**24 is ~600 MB.
MAX_SHARED_PREFIX_TOKENS: Final = 1 << 24


def check_workload_size(
    num_requests: int,
    max_prompt_length: int,
    output_length: tuple[int, int],
    long_output_length: tuple[int, int],
    num_system_prompts: int,
    system_prompt_length: tuple[int, int],
) -> None:
    """Refuse, before anything is built, more than ``MAX_REQUESTS`` requests, more than ``MAX_WORKLOAD_TOKENS``
    tokens in the requests at their longest (each one's longest prompt and output), or more than
    ``MAX_SHARED_PREFIX_TOKENS`` in the system prompts at their longest; the message names every term (the
    simulator's flags turn the names into theirs)."""
    shared = num_system_prompts * system_prompt_length[1]
    if shared > MAX_SHARED_PREFIX_TOKENS:
        raise ValueError(
            f"num_system_prompts {num_system_prompts} x system_prompt_length {system_prompt_length[1]:,} = "
            f"{shared:,} tokens: the shared prefixes are built before the run, at most {MAX_SHARED_PREFIX_TOKENS:,} "
            "tokens"
        )
    if num_requests > MAX_REQUESTS:
        raise ValueError(
            f"num_requests {num_requests}: at most {MAX_REQUESTS:,} (the seeded workload holds ~25 KB per "
            "request); replay a trace (--trace) for more"
        )
    output_field, longest_output = max(
        ("output_length", output_length[1]), ("long_output_length", long_output_length[1]), key=lambda item: item[1]
    )
    per_request = max_prompt_length + longest_output
    if num_requests * per_request > MAX_WORKLOAD_TOKENS:
        raise ValueError(
            f"num_requests {num_requests} x (max_prompt_length {max_prompt_length:,} + {output_field} "
            f"{longest_output:,}) = {num_requests * per_request:,} tokens: the seeded workload is built whole before "
            f"the run, at most {MAX_WORKLOAD_TOKENS:,} tokens (num_requests {MAX_WORKLOAD_TOKENS // per_request:,} at "
            "these lengths); replay a trace (--trace) for more"
        )
