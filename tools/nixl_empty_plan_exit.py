"""What a decode process gets when its prefill side exits just as it answers a request with nothing to move.

UCX 1.23 (nixl-cu12 1.5.1) aborts the whole process when a peer dies while UCX connects to it, so anything that
makes the decode side connect to a prefill side that is exiting can kill it. Each run spawns a decode process (so
an abort is counted here, not suffered) that computes a prompt, spawns the prefill side
(``tests.nixl_helpers.fake_prefill_side``, which ``os._exit``s right after sending its answer), requests that
prompt (an empty plan: the decode side holds it all) and reads at once. A run ends ``ok`` (the read returned),
``error`` (``TransferError``), ``abort`` (the decode process died of a signal) or ``hung``, and says whether the
decode side loaded the peer's NIXL metadata (UCX connected to the exiting peer).

    python tools/nixl_empty_plan_exit.py [--runs 30]
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
from multiprocessing.connection import Connection

from kv_cache_manager_v2.disagg import TransferError
from tests.nixl_helpers import DecodeSide, child_side, fake_prefill_side, require_nixl, tokens_of
from tests.test_nixl_misbehaving_peer import ConnectionCountingAgent


def decode_run(report: Connection, seed: int) -> None:
    """One decode side against a prefill side that exits as it answers; sends (outcome, peer loaded) back."""
    with child_side(fake_prefill_side, 16, "cpu", "exit_after_sources") as side:
        decode = DecodeSide(side.connection, agent_type=ConnectionCountingAgent)
        prompt = tokens_of(seed, 256)
        decode.warm(prompt)
        cache, counts = decode.open(prompt)
        try:
            decode.receiver.receive(cache, prompt, counts)
            outcome = "ok"
            cache.close()
        except TransferError:
            outcome = "error"
        report.send((outcome, decode.agent(ConnectionCountingAgent).loaded > 0))
        decode.close()


def one_run(seed: int, timeout_s: float) -> tuple[str, bool]:
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=decode_run, args=(there, seed))
    process.start()
    there.close()
    answer: tuple[str, bool] | None = None
    if here.poll(timeout_s):
        try:
            answer = here.recv()
        except EOFError:  # died before it could say
            pass
    process.join(timeout_s)
    if process.exitcode is None:
        process.kill()
        process.join()
        return "hung", answer[1] if answer else False
    if process.exitcode < 0:
        return "abort", answer[1] if answer else False
    assert answer is not None, f"the decode process exited {process.exitcode} without a report"
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    options = parser.parse_args()
    require_nixl()
    outcomes: collections.Counter[str] = collections.Counter()
    connected = 0
    for run in range(options.runs):
        outcome, loaded = one_run(1000 + run, options.timeout_s)
        outcomes[outcome] += 1
        connected += loaded
        print(f"run {run}: {outcome}{', connected to the exiting peer' if loaded else ''}", flush=True)
    summary = ", ".join(f"{name} {outcomes[name]}" for name in ("ok", "error", "abort", "hung"))
    print(f"{options.runs} runs: {summary}; the decode side connected UCX to the exiting peer in {connected}")


if __name__ == "__main__":
    main()
