"""A local handoff (``plan_transfer`` / ``execute``) copies only rows the manager knows to hold the receiver's prompt,
between engines that declare the same ``KVFormat``: the checks ``KVSender.send_sources`` and the NIXL handshake make
across processes (``_handoff/plan.check_prompt_rows`` is the one token check of both paths).

A cache's rows are known by its committed tokens, then the input tokens ``create_kv_cache`` was given past them.
Content is checked with the FakeEngine after every refusal: a refusal changed nothing, and the receiver gets its own
prompt's KV from a good source.
"""

from __future__ import annotations

import pytest

from kv_cache_manager_v2._introspection import kept_input_tokens, state_of
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.disagg import KVFormat, KVSlice, TransferPlan, execute, plan_transfer
from tests.disagg_sides import Side
from tests.helpers import attention, seeded_prompt

LAYERS: list[LayerConfig] = [attention(0), attention(1)]
PROMPT = seeded_prompt(42, 200)  # 6 full blocks of 32 and a partial one of 8 tokens


@pytest.mark.parametrize("committed", [0, 96, 192])
def test_rows_past_the_committed_tokens_of_another_prompt_are_refused(committed: int) -> None:
    """The sender's committed tokens start the receiver's prompt, its later rows (a partial last block, whole
    blocks, or the prompt never committed) were computed for another prompt it was created with. Before: only the
    committed tokens were compared, so the plan copied them and the receiver served them ('wrong content at
    positions [192, 193, ...]')."""
    src, dst = Side(LAYERS), Side(LAYERS)
    other = PROMPT[:192] + seeded_prompt(43, 8)  # parts from the prompt in its last, partial block
    dst_cache, counts = dst.receive(PROMPT)
    src_cache = src.manager.create_kv_cache(None, other)
    assert src_cache.resume() and src_cache.resize(200)
    src.engine.step(src_cache, other)
    src_cache.commit(other[:committed])
    with pytest.raises(ValueError, match=rf"src_cache \(cache {src_cache.id}\) token 192 is {other[192]}, dst_cache "
                       rf"\(cache {dst_cache.id}\)'s is {PROMPT[192]}: the receiver would serve another prompt's KV"):
        plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(200), counts)
    good = src.prefill(PROMPT)
    execute(plan_transfer(src.manager, good, dst.manager, dst_cache, KVSlice(200), counts))
    dst.decode(dst_cache, PROMPT)


def test_a_source_whose_rows_the_manager_cannot_tell_is_refused_until_it_commits_them() -> None:
    """A cache created without input tokens and not committed: nothing says whose KV its rows hold. Before: planned
    and copied whatever they held."""
    src, dst = Side(LAYERS), Side(LAYERS)
    dst_cache, counts = dst.receive(PROMPT)
    src_cache = src.manager.create_kv_cache()
    assert src_cache.resume() and src_cache.resize(200)
    src.engine.step(src_cache, PROMPT)
    src_cache.commit(PROMPT[:64])
    with pytest.raises(ValueError, match=r"src_cache \(cache \d+\) is known to hold the tokens of its first 64 positions "
                       r"only, not the 200 of dst_cache \(cache \d+\)'s tokens: .*commit it first"):
        plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(200), counts)
    src_cache.commit(PROMPT[64:])
    execute(plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(200), counts))
    dst.decode(dst_cache, PROMPT)


def test_a_receiver_opened_for_another_prompt_is_refused() -> None:
    """The receiving cache was made for another prompt of the same length and reused nothing, so it has no committed
    token to compare. Before: the sender's prompt went into it and the receiver, serving its own prompt, read another
    prompt's KV ('wrong content at positions [0, 1, ...]')."""
    src, dst = Side(LAYERS), Side(LAYERS)
    wrong = seeded_prompt(44, 200)
    wrong_cache, wrong_counts = dst.receive(wrong)
    src_cache = src.prefill(PROMPT)
    with pytest.raises(ValueError, match=rf"src_cache \(cache {src_cache.id}\) token 0 is {PROMPT[0]}, dst_cache "
                       rf"\(cache {wrong_cache.id}\)'s is {wrong[0]}: the receiver would serve another prompt's KV"):
        plan_transfer(src.manager, src_cache, dst.manager, wrong_cache, KVSlice(200), wrong_counts)
    short_cache = dst.manager.create_kv_cache(None, PROMPT[:-1])  # the prompt without its last token
    assert short_cache.resume() and short_cache.resize(200, 200)
    with pytest.raises(ValueError, match=r"dst_cache \(cache \d+\) is known to hold the tokens of its first 199 "
                       r"positions only, not the 200 of prompt_len"):
        plan_transfer(src.manager, src_cache, dst.manager, short_cache, KVSlice(200), [0])
    short_cache.close()
    wrong_cache.close()
    dst_cache, counts = dst.receive(PROMPT)
    execute(plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(200), counts))
    dst.decode(dst_cache, PROMPT)


def test_execute_refuses_a_source_whose_commits_parted_from_its_input() -> None:
    """Planned while the sender's input was the prompt; it then committed other tokens there, so its rows are no
    longer known to be the prompt's (its input past a commit that parts from it says nothing). Before: executed,
    and the receiver served rows 100... of the other prompt."""
    src, dst = Side(LAYERS), Side(LAYERS)
    other = PROMPT[:100] + seeded_prompt(45, 100)
    dst_cache, counts = dst.receive(PROMPT)
    src_cache = src.manager.create_kv_cache(None, PROMPT)
    assert src_cache.resume() and src_cache.resize(200)
    src.engine.step(src_cache, other)
    assert src_cache.resize(200, 200)  # computed: the commit below leaves its history where planning saw it
    plan = plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(200), counts)
    src_cache.commit(other[:101])
    with pytest.raises(ValueError, match=rf"src_cache \(cache {src_cache.id}\) token 100 is {other[100]}, dst_cache"):
        execute(plan)
    sender = src.prefill(PROMPT)  # kept: a plan holds no handle, so a dropped sender would be closed
    execute(plan_transfer(src.manager, sender, dst.manager, dst_cache, KVSlice(200), counts))
    dst.decode(dst_cache, PROMPT)


def test_engines_of_another_kv_format_are_refused() -> None:
    """Two models of one layout in one process: their pages are the same size and mean other things. Before:
    ``plan_transfer`` took no format (TypeError: unexpected keyword argument 'src_format')."""
    src, dst = Side(LAYERS), Side(LAYERS)
    dst_cache, counts = dst.receive(PROMPT)
    src_cache = src.prefill(PROMPT)
    ours = KVFormat("bfloat16", "llama-3.1-8b@main", "NHD 8x128")

    def plan(src_format: object, dst_format: object) -> TransferPlan:
        return plan_transfer(
            src.manager, src_cache, dst.manager, dst_cache, KVSlice(200), counts,
            src_format=src_format, dst_format=dst_format,  # type: ignore[arg-type]
        )

    with pytest.raises(ValueError, match=r"layouts differ: model is llama-3\.1-8b@main on the sender, "
                       r"llama-3\.1-8b-instruct@main on the receiver"):
        plan(ours, KVFormat("bf16", "llama-3.1-8b-instruct@main", "NHD 8x128"))
    with pytest.raises(ValueError, match="tensor-parallel rank is 0 on the sender, 1 on the receiver"):
        plan(ours, KVFormat("bfloat16", "llama-3.1-8b@main", "NHD 8x128", 1, 2))
    with pytest.raises(ValueError, match="KV dtype is bfloat16 on the sender, float16 on the receiver"):
        plan(ours, KVFormat("float16", "llama-3.1-8b@main", "NHD 8x128"))
    with pytest.raises(TypeError, match="dst_format must be a KVFormat \\(pass both formats or neither\\), got None"):
        plan(ours, None)
    with pytest.raises(TypeError, match="src_format must be a KVFormat|KVFormat or None object expected"):  # compiled: mypyc's own check
        plan("bfloat16", ours)
    execute(plan(ours, KVFormat("torch.bfloat16", "llama-3.1-8b@main", "NHD 8x128")))  # one dtype, two spellings
    dst.decode(dst_cache, PROMPT)


@pytest.mark.parametrize("last_commit", ["a partial block", "whole blocks"])
def test_the_input_copy_goes_once_the_commits_cover_it_and_the_answers_stay(last_commit: str) -> None:
    """A cache keeps its input tokens past the reused prefix (8 bytes a token) only until its commits cover them:
    then the commits hold those tokens, ``known_tokens`` answers the same and a sender of another prompt is still
    refused. The covering commit is the decode fast path's shape (8 tokens in a partial block) or completes blocks.
    Before: the copy stayed until close (``kept_input_tokens`` 200 after the commits covered it)."""
    src, dst = Side(LAYERS), Side(LAYERS)
    length = 200 if last_commit == "a partial block" else 192
    other = PROMPT[:160] + seeded_prompt(43, length - 160)  # parts from the prompt in block 5
    dst_cache, counts = dst.receive(PROMPT[:length])
    src_cache = src.manager.create_kv_cache(None, other)
    assert kept_input_tokens(src_cache) == length
    assert src_cache.resume() and src_cache.resize(length)
    src.engine.step(src_cache, other)
    refusal = (rf"src_cache \(cache {src_cache.id}\) token 160 is {other[160]}, dst_cache \(cache {dst_cache.id}\)'s "
               rf"is {PROMPT[160]}: the receiver would serve another prompt's KV")
    for committed in sorted({160, 192, length}):  # the partial block's 8 tokens alone: the fast path's shape
        src_cache.commit(other[src_cache.num_committed_tokens : committed])
        assert state_of(src_cache).known_tokens() == other
        assert kept_input_tokens(src_cache) == (0 if committed == length else length)
        with pytest.raises(ValueError, match=refusal):
            plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(length), counts)
    src.engine.check(src_cache, other)
    good = src.prefill(PROMPT[:length])
    assert kept_input_tokens(good) == 0  # its commits covered its input too
    execute(plan_transfer(src.manager, good, dst.manager, dst_cache, KVSlice(length), counts))
    dst.decode(dst_cache, PROMPT[:length])


def test_a_receiver_whose_commits_cover_another_prompt_is_refused_before_and_after() -> None:
    """The receiver's tokens up to ``prompt_len`` come from its input copy, then from its commits once they cover
    it (the copy released): the same answer, so a receiver opened for another prompt is refused both times."""
    src, dst = Side(LAYERS), Side(LAYERS)
    other = PROMPT[:100] + seeded_prompt(44, 100)
    dst_cache, counts = dst.receive(other)
    src_cache = src.prefill(PROMPT)
    refusal = rf"src_cache \(cache {src_cache.id}\) token 100 is {PROMPT[100]}, dst_cache \(cache {dst_cache.id}\)'s is"
    with pytest.raises(ValueError, match=refusal):
        plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(200), counts)
    dst_cache.commit(other)  # its rows were never computed: only what it is known to hold matters here
    assert kept_input_tokens(dst_cache) == 0 and state_of(dst_cache).known_tokens() == other
    with pytest.raises(ValueError, match=refusal):
        plan_transfer(src.manager, src_cache, dst.manager, dst_cache, KVSlice(200), [200, 200])
    src.engine.check(src_cache, PROMPT)
