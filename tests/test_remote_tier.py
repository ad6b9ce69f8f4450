"""The shared remote tier on a real Mooncake Store (master and storage node on loopback, started per module)."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kv_cache_manager_v2
from kv_cache_manager_v2 import (
    AttentionLayerConfig,
    BufferConfig,
    GpuCacheTierConfig,
    KVCacheManager,
    KVCacheManagerConfig,
    MooncakeStoreConfig,
    RemoteCacheTierConfig,
    RemoteStoreConfig,
    RemoteStoreError,
    RemoteTierStatistics,
    SsmLayerConfig,
)
from kv_cache_manager_v2._base.remote_store import HostBuffer
from kv_cache_manager_v2.config import LayerConfig
from kv_cache_manager_v2.testing import FakeEngine
from tests.forwarding_store import RecordingConfig
from kv_cache_manager_v2.testing.mooncake_cluster import mounted_capacity
from tests.mooncake_helpers import MooncakeCluster, cluster, free_port, require_mooncake
from tests.model_helpers import require_model
from tests.test_remote_fills import fill_under_pressure

SCENARIOS = str(Path(__file__).with_name("remote_scenarios.py"))


def child_env() -> dict[str, str]:
    """The environment that makes a child import the package this run tests (sources or compiled build)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(str(kv_cache_manager_v2.__file__)))
    return env


def run_instance(role: str, cluster: MooncakeCluster, *extra: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, SCENARIOS, role, cluster.master_address, cluster.metadata_url, *extra],
        capture_output=True, text=True, env=child_env() | (env or {}), timeout=300,
    )
    assert result.returncode == 0, f"{role}: exit {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}"
    figures: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures


class InterruptingMetadata(http.server.ThreadingHTTPServer):
    """The metadata server as a child sees it: each request forwarded to the cluster's (``target``); the first,
    which comes from inside Mooncake's setup, first sends the child SIGINT (Ctrl-C while the manager connects)."""

    def __init__(self, target: str) -> None:
        super().__init__(("127.0.0.1", 0), ForwardMetadata)
        self.target = target
        self.child_pid = 0
        self.started = threading.Event()  # set once ``child_pid`` is
        self.interrupted = False


class ForwardMetadata(http.server.BaseHTTPRequestHandler):
    def forward(self) -> None:
        server = self.server
        assert isinstance(server, InterruptingMetadata)
        if not server.interrupted and server.started.wait(30):
            server.interrupted = True
            os.kill(server.child_pid, signal.SIGINT)
        length = int(self.headers.get("Content-Length") or 0)
        request = urllib.request.Request(server.target + self.path.removeprefix("/metadata"),
                                         data=self.rfile.read(length) if length else None, method=self.command)
        if self.headers.get("Content-Type"):
            request.add_header("Content-Type", self.headers["Content-Type"])
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                status, answer = reply.status, reply.read()
        except urllib.error.HTTPError as error:
            status, answer = error.code, error.read()
        self.send_response(status)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_PUT = do_POST = do_DELETE = forward

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_ctrl_c_while_the_store_connects_leaves_no_client_lending_memory(cluster: MooncakeCluster) -> None:
    """Ctrl-C (or the command line's SIGTERM) during Mooncake's setup is raised once setup has connected: the
    client, lending the manager's quota to the store, was never closed, and the store went on counting those bytes
    for a manager that does not exist, as long as the error was kept. Before: capacity 301989888 (256 + 32 MiB)."""
    server = InterruptingMetadata(cluster.metadata_url)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        child = subprocess.Popen(
            [sys.executable, SCENARIOS, "interrupted-open", cluster.master_address,
             f"http://127.0.0.1:{server.server_address[1]}/metadata", str(cluster.metrics_port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal (see test_cli)
        )
        server.child_pid = child.pid
        server.started.set()
        output, errors = child.communicate(timeout=300)
    finally:
        server.shutdown()
        server.server_close()
    assert child.returncode == 0 and server.interrupted, (child.returncode, output, errors[-4000:])
    figures = json.loads(output.strip().splitlines()[-1])
    assert figures["interrupted"] is True, figures
    assert figures["capacity"] == mounted_capacity(cluster.metrics_port) == 256 << 20, figures


def test_second_process_reuses_the_system_prompt_the_first_computed(cluster: MooncakeCluster) -> None:
    first = run_instance("compute", cluster)
    assert first["reused"] == 0 and first["stored_pages"] > 0 and first["warnings"] == 0
    second = run_instance("reuse", cluster)
    # A fresh process has nothing locally: all 10 system-prompt blocks came from the store, content checked:
    # 10 full-attention pages and the window's 3 (48 tokens before position 160).
    assert second["reused"] == 160 and second["checked"] >= 160
    assert second["fetched_pages"] == 10 + 3 and second["warnings"] == 0


def test_second_process_greedy_tokens_equal_a_single_process_run_with_smollm2(cluster: MooncakeCluster) -> None:
    require_model("smollm2")
    alone = run_instance("model-alone", cluster)
    first = run_instance("model-compute", cluster)
    second = run_instance("model-reuse", cluster)
    assert alone["reused"] == 0 and first["reused"] == 0
    # The system prompt's full blocks came from the first process's pages (signed with the deployment's secret in
    # that process, verified in this one); the tokens are the same.
    assert second["reused"] >= 32
    assert second["output"] == alone["output"] and second["prompt"] == alone["prompt"]


# ------------------------------------------------------------------------------------- one process, two managers
TPB = 16


def layers_with_window_and_ssm(ssm: bool) -> list[LayerConfig]:
    layers: list[LayerConfig] = [
        AttentionLayerConfig(0, [BufferConfig("key", 1024), BufferConfig("value", 1024)]),
        AttentionLayerConfig(1, [BufferConfig("key", 1024), BufferConfig("value", 1024)], sliding_window_size=32),
    ]
    if ssm:
        layers.append(SsmLayerConfig(2, [BufferConfig("ssm_state", 4096), BufferConfig("conv_state", 512)]))
    return layers


def make_manager(
    backend: RemoteStoreConfig, namespace: str, ssm: bool = False, write_through: bool = True,
    gpu_bytes: int = 1 << 20,
) -> KVCacheManager:
    remote = RemoteCacheTierConfig(0, backend, namespace=namespace, write_through=write_through)
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=TPB, layers=layers_with_window_and_ssm(ssm), backend="cpu",
        cache_tiers=[GpuCacheTierConfig(gpu_bytes), remote], ssm_reuse_interval=4 * TPB,
    ))


def serve(manager: KVCacheManager, tokens: list[int]) -> int:
    """Serve one request after its reused prefix (checked) in prefill chunks of 4 blocks (each committed: SSM
    snapshots are taken at chunk ends on the reuse interval), close; the reused length."""
    engine = FakeEngine(manager)
    cache = manager.create_kv_cache(input_tokens=tokens)
    reused = cache.num_committed_tokens
    assert cache.resume()
    engine.check(cache, tokens)
    done = reused
    while done < len(tokens):
        end = min(len(tokens), done + 4 * TPB - done % (4 * TPB))
        assert cache.resize(end)
        engine.step(cache, tokens)
        cache.commit(tokens[done:end])
        done = end
    cache.close()
    manager.check_invariants()
    return reused


def stats_of(manager: KVCacheManager) -> RemoteTierStatistics:
    stats = manager.get_remote_tier_statistics()
    assert stats is not None
    return stats


def prompt(seed: int, blocks: int = 8, extra: int = 5) -> list[int]:
    return [seed * 10_000 + i for i in range(blocks * TPB + extra)]


@pytest.mark.parametrize("ssm", [False, True])
def test_a_second_manager_fetches_only_what_each_layer_group_needs(cluster: MooncakeCluster, ssm: bool) -> None:
    namespace = f"needs-{ssm}"
    first = make_manager(cluster.config(), namespace, ssm=ssm)
    tokens = prompt(1)
    assert serve(first, tokens) == 0
    stored = stats_of(first).stored_pages
    # Full attention and the window store every full block (each may end some later match); SSM only snapshots.
    assert stored == 8 + 8 + (2 if ssm else 0)
    second = make_manager(cluster.config(), namespace, ssm=ssm)
    assert serve(second, tokens) == 8 * TPB
    stats = stats_of(second)
    # Full attention: 8 blocks; window of 32 tokens at 128: blocks 6 and 7 (and block 5 holds none of it); SSM:
    # the snapshot at block 8 only.
    assert stats.fetched_pages == 8 + 2 + (1 if ssm else 0)
    assert stats.rejected_pages == 0 and stats.warnings == 0
    first.shutdown()
    second.shutdown()


def test_another_layout_or_namespace_never_reads_our_objects(cluster: MooncakeCluster) -> None:
    first = make_manager(cluster.config(), "layout")
    tokens = prompt(2)
    serve(first, tokens)
    other = make_manager(cluster.config(), "layout-other-dtype")
    assert serve(other, tokens) == 0
    assert stats_of(other).found_pages == 0 and stats_of(other).probed_pages > 0
    first.shutdown()
    other.shutdown()


def test_write_back_stores_a_page_when_the_coldest_tier_drops_it_and_reads_it_back(cluster: MooncakeCluster) -> None:
    manager = make_manager(cluster.config(), "write-back", write_through=False, gpu_bytes=24 * 2048)
    tokens = prompt(3, blocks=4)
    assert serve(manager, tokens) == 0
    assert stats_of(manager).stored_pages == 0  # nothing dropped yet
    for seed in range(10, 14):  # other requests push the first one's blocks out of the only local tier
        serve(manager, prompt(seed, blocks=4))
    assert stats_of(manager).stored_pages > 0
    assert serve(manager, tokens) == 4 * TPB  # read back from the store, content checked
    assert stats_of(manager).fetched_pages > 0
    manager.shutdown()


def test_write_back_shutdown_hands_every_cached_page_to_the_store(cluster: MooncakeCluster) -> None:
    leaving = make_manager(cluster.config(), "write-back-shutdown", write_through=False)
    tokens = prompt(9, blocks=4)
    serve(leaving, tokens)
    assert stats_of(leaving).stored_pages == 0
    leaving.shutdown()  # its cached blocks leave the instance: into the store
    assert stats_of(leaving).stored_pages == 4 + 4
    staying = make_manager(cluster.config(), "write-back-shutdown")
    assert serve(staying, tokens) == 4 * TPB
    staying.shutdown()


def test_a_master_killed_mid_run_turns_into_counted_misses(tmp_path: Path) -> None:
    own = MooncakeCluster(require_mooncake())  # this test kills its master
    try:
        manager = make_manager(own.config(), "killed")
        serve(manager, prompt(5))
        assert stats_of(manager).stored_pages > 0
        own.kill_master()
        for seed in (5, 6, 7):  # a prefix only the store had, then new prompts: all served, misses only
            serve(manager, prompt(seed) + [1, 2, 3])
        stats = stats_of(manager)
        assert stats.warnings >= 1 and stats.store_failures + stats.skipped_while_down > 0
        assert stats.fetched_pages == 0
        manager.check_invariants()
        manager.shutdown()
    finally:
        own.stop()


def test_a_master_killed_between_commits_is_left_alone_after_the_first_write_it_failed(tmp_path: Path) -> None:
    """The master dies after a request's probe: each later Mooncake call waits ~4.3 s for it, and ``health_check``
    still answers 0. Before, the tier took the refused batch for a full store and wrote the next commit through
    again: one put per commit, 3 of them ~4.3 s each here (a long prefill stalled for minutes). RPC_FAIL now reads
    as the store being down: one put, then the commits are skipped for ``retry_after_s``."""
    own = MooncakeCluster(require_mooncake(), segment_bytes=16 << 20)  # this test kills its master
    try:
        backend = RecordingConfig(own.config())
        manager = make_manager(backend, "killed-between-commits")
        tokens = prompt(6, blocks=16)
        engine = FakeEngine(manager)
        cache = manager.create_kv_cache(input_tokens=tokens)  # the probe: the master still answers
        own.kill_master()
        assert cache.resume()
        for end in range(4 * TPB, 16 * TPB + 1, 4 * TPB):  # 4 chunks of 4 blocks, each committed: written through
            assert cache.resize(end)
            engine.step(cache, tokens)
            cache.commit(tokens[end - 4 * TPB : end])
        engine.check(cache, tokens[: 16 * TPB])
        cache.close()
        stats = stats_of(manager)
        assert backend.stores[0].puts == 1 and stats.skipped_while_down > 0, (backend.stores[0].puts, stats)
        manager.check_invariants()
        manager.shutdown()
    finally:
        own.stop()


def test_the_buffers_of_a_transfer_that_failed_outlive_the_call(tmp_path: Path) -> None:
    """A storage node stopped (SIGSTOP: a partition, a stalled host) fails a get after Mooncake's timeouts, 60 s by
    default. Its transfers are not all cancelled: once the node ran again, bytes landed in the buffers of that
    failed get (4 of 8, 0.5 s after SIGCONT), and in a manager, whose tier frees those buffers at once, the process
    died of heap corruption (glibc: "corrupted size vs. prev_size"). The store keeps them: before, none was alive.
    Mooncake's timeouts are cut to 1 s here (``MC_TCP_*_TIMEOUT_SEC``), where the late write itself is rare."""
    own = MooncakeCluster(require_mooncake(), segment_bytes=16 << 20)  # this test stops its storage node
    try:
        assert own.node is not None
        short = {"MC_TCP_PROGRESS_TIMEOUT_SEC": "1", "MC_TCP_STATUS_TIMEOUT_SEC": "1"}
        figures = run_instance("failed-transfer", own, str(own.node.pid), env=short)
    finally:
        own.stop()
    assert figures["failed"] == 8 and figures["alive"] == 8 and figures["held_bytes"] == 8 * (64 << 10), figures


def test_a_full_store_refuses_pages_as_counted_warnings_never_an_error() -> None:
    own = MooncakeCluster(require_mooncake(), segment_bytes=16 << 20)  # Mooncake's smallest storage node
    try:
        big = [AttentionLayerConfig(0, [BufferConfig("key", 32 << 10), BufferConfig("value", 32 << 10)])]
        remote = RemoteCacheTierConfig(0, own.config(), namespace="full")

        def manager() -> KVCacheManager:
            return KVCacheManager(KVCacheManagerConfig(
                tokens_per_block=TPB, layers=big, backend="cpu", cache_tiers=[GpuCacheTierConfig(32 << 20), remote]
            ))

        writer = manager()
        tokens = prompt(8, blocks=400)  # 400 pages of 64 KiB: 25 MiB for a 16 MiB store
        serve(writer, tokens)
        stats = stats_of(writer)
        assert stats.stored_pages > 0 and stats.store_failures > 0 and stats.warnings >= 1
        assert stats.stored_pages + stats.store_failures == 400
        writer.check_invariants()
        reader = manager()
        reused = serve(reader, tokens)  # what the store kept of the prefix, every page checked
        assert reused == stats_of(reader).fetched_pages * TPB
        writer.shutdown()
        reader.shutdown()
    finally:
        own.stop()


def test_a_stopped_cluster_leaves_no_log_directory() -> None:
    """Before: every ``MooncakeCluster`` left its ``mooncake-*`` log directory in the temp directory for good (180
    of them on the shared test machine); ``stop`` now removes it with the processes."""
    own = MooncakeCluster(require_mooncake(), segment_bytes=16 << 20)
    logs = own.logs
    try:
        assert sorted(path.name for path in logs.iterdir()) == ["master.log", "node.log"]
    finally:
        own.stop()
    assert not logs.exists()


def test_remote_tier_config_rules() -> None:
    backend = MooncakeStoreConfig("127.0.0.1:1", "http://127.0.0.1:2/metadata")
    with pytest.raises(ValueError, match="quota must be >= 0"):
        RemoteCacheTierConfig(-1, backend, "m")
    with pytest.raises(TypeError, match="open"):
        RemoteCacheTierConfig(0, object(), "m")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="retry_after_s"):
        RemoteCacheTierConfig(0, backend, "m", retry_after_s=float("nan"))
    with pytest.raises(ValueError, match="master_address"):
        MooncakeStoreConfig("", "http://127.0.0.1:2/metadata")
    # Two models with the same layer shapes (a fine-tune) have the same layout digest: only the namespace keeps
    # their pages apart, so it must be given.
    with pytest.raises(TypeError, match="namespace"):
        RemoteCacheTierConfig(0, backend)  # type: ignore[call-arg]
    for blank in ("", "  "):
        with pytest.raises(ValueError, match="namespace must name the model"):
            RemoteCacheTierConfig(0, backend, blank)
    remote = RemoteCacheTierConfig(np.int64(0), backend, "m")  # type: ignore[arg-type]
    assert type(remote.quota) is int
    layers = layers_with_window_and_ssm(False)
    with pytest.raises(ValueError, match="only the last tier may be remote"):
        KVCacheManagerConfig(tokens_per_block=TPB, layers=layers, cache_tiers=[GpuCacheTierConfig(1 << 20), remote,
                                                                               GpuCacheTierConfig(1 << 20)])
    with pytest.raises(ValueError, match="must be a GpuCacheTierConfig"):
        KVCacheManagerConfig(tokens_per_block=TPB, layers=layers, cache_tiers=[remote])


def test_an_unreachable_store_fails_construction_with_remote_store_error(cluster: MooncakeCluster) -> None:
    # A dead metadata server fails setup in ~2 s (a dead master only after ~90 s of retries).
    dead = MooncakeStoreConfig(cluster.master_address, f"http://127.0.0.1:{free_port()}/metadata")
    with pytest.raises(RemoteStoreError, match="Mooncake setup failed"):
        make_manager(dead, "dead")


def test_a_fill_keeps_the_blocks_it_fills_while_evicting_on_mooncake(cluster: MooncakeCluster) -> None:
    fill_under_pressure(cluster.config(), "fill-under-pressure")  # issue #35 item 1 on the real store


def test_cluster_startup_waits_for_readiness_and_reports_a_process_that_died(tmp_path: Path) -> None:
    """The cluster's one readiness loop: it returns once the check holds, and a process that exits first fails at
    once with its log's tail (not after the startup timeout)."""
    from kv_cache_manager_v2.testing.mooncake_cluster import wait_until

    log = tmp_path / "node.log"
    log.write_text("segment mount failed: no memory\n")
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        checks = iter([False, False, True])
        wait_until(lambda: next(checks), alive, "the segment", log)
    finally:
        alive.kill()
        alive.wait()
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(RuntimeError, match="the segment: the process exited with 3: segment mount failed"):
        wait_until(lambda: False, dead, "the segment", log)


def test_a_get_from_a_stopped_storage_node_is_a_miss_after_get_deadline_s() -> None:
    """A storage node cut off while the master still lists it (SIGSTOP: no namespaces needed) held every fetch for
    Mooncake's transfer timeouts (60 s by default, as here). ``get_deadline_s`` (1 s here) bounds it: the prompt is
    computed instead (a miss), the store counts as down, and no put goes to the node. ``shutdown``, with the node
    still stopped, then waited for that get: ~60 s (59.9 s measured). It now waits at most ``CLOSE_WAIT_S``, and the
    buffers the abandoned get may still write into outlive the manager (before: none of the 13 was alive)."""
    from kv_cache_manager_v2._remote.mooncake import CLOSE_WAIT_S

    own = MooncakeCluster(require_mooncake(), segment_bytes=16 << 20)  # this test stops its storage node
    try:
        assert own.node is not None
        assert run_instance("compute", own)["stored_pages"] > 0
        figures = run_instance("stalled-get", own, str(own.node.pid), "1.0")
    finally:
        own.stop()
    assert figures["reused"] == 0 and figures["fetched_pages"] == 0 and figures["fetch_failures"] > 0, figures
    assert figures["warnings"] == 1 and figures["skipped_while_down"] > 0 and figures["stored_pages"] == 0, figures
    assert figures["elapsed"] < 3.0, figures
    assert figures["shutdown"] < CLOSE_WAIT_S + 1.0, figures
    assert figures["gets"] > 0 and figures["alive"] == figures["gets"], figures


def test_a_put_to_a_stopped_storage_node_fails_after_put_deadline_s_keeping_its_buffers() -> None:
    """A write-through put to a storage node cut off while the master still lists it held the commit for Mooncake's
    transfer timeouts (~6 s with them at 3 s as here). ``put_deadline_s`` (1 s) bounds it: the pages are not stored
    and the store counts as down; a put on a client of its own raises by then, keeping the 8 buffers it may still
    read (dropped by the caller: freed memory Mooncake would read, or another object's bytes). Once the node
    answers again, those puts may complete: what they leave must be their content, never a stale object."""
    own = MooncakeCluster(require_mooncake(), segment_bytes=16 << 20)  # this test stops its storage node
    try:
        assert own.node is not None
        short = {"MC_TCP_PROGRESS_TIMEOUT_SEC": "3", "MC_TCP_STATUS_TIMEOUT_SEC": "3"}
        figures = run_instance("stalled-put", own, str(own.node.pid), "1.0", env=short)
    finally:
        own.stop()
    assert figures["served"] < 3.0 and figures["stored_pages"] == 0 and figures["store_failures"] > 0, figures
    assert figures["warnings"] == 1, figures
    assert figures["put"] < 3.0 and "batch_put_from of 8 objects did not answer within put_deadline_s=1.0 s" in figures["error"], figures
    assert figures["held_bytes"] == 8 * (64 << 10) and figures["alive"] == 8, figures
    # The late puts' keys, put again with the same content (as the tier stores a page again) and read back, hold
    # that content; a new instance serving the prompt whose write-through stalled checks every token it reuses.
    assert figures["stored"] == 8 and figures["wrong"] == 0, figures
    assert figures["again"]["checked"] >= figures["again"]["reused"], figures


@pytest.mark.parametrize("name", ["get_deadline_s", "put_deadline_s"])
@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_deadlines_must_be_finite_positive_numbers_naming_them(name: str, bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match=f"MooncakeStoreConfig.{name}"):
        MooncakeStoreConfig("127.0.0.1:1", "http://127.0.0.1:1/metadata", **{name: bad})  # type: ignore[arg-type]
    numpy_deadline = MooncakeStoreConfig("127.0.0.1:1", "http://127.0.0.1:1/metadata", **{name: np.float32(0.5)})  # type: ignore[arg-type]
    assert getattr(numpy_deadline, name) == 0.5 and type(getattr(numpy_deadline, name)) is float


def test_a_mooncake_call_that_raises_is_its_error_not_a_stall_holding_buffers(cluster: MooncakeCluster) -> None:
    """A key Mooncake's binding cannot convert (a lone surrogate) makes the call raise on the transfer's thread: the
    caller gets that error at once, and no buffer is kept as if a transfer might still touch it."""
    from kv_cache_manager_v2._remote.mooncake import MooncakeStore

    client = cluster.config().open(0)
    assert isinstance(client, MooncakeStore)
    buffers: list[HostBuffer] = [np.zeros(4096, dtype=np.uint8)]
    try:
        for transfer in (client.put_batch, client.get_batch):
            with pytest.raises(TypeError, match="incompatible function arguments"):
                transfer(["bad-key-\ud800"], buffers)
        assert client.held_bytes == 0
    finally:
        client.close()
