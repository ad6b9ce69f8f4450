"""What the remote tier puts in the store: keys by content and layout, and framed objects it can verify.

A key is ``kvm2/<layout digest>/lg<life cycle>/pg<pool group>/<block name>``; the layout digest covers everything
that shapes a page's bytes besides the tokens (see ``layout_key_prefixes``: the whole model's layout, as a layer's
bytes depend on the layers before it, and where each buffer sits in the page), so no other layout's object is ever
read as ours. An object is a header (magic, format version, payload size, BLAKE2b of key and payload) followed by
the payload: anything else read back is rejected.

A ``KeySpace`` is what one secret (or none) gives. Without a secret the block name is the chained block key itself,
as in earlier versions: anyone who can list the store can hash a guessed prompt and look for its keys. With a
deployment's ``secret_key`` the block name is an HMAC-SHA256 of the block key (under a key derived from the secret),
so a guess cannot be tested without the secret; the digest is a MAC (HMAC-SHA256 keyed with the secret: whoever can
write to the store but lacks it cannot make an object we accept); and the layout digest covers a MAC of a fixed
label, so deployments with different secrets use disjoint keys: they never probe, fetch, reject or remove each
other's objects, and never race for a key (Mooncake keeps a key's first object). None of it reveals the secret.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import struct
from typing import TYPE_CHECKING, Final, Protocol, Sequence, final

import numpy as np

from .._model.life_cycle import LifeCycle, SsmLifeCycle, WindowedAttentionLifeCycle
from .._base.remote_store import HostBuffer

if TYPE_CHECKING:
    from .._model.layout import StorageLayout
    from ..config import LayerConfig, RemoteCacheTierConfig

FORMAT_VERSION: Final = 1
MAGIC: Final = b"KVM2"
# magic, format version, reserved, payload bytes, 16 bytes of BLAKE2b (HMAC-SHA256 with a secret) of (key, payload)
HEADER: Final = struct.Struct("<4sHHQ16s")
DIGEST_BYTES: Final = 16
# What a secret's key space identifier is the MAC of; an object's MAC covers its key, which starts "kvm2/".
KEY_SPACE_LABEL: Final = b"kvm2-key-space"
# What the key naming blocks is the MAC of (the secret itself signs objects: one key, one use).
BLOCK_NAMES_LABEL: Final = b"kvm2-block-names"


class ObjectHasher(Protocol):
    """A hash state every object's digest starts from (``object_digest`` copies it): ``hashlib.blake2b`` or
    ``hmac.HMAC``."""

    def copy(self) -> ObjectHasher: ...

    def update(self, data: bytes | memoryview, /) -> None: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


def object_hasher(secret_key: bytes | None) -> ObjectHasher:
    """Without a secret, BLAKE2b (as before secrets existed: a checksum, anyone can compute it); with one,
    HMAC-SHA256 keyed with it (a MAC: only its holders can), which costs less than BLAKE2b where the CPU has SHA
    instructions (``tools/bench_object_digest.py``)."""
    if secret_key is None:
        return hashlib.blake2b(digest_size=DIGEST_BYTES)
    return hmac.new(secret_key, digestmod=hashlib.sha256)


@final
class KeySpace:
    """The keys and object digests of one secret, or of none (see the module docstring): the tier writes in the
    current secret's and reads there first, then in each previous secret's."""

    def __init__(self, prefixes: list[str], secret_key: bytes | None) -> None:
        # Per life cycle, the start of its keys (``layout_key_prefixes``).
        self.prefixes: list[str] = prefixes
        # What objects in this key space are framed and checked with.
        self.hasher: ObjectHasher = object_hasher(secret_key)
        self._names: ObjectHasher | None = None
        if secret_key is not None:
            names_key = hmac.new(secret_key, BLOCK_NAMES_LABEL, hashlib.sha256).digest()
            self._names = hmac.new(names_key, digestmod=hashlib.sha256)

    def name(self, block_key: bytes) -> str:
        """The last part of a block's keys: its chained block key, or with a secret an HMAC of it (a keyed state
        copied per key: ``tools/bench_remote_keys.py`` measures it)."""
        names = self._names
        if names is None:
            return block_key.hex()
        state = names.copy()
        state.update(block_key)
        return state.hexdigest()


def key_spaces(
    config: RemoteCacheTierConfig,
    tokens_per_block: int,
    layers: Sequence[LayerConfig],
    life_cycles: list[LifeCycle],
    layout: StorageLayout,
) -> list[KeySpace]:
    """The current secret's key space (or the unkeyed one), then each of ``previous_secret_keys``' in order."""
    secrets: list[bytes | None] = [config.secret_key, *config.previous_secret_keys]
    return [
        KeySpace(layout_key_prefixes(config, tokens_per_block, layers, life_cycles, layout, secret), secret)
        for secret in secrets
    ]


def layout_key_prefixes(
    config: RemoteCacheTierConfig,
    tokens_per_block: int,
    layers: Sequence[LayerConfig],
    life_cycles: list[LifeCycle],
    layout: StorageLayout,
    secret: bytes | None,
) -> list[str]:
    """Per life cycle, the key prefix its objects share: a digest of everything that shapes its pages' bytes. That
    is the whole model's layout, not only the life cycle's own layers: a layer's keys and values are computed from
    every layer before it, so a group whose own layers match ours but which follows a layer with another window,
    sink count or state holds other bytes; each layer is described by every field of its config
    (``layer_description``), and where its buffers sit in a page (``page_format``). The tensor-parallel rank and
    group size too: ranks hold different heads in pages of one shape. The config's ``namespace`` and, with a
    ``secret``, an identifier derived from it (one-way): each secret gets a key space of its own; without one the
    key space is the one objects stored without a secret have always had."""
    model: list[object] = []
    for life_cycle in life_cycles:
        members = [layer_description(layer) for layer in layers if layer.layer_id in life_cycle.layer_ids]
        model.append([keyed_kind(life_cycle), members])
    order = [layer.layer_id for layer in layers]
    pages = page_format(layout)
    # A group of one keeps the keys it had before the size was keyed (no cold start where nothing was ambiguous);
    # a larger group's rank and size, a list where the former was a bare rank, can equal no group of one's.
    rank, size = config.tensor_parallel_rank, config.tensor_parallel_size
    namespace, group = config.namespace, (rank if size == 1 else [rank, size])
    key_space = [] if secret is None else [hmac.new(secret, KEY_SPACE_LABEL, hashlib.sha256).hexdigest()[:32]]
    prefixes: list[str] = []
    for life_cycle in life_cycles:
        pool_group = int(layout.life_cycle_pool_group[life_cycle.id])
        shape = [FORMAT_VERSION, namespace, group, tokens_per_block, order, model, pages, *key_space]
        digest = hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:32]
        prefixes.append(f"kvm2/{digest}/lg{life_cycle.id}/pg{pool_group}/")
    return prefixes


def keyed_kind(life_cycle: LifeCycle) -> str:
    """A life cycle's kind in the words every earlier version hashed into its key prefixes (``describe()``'s until
    it counted sink blocks in English: "1 sink block(s)" stays here). Pinned apart from ``describe()``, which people
    read: rewording a message must not move every key of a model with sink tokens (a cold start for each
    deployment)."""
    if isinstance(life_cycle, WindowedAttentionLifeCycle):
        sinks = life_cycle.num_sink_blocks
        return f"sliding window {life_cycle.window}" + (f", {sinks} sink block(s)" if sinks else "")
    if isinstance(life_cycle, SsmLifeCycle):
        return "ssm"
    return "full attention"


def page_format(layout: StorageLayout) -> list[object]:
    """Where each buffer's bytes sit in a page as the tier moves it (``read_slot``: every pool's row in pool order):
    each pool's slot bytes and each buffer's pool, position among its pool's members and sub-pages. The package
    derives these from the config, and another version may derive them otherwise: keyed by what it derives, a
    version placing one buffer elsewhere never reads our pages as its own, whatever ``FORMAT_VERSION`` says."""
    pools = [group.pool_slot_bytes for group in layout.pool_groups]
    buffers: list[object] = []
    for placement in layout.placements():
        where = [placement.pool_group, placement.pool, placement.layer_offset, placement.scale]
        pages = [placement.size, placement.expansion, placement.page_in_block]
        buffers.append([placement.layer_id, placement.role, *where, *pages])
    return [pools, buffers]


def layer_description(layer: LayerConfig) -> list[object]:
    """Every field of a layer's config, its buffers' too, not what the manager derives from them: the manager counts
    sink tokens in whole blocks and groups layers by that, while attention over 4 or 8 sinks gives every later layer
    other inputs. A field added to a layer config is covered here without a change."""
    return [type(layer).__name__, dataclasses.asdict(layer)]


def object_digest(hasher: ObjectHasher, key: str, payload: HostBuffer) -> bytes:
    digest = hasher.copy()
    digest.update(key.encode())
    digest.update(payload.data)
    return digest.digest()[:DIGEST_BYTES]


def frame(hasher: ObjectHasher, key: str, payload: HostBuffer, out: HostBuffer) -> None:
    """Write the object for ``payload`` into ``out`` (header then payload; ``out`` is exactly that long), its digest
    made with ``hasher`` (``object_hasher``)."""
    out[HEADER.size :] = payload
    out[: HEADER.size] = np.frombuffer(
        HEADER.pack(MAGIC, FORMAT_VERSION, 0, payload.nbytes, object_digest(hasher, key, payload)), dtype=np.uint8
    )


def unframe(hasher: ObjectHasher, key: str, data: HostBuffer, length: int) -> HostBuffer | None:
    """The payload of an object ``length`` bytes long read into ``data``, or None unless it is exactly ours (its
    digest made with ``hasher``: with a secret, only its holders can make one)."""
    if length != data.nbytes:
        return None
    magic, version, _, size, digest = HEADER.unpack(data[: HEADER.size].tobytes())
    payload = data[HEADER.size :]
    if magic != MAGIC or version != FORMAT_VERSION or size != payload.nbytes:
        return None
    if not hmac.compare_digest(digest, object_digest(hasher, key, payload)):
        return None
    return payload
