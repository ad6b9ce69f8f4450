"""The disk tier on real filesystems (SPEC §1, §8): blocks reserved up front, no files left behind.

A disk tier maps its pool files into memory; a write into a sparse file on a full filesystem is a SIGBUS, so the
small-filesystem scenarios run in a child process, in a private mount namespace (``unshare``, no root needed
where user namespaces are enabled) on a tmpfs of a few hundred KiB: a real filesystem that really runs out.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2 import CacheTier, DiskCacheTierConfig, GpuCacheTierConfig, KVCache, KVCacheManager
from kv_cache_manager_v2._storage.memory import DiskPoolMemory, MemoryBackend
from kv_cache_manager_v2.testing import FakeEngine
from tests.helpers import KIB, attention, make_config

SCENARIOS = str(Path(__file__).with_name("disk_scenarios.py"))


def child_env() -> dict[str, str]:
    """The environment that makes a child import the package this run tests (sources or compiled build)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(str(kv_cache_manager_v2.__file__)))
    return env


def unshare_command(size: str, directory: Path) -> list[str]:
    """Run the rest of a command in a new user + mount namespace with a ``size`` tmpfs on ``directory``."""
    mount = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, "sh", size, str(directory)]


def run_on_small_filesystem(size: str, scenario: str, directory: Path) -> None:
    probe = subprocess.run(unshare_command("64k", directory) + ["true"], capture_output=True, text=True)
    if shutil.which("unshare") is None or probe.returncode != 0:
        pytest.skip(f"no private mount namespace here (unshare: {probe.stderr.strip()!r})")
    result = subprocess.run(
        unshare_command(size, directory) + [sys.executable, SCENARIOS, scenario, str(directory)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        f"{scenario}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    )



def compute_and_suspend(manager: KVCacheManager, engine: FakeEngine, count: int) -> list[tuple[KVCache, list[int]]]:
    """``count`` caches of 4 blocks each computed and suspended: their pages move down as the GPU tier fills."""
    suspended: list[tuple[KVCache, list[int]]] = []
    for seed in range(count):
        tokens = [seed * 100 + i for i in range(4 * 16)]
        cache = manager.create_kv_cache()
        assert cache.resume() and cache.resize(len(tokens))
        engine.step(cache, tokens)
        cache.resize(len(tokens), len(tokens))
        cache.suspend()
        suspended.append((cache, tokens))
    return suspended

def test_disk_tier_larger_than_its_filesystem_is_refused_at_construction(tmp_path: Path) -> None:
    run_on_small_filesystem("256k", "refused", tmp_path)


def test_disk_tier_blocks_are_reserved_so_a_full_filesystem_never_kills_the_process(tmp_path: Path) -> None:
    run_on_small_filesystem("1m", "reserved", tmp_path)


def test_a_disk_tier_on_a_read_only_filesystem_is_refused_naming_the_path(tmp_path: Path) -> None:
    """Before: a bare ``OSError: [Errno 30] Read-only file system`` naming only a generated pool file name."""
    run_on_small_filesystem("64k,ro", "read_only", tmp_path)  # the size string carries the mount's ro option


@pytest.mark.parametrize("directory", ["/proc", "/sys"])
def test_a_disk_tier_on_a_kernel_interface_is_a_configuration_error(directory: str) -> None:
    """Before: ``OSError: [Errno 28] ... the filesystem has 0 bytes available``, a shortage where the path itself
    is wrong (procfs and sysfs have no storage blocks at all)."""
    tiers = [GpuCacheTierConfig(8 * KIB), DiskCacheTierConfig(64 * KIB, directory)]
    with pytest.raises(ValueError, match=f"DiskCacheTierConfig.path '{directory}' is on a filesystem with no storage"):
        KVCacheManager(make_config([attention(0, KIB)], tiers=tiers, tokens_per_block=16))  # type: ignore[arg-type]


def test_disk_tier_leaves_no_pool_file_in_its_directory(tmp_path: Path) -> None:
    slot = 2 * KIB
    tiers = [GpuCacheTierConfig(8 * slot), DiskCacheTierConfig(64 * slot, str(tmp_path))]
    manager = KVCacheManager(make_config([attention(0, KIB)], tiers=tiers, tokens_per_block=16))  # type: ignore[arg-type]
    engine = FakeEngine(manager)
    suspended = compute_and_suspend(manager, engine, 3)  # 12 held pages through 8 GPU slots: 4 of them live on disk
    assert manager.get_storage_statistics(1)[0].free == 64 - 4
    assert os.listdir(tmp_path) == []
    for cache, tokens in suspended:
        assert cache.resume()
        engine.check(cache, tokens)
        cache.close()
    manager.shutdown()
    assert os.listdir(tmp_path) == []


def test_killed_process_leaves_no_pool_file(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, SCENARIOS, "killed", str(tmp_path)], stdout=subprocess.PIPE, text=True, env=child_env()
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        assert os.listdir(tmp_path) == []
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert os.listdir(tmp_path) == []


def test_a_pool_file_larger_than_the_process_may_write_is_refused_naming_the_path_and_the_limit(
    tmp_path: Path,
) -> None:
    """A file size limit (``ulimit -f``, RLIMIT_FSIZE; Python ignores its SIGXFSZ) below a pool file's size: the
    construction fails like a filesystem too small, naming the path, the bytes and the limit. Before: a bare
    ``OSError: [Errno 27] File too large`` from the pool file's ``ftruncate``."""
    slot = 2 * KIB
    tiers = [GpuCacheTierConfig(8 * slot), DiskCacheTierConfig(64 * slot, str(tmp_path))]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    limit = 16 * slot
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(OSError, match="RLIMIT_FSIZE") as raised:
            KVCacheManager(make_config([attention(0, KIB)], tiers=tiers, tokens_per_block=16))  # type: ignore[arg-type]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert raised.value.errno == errno.EFBIG
    message = str(raised.value)
    assert f"DiskCacheTierConfig.path {str(tmp_path)!r}" in message and "RLIMIT_FSIZE" in message, message
    assert f"needs {64 * slot} bytes" in message and f"{limit} bytes" in message, message
    assert os.listdir(tmp_path) == []


def test_two_managers_share_one_directory_each_with_its_own_content(tmp_path: Path) -> None:
    """What an engine running two managers on one host expects of one disk directory: each keeps its own pages."""
    slot = 2 * KIB
    tiers = [GpuCacheTierConfig(8 * slot), DiskCacheTierConfig(32 * slot, str(tmp_path))]
    managers = [
        KVCacheManager(make_config([attention(0, KIB)], tiers=tiers, tokens_per_block=16))  # type: ignore[arg-type]
        for _ in range(2)
    ]
    engines = [FakeEngine(manager) for manager in managers]
    suspended = []
    for round_ in range(3):  # interleaved: 4 of each manager's 12 held pages live on the disk
        for index, (manager, engine) in enumerate(zip(managers, engines)):
            tokens = [index * 10_000 + round_ * 100 + i for i in range(4 * 16)]
            cache = manager.create_kv_cache()
            assert cache.resume() and cache.resize(len(tokens))
            engine.step(cache, tokens)
            cache.resize(len(tokens), len(tokens))
            cache.suspend()
            suspended.append((engine, cache, tokens))
    assert [manager.get_storage_statistics(1)[0].free for manager in managers] == [32 - 4, 32 - 4]
    for engine, cache, tokens in suspended:
        assert cache.resume()
        engine.check(cache, tokens)
        cache.close()
    for manager in managers:
        manager.shutdown()
    assert os.listdir(tmp_path) == []


def test_two_processes_on_one_directory_each_read_their_own_pages(tmp_path: Path) -> None:
    """Two serving processes on one disk directory (or a restarted one beside the old): each writes its pages down
    to disk while the other runs, then reads back its own, never the other's."""
    children = [
        subprocess.Popen(
            [sys.executable, SCENARIOS, "shared", str(tmp_path), str(first_seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        )
        for first_seed in (0, 100)
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        outputs = [child.communicate("go\n", timeout=120) for child in children]
    finally:
        for child in children:
            child.kill()
    for child, (out, err) in zip(children, outputs):
        assert child.returncode == 0 and out.strip().endswith("ok"), f"exit {child.returncode}\n{out}\n{err}"
    assert os.listdir(tmp_path) == []


def test_a_leftover_pool_file_neither_collides_nor_is_touched(tmp_path: Path) -> None:
    """A process killed between a pool file's create and unlink leaves the file; its successor in a restarted
    container has the same pid, and allocates its objects at the same addresses. Before: a name was the pid, the
    backend's address and a counter, so the next backend at a freed one's address raised a bare
    ``FileExistsError`` naming the leftover."""
    leftovers: dict[str, bytes] = {}
    for generation in range(20):
        backend = MemoryBackend("cpu")
        pool = backend.allocate(CacheTier.DISK, 4096, str(tmp_path))
        assert isinstance(pool, DiskPoolMemory)
        pool.close()
        content = f"left by generation {generation}".encode()
        Path(pool.path).write_bytes(content)  # what a kill between create and unlink leaves at that name
        leftovers[pool.path] = content
        del backend, pool
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(path) for path in leftovers)
    assert all(Path(path).read_bytes() == content for path, content in leftovers.items())


def test_a_disk_directory_removed_while_running_changes_nothing(tmp_path: Path) -> None:
    """The pool files are unlinked at creation, so removing their directory (a cleanup job, an operator) leaves
    the tier serving its pages from the open descriptors, and shutdown completes."""
    directory = tmp_path / "disk"
    directory.mkdir()
    slot = 2 * KIB
    tiers = [GpuCacheTierConfig(8 * slot), DiskCacheTierConfig(32 * slot, str(directory))]
    manager = KVCacheManager(make_config([attention(0, KIB)], tiers=tiers, tokens_per_block=16))  # type: ignore[arg-type]
    shutil.rmtree(directory)
    engine = FakeEngine(manager)
    # 24 pages through 8 GPU slots: 16 of them written to disk after the removal
    suspended = compute_and_suspend(manager, engine, 6)
    assert manager.get_storage_statistics(1)[0].free == 32 - 16
    for cache, tokens in suspended:
        assert cache.resume()
        engine.check(cache, tokens)
        cache.close()
    manager.shutdown()
    assert not directory.exists()
