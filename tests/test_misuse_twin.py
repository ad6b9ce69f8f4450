"""Bad input changes nothing (SPEC §11), proven by a differential twin (``tests/fuzz/twin.py``): two managers from
one config run one seeded workload; one of them also gets bad calls from every public entry point
(``tests/fuzz/misuse.py``), each of which must raise the documented exception naming its argument, and everything
observable (``tests/fuzz/deep_state.py``) must stay equal between the two at every later step.

Below the twin, the defects it found, each as the smallest call that showed it.
"""

from __future__ import annotations

import pytest

from kv_cache_manager_v2 import KVCacheManager, KVCacheRequest
from tests.helpers import KIB, attention, make_config

DIGEST = b"d" * 32  # a multimodal token


# --------------------------------------------------------------------------------- defects the twin found
def test_a_text_only_manager_refuses_multimodal_tokens_in_a_batch_as_create_kv_cache_does() -> None:
    """``text_only`` refused multimodal tokens in ``create_kv_cache`` and ``commit`` but not in
    ``create_kv_cache_batch``, which admitted a text-only cache holding one."""
    manager = KVCacheManager(make_config([attention(0, 512)], gpu_quota=64 * KIB, tokens_per_block=16, text_only=True))
    with pytest.raises(ValueError, match="input_tokens"):
        manager.create_kv_cache(None, [1, 2, DIGEST])
    with pytest.raises(ValueError, match=r"requests\[1\]\.input_tokens\[2\]"):
        manager.create_kv_cache_batch([KVCacheRequest([1, 2, 3], capacity=3), KVCacheRequest([1, 2, DIGEST], capacity=3)])
    assert manager.num_live_caches == 0
    manager.shutdown()
