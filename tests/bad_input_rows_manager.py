"""Bad input to the manager's own calls (``tests/test_bad_inputs.py`` runs the rows): cache creation and reuse
probes, levels and quotas, layers, roles, groups, addressing, and the page index converter it hands out."""

from __future__ import annotations

import numpy as np

from kv_cache_manager_v2 import HalfOpenRange, PageIndexMode, ReuseScope, ScratchDesc
from tests.bad_input_world import IMAGE, SLOT_BYTES, Bad, converter, one_scratch, scratch_manager

MANAGER_ROWS: list[Bad] = [
    # --- create_kv_cache / probe_reuse
    Bad("create: tokens is a str", lambda w: w.manager.create_kv_cache(None, "hello"), TypeError, "input_tokens"),  # type: ignore[arg-type]
    Bad("create: float token", lambda w: w.manager.create_kv_cache(None, [1, 2.5]), TypeError, r"input_tokens\[1\]"),  # type: ignore[list-item]
    Bad("create: None token", lambda w: w.manager.create_kv_cache(None, [1, None]), TypeError, r"input_tokens\[1\]"),  # type: ignore[list-item]
    Bad("create: bool token", lambda w: w.manager.create_kv_cache(None, [True]), TypeError, r"input_tokens\[0\]"),
    Bad(
        "create: numpy float tokens",
        lambda w: w.manager.create_kv_cache(None, np.array([1.5])),
        TypeError,
        r"input_tokens\[0\]",
    ),
    Bad("create: tokens not iterable", lambda w: w.manager.create_kv_cache(None, 5), TypeError, "input_tokens"),  # type: ignore[arg-type]
    Bad("create: float id", lambda w: w.manager.create_kv_cache(id=1.5), TypeError, r"\bid\b"),  # type: ignore[arg-type]
    Bad("create: str id", lambda w: w.manager.create_kv_cache(id="7"), TypeError, r"\bid\b"),  # type: ignore[arg-type]
    Bad("create: bool id", lambda w: w.manager.create_kv_cache(id=True), TypeError, r"\bid\b"),
    Bad("create: duplicate id", lambda w: w.manager.create_kv_cache(id=w.active.id), ValueError, "id 0"),
    Bad(
        "create: scope is a str",
        lambda w: w.manager.create_kv_cache("tenant"),  # type: ignore[arg-type]
        TypeError,
        "reuse_scope|ReuseScope",
    ),
    Bad(
        "create: priority callback not callable",
        lambda w: w.manager.create_kv_cache(custom_priority_callback=5),  # type: ignore[arg-type]
        TypeError,
        "custom_priority_callback",
    ),
    Bad(
        "create: float expected_prompt_length",
        lambda w: w.manager.create_kv_cache(expected_prompt_length=2.0),  # type: ignore[arg-type]
        TypeError,
        "expected_prompt_length",
    ),
    Bad(
        "create: negative expected_prompt_length",
        lambda w: w.manager.create_kv_cache(expected_prompt_length=-1).close(),
        ValueError,
        "expected_prompt_length",
    ),
    Bad(
        "create: 2-D numpy tokens",
        lambda w: w.manager.create_kv_cache(None, np.zeros((2, 3), np.int64)),
        TypeError,
        "input_tokens",
    ),
    Bad(
        "create: scope with a float lora_id",
        lambda w: w.manager.create_kv_cache(ReuseScope(lora_id=1.5)),  # type: ignore[arg-type]
        TypeError,
        "lora_id|int or None",
    ),
    Bad(
        "probe: scope with a str lora_id",
        lambda w: w.manager.probe_reuse(ReuseScope(lora_id="7"), [1]),  # type: ignore[arg-type]
        TypeError,
        "lora_id|int or None",
    ),
    Bad(
        "create: scope with a salt UTF-8 cannot encode",  # its key is the salt's UTF-8 bytes
        lambda w: w.manager.create_kv_cache(ReuseScope(salt="tenant-\udc80"), [1, 2]),
        ValueError,
        r"ReuseScope\.salt",
    ),
    Bad(
        "probe: scope is an int",
        lambda w: w.manager.probe_reuse(3, [1]),  # type: ignore[arg-type]
        TypeError,
        "reuse_scope|ReuseScope",
    ),
    # --- manager: levels, quotas, shutdown
    Bad("quota: unknown level", lambda w: w.manager.resize(2, SLOT_BYTES), ValueError, "level 2"),
    Bad("quota: negative quota", lambda w: w.manager.resize(1, -1), ValueError, "quota"),
    Bad("quota: float quota", lambda w: w.manager.resize(1, 1.5e6), TypeError, "quota"),  # type: ignore[arg-type]
    Bad("quota: bool quota", lambda w: w.manager.resize(1, True), TypeError, "quota"),
    Bad("quota: str level", lambda w: w.manager.resize("0", SLOT_BYTES), TypeError, "level"),  # type: ignore[arg-type]
    Bad("quota: with an active cache", lambda w: w.manager.resize(0, 32 * SLOT_BYTES), ValueError, "active"),
    Bad("get_quota: negative level", lambda w: w.manager.get_quota(-1), ValueError, "level -1"),
    Bad("statistics: unknown level", lambda w: w.manager.get_storage_statistics(5), ValueError, "level 5"),
    Bad(
        "statistics: level None",
        lambda w: w.manager.get_storage_statistics(None),  # type: ignore[arg-type]
        TypeError,
        "level",
    ),
    Bad("shutdown with open caches", lambda w: w.manager.shutdown(), RuntimeError, "still open"),
    # --- manager: layers, roles, groups, addressing
    Bad("converter: unknown layer", lambda w: w.manager.get_page_index_converter(99, "key"), ValueError, "99"),
    Bad("converter: unknown role", lambda w: w.manager.get_page_index_converter(0, "query"), ValueError, "query"),
    Bad(
        "converter: role is an int",
        lambda w: w.manager.get_page_index_converter(0, 5),  # type: ignore[arg-type]
        TypeError,
        "role|str object",
    ),
    Bad(
        "converter: float layer id",
        lambda w: w.manager.get_page_index_converter(0.0, "key"),  # type: ignore[arg-type]
        TypeError,
        "layer_id",
    ),
    Bad("stride: bool layer id", lambda w: w.manager.get_page_stride(True, "key"), TypeError, "layer_id"),
    Bad("stride: unknown role", lambda w: w.manager.get_page_stride(3, "ssm_state"), ValueError, "ssm_state"),
    Bad(
        "base address: mode is a str",
        lambda w: w.manager.get_mem_pool_base_address(0, "key", "SHARED"),  # type: ignore[arg-type]
        TypeError,
        "index_mode|PageIndexMode",
    ),
    Bad(
        "upper bound: mode is an int",
        lambda w: w.manager.get_page_index_upper_bound(0, "key", 1),  # type: ignore[arg-type]
        TypeError,
        "index_mode|PageIndexMode",
    ),
    Bad(
        "page view: mode None",
        lambda w: w.manager.get_page_view(0, "key", None),  # type: ignore[arg-type]
        TypeError,
        "index_mode|PageIndexMode",
    ),
    Bad(
        "supports_index_mode: str",
        lambda w: w.manager.supports_index_mode("SHARED"),  # type: ignore[arg-type]
        TypeError,
        "index_mode|PageIndexMode",
    ),
    Bad(
        "base address: SHARED with scratch reuse",
        lambda w: scratch_manager().get_mem_pool_base_address(0, "key"),
        ValueError,
        "index_mode",
    ),
    Bad("layer window: unknown layer", lambda w: w.manager.get_layer_window(42), ValueError, "42"),
    Bad("layer group id: negative layer", lambda w: w.manager.get_layer_group_id(-1), ValueError, "-1"),
    Bad(
        "pool group index: unknown layer group",
        lambda w: w.manager.get_pool_group_index(7),
        ValueError,
        "layer_group_id 7",
    ),
    Bad("pool base address: unknown pool", lambda w: w.manager.get_pool_base_address(0, 9), ValueError, "pool 9"),
    Bad(
        "pool base address: unknown pool group",
        lambda w: w.manager.get_pool_base_address(5, 0),
        ValueError,
        "pool_group 5",
    ),
    Bad("pool base address: unknown level", lambda w: w.manager.get_pool_base_address(0, 0, 4), ValueError, "level 4"),
    Bad(
        "pool group of each layer group: unknown level",
        lambda w: w.manager.get_life_cycle_pool_group_indices(4),
        ValueError,
        "cache_level",
    ),
    Bad("page index scale: unknown layer", lambda w: w.manager.get_page_index_scale(42, "key"), ValueError, "42"),
    Bad("slot bytes: negative pool group", lambda w: w.manager.get_slot_bytes(-1), ValueError, "pool_group -1"),
    Bad(
        "multimodal: digest is a str",
        lambda w: w.manager.gen_multimodal_cache_key_tokens("img", 4, 0),  # type: ignore[arg-type]
        TypeError,
        "digest|bytes",
    ),
    Bad(
        "multimodal: zero tokens",
        lambda w: w.manager.gen_multimodal_cache_key_tokens(IMAGE, 0, 100),
        ValueError,
        "num_tokens",
    ),
    Bad(
        "multimodal: no id_offset without vocab_size",
        lambda w: w.manager.gen_multimodal_cache_key_tokens(IMAGE, 4),
        ValueError,
        "id_offset",
    ),
    Bad(
        "multimodal: float num_tokens",
        lambda w: w.manager.gen_multimodal_cache_key_tokens(IMAGE, 4.0, 100),  # type: ignore[arg-type]
        TypeError,
        "num_tokens",
    ),
    # --- PageIndexConverter: index modes, scratch descriptors
    Bad(
        "converter: scratch with SHARED",
        lambda w: converter(w)([0, 1], PageIndexMode.SHARED, one_scratch()),
        ValueError,
        "scratch",
    ),
    Bad(
        "converter: scratch without a mode",
        lambda w: converter(w)([0, 1], None, one_scratch()),
        ValueError,
        "scratch",
    ),
    Bad(
        "converter: scratch is a str",
        lambda w: converter(w)([0], PageIndexMode.PER_LAYER, "scratch"),  # type: ignore[arg-type]
        TypeError,
        "scratch|ScratchDesc",
    ),
    Bad(
        "converter: mode is a str",
        lambda w: converter(w)([0], "PER_LAYER"),  # type: ignore[arg-type]
        TypeError,
        "index_mode|PageIndexMode",
    ),
    Bad(
        "converter: float index",
        lambda w: converter(w)([0, 0.5]),  # type: ignore[list-item]
        TypeError,
        "base_indices",
    ),
    Bad("converter: index below -1", lambda w: converter(w)([3, -2]), ValueError, "-2"),
    Bad(
        "converter: scratch descriptor with too few slots",
        lambda w: converter(w)([0] * 8, PageIndexMode.PER_LAYER, ScratchDesc(HalfOpenRange(0, 8), (0,))),
        ValueError,
        "scratch descriptor",
    ),
    Bad(
        "converter: base_indices None",
        lambda w: converter(w)(None),  # type: ignore[arg-type]
        TypeError,
        "base_indices",
    ),
]
