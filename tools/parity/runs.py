"""Five scenarios of ``tools/mode_parity.py``: the edge sweep's bad values, every integer and bool parameter given
a NumPy integer or the wrong kind of bool, the stateful fuzzer's seeded driver, value objects across pickle
(``pickles`` here, ``unpickles`` in the other mode), and the simulator's figures."""

from __future__ import annotations

import base64
import copy
import io
import json
import pickle
import random
import tempfile
from contextlib import redirect_stdout
from pathlib import Path
from typing import Callable

import numpy as np

from kv_cache_manager_v2.kv_events.adapter import EventTranslator
from kv_cache_manager_v2.kv_events.wire import EventBatch
from tests.fuzz.configs import CONFIGS
from tools.parity.describe import ADDRESS, describe, outcome, type_name
from tools.parity.scenarios import Recorder, Transcript, WorkloadWorld

# The simulator's report keys that measure time (everything else must be equal).
PRINTED_TIMINGS = ("time", "µs", "done in", " s:", "/s")
TIMING_KEYS = ("seconds", "_ns", "_s", "time", "per_s", "elapsed", "wall", "cpu", "rate")


def address_only(described: object) -> object:
    """A returned address's type (its value differs between processes); an exception as it is."""
    if isinstance(described, list) and described[0] == "returned":
        return ["returned", described[1][0]]
    return described


def sweep() -> Transcript:
    """Every bad value of ``tests/test_edge_sweep.py``'s rows on its world, then each row's valid call with NumPy
    integers, in order (the world's state moves the same way in both modes)."""
    from tests import test_edge_sweep as edge

    transcript: Transcript = []
    record = Recorder(transcript)
    world = edge.World()
    for param in edge.PARAMS + edge.CONFIG_PARAMS:
        for label, value, _ in param.bad:
            arguments = {**param.valid, param.name: value}
            result = record(f"{param.owner}({param.name}={label})", lambda: param.target(world)(**arguments))
            edge.close_made(result)
            if "address" in param.owner:  # a process's memory address: its type alone compares
                transcript[-1][1] = address_only(transcript[-1][1])
        valid = param.valid.get(param.name)
        if type(valid) is int and param.owner != "resize(manager)":
            for kind in (np.int64, np.int32, np.uint64):
                arguments = {**param.valid, param.name: kind(valid)}
                result = record(f"{param.owner}({param.name}={kind.__name__})", lambda: param.target(world)(**arguments))
                edge.close_made(result)
                if "address" in param.owner:
                    transcript[-1][1] = address_only(transcript[-1][1])
    record("observe", world.observe)
    world.close()
    return transcript


def arguments() -> Transcript:
    """``tests/test_bool_args.py``'s valid call of every integer and bool parameter its walk finds, the parameter
    replaced: an integer one by ``True``, ``numpy.True_`` and its value as ``numpy.int64``, a bool one by ``1`` and
    ``numpy.True_``. A parameter added to the public surface is swept here once that test has its call."""
    from tests import test_bool_args as calls

    transcript: Transcript = []
    world = calls.World()
    sweeps = [(owner, parameter, calls.INTEGER_VALUES) for owner, parameter in calls.walked()]
    sweeps += [(owner, parameter, calls.BOOL_VALUES) for owner, parameter in calls.walked_bools()]
    for owner, parameter, values in sweeps:
        arguments = calls.CALLS[owner](world)[1]
        valid = arguments.get(parameter)
        tried = dict(values)
        if values is calls.INTEGER_VALUES and type(valid) is int and owner not in calls.RUNS_ONCE:
            tried["numpy.int64"] = np.int64(valid)
        for label, value in tried.items():
            answer = calls.answer(world, owner, {**arguments, parameter: value})
            # a process's memory address: its type alone compares
            transcript.append([f"{owner}({parameter}={label})", address_only(answer) if "address" in owner else answer])
    world.close()
    return transcript


def fuzz(seed: int, operations: int) -> Transcript:
    """``tools/soak.py``'s loop: each config's Fuzzer (every check after every operation) under one seeded driver."""
    from tests.fuzz.driver import Fuzzer

    transcript: Transcript = []
    record = Recorder(transcript)
    rng = random.Random(seed)
    for config in CONFIGS:
        fuzzer = Fuzzer(config)
        # drop_in_cycle arms the cycle collector at an allocation count, which compiled code (allocating less)
        # reaches at another call: the dropped cache is then closed at another call's boundary in each mode.
        enabled = fuzzer.enabled
        fuzzer.enabled = lambda operation: operation != "drop_in_cycle" and enabled(operation)  # type: ignore[method-assign]
        for _ in range(max(1, operations // len(CONFIGS))):
            record(config.name, lambda: fuzzer.random_step(rng))
            if transcript[-1][1][0] == "returned":  # type: ignore[index]
                record("check", fuzzer.check)
            if transcript[-1][1][0] == "raised":  # type: ignore[index]
                fuzzer.broken = True
                break
        record("teardown", fuzzer.teardown)
        record("stats", lambda: fuzzer.stats)
    return transcript


def value_objects(seed: int) -> list[tuple[str, object]]:
    """Value objects a user keeps or sends: events, statistics, usage, refusals, configs, wire batches."""
    rng = random.Random(seed)
    transcript: Transcript = []
    objects: list[tuple[str, object]] = []
    with tempfile.TemporaryDirectory() as directory:
        for config in CONFIGS:
            Path(directory, config.name).mkdir()
            world = WorkloadWorld(config, str(Path(directory, config.name)), rng, Recorder(transcript))
            translator = EventTranslator.for_manager(world.manager)
            for _ in range(60):
                world.step()
            manager = world.manager
            events = manager.get_latest_events()
            objects += [
                (f"{config.name} events", events),
                (f"{config.name} trtllm events", flushed_events(world)),
                (f"{config.name} wire", EventBatch(1.5, tuple(translator.translate(events)))),
                (f"{config.name} statistics", manager.get_storage_statistics(0)),
                (f"{config.name} usage", manager.get_usage()),
                (f"{config.name} iteration", manager.get_and_reset_iteration_stats()),
                (f"{config.name} committed", manager.get_committed_stats()),
                (f"{config.name} movement", manager.movement_counters),
                (f"{config.name} refusal", manager.last_refusal),
                (f"{config.name} config", manager.config),
                (f"{config.name} remote", manager.get_remote_tier_statistics()),
            ]
            objects += [(f"{config.name} cache refusal", cache.last_refusal) for cache, _ in world.caches]
            world.close()
    from tests.test_value_types import made_directly, produced_by_a_manager

    objects += [(f"public value {index}", value) for index, value in enumerate(produced_by_a_manager() + made_directly())]
    return objects


def flushed_events(world: WorkloadWorld) -> list[object]:
    world.event_manager.flush_iteration_events()
    return list(world.event_manager.get_latest_events())


def pickle_all(seed: int) -> Transcript:
    """``[label, described, pickle as base64]`` of each value object (one that cannot be pickled: the error)."""
    rows: Transcript = []
    for label, value in value_objects(seed):
        try:
            data = base64.b64encode(pickle.dumps(value)).decode()
        except Exception as error:  # noqa: BLE001 - refusing to pickle is an observable answer
            rows.append([label, ["unpicklable", type_name(error), str(error)], ""])
            continue
        rows.append([label, describe(value), data])
        rows.append([f"{label} in-mode", in_mode_facts(value), ""])
    return rows


def in_mode_facts(value: object) -> object:
    """What a value answers inside one mode: its copies, equality to them, its hash and str."""
    facts: list[object] = []
    round_trips: tuple[tuple[str, Callable[[object], object]], ...] = (
        ("copy", copy.copy), ("deepcopy", copy.deepcopy), ("pickle", lambda v: pickle.loads(pickle.dumps(v)))
    )
    for name, again in round_trips:
        copied = outcome(lambda: again(value))
        facts.append([name, copied[0], outcome(lambda: copied[1] == value)[0]])
    facts.append(["hash as a copy's", outcome(lambda: hash(value) == hash(copy.deepcopy(value)))[0]])
    facts.append(["str", outcome(lambda: str(value))[0]])
    return facts


def unpickle_all(rows: Transcript) -> Transcript:
    """Load the other mode's pickles and describe what came out."""
    loaded: Transcript = []
    for label, described, data in rows:
        if not data:
            loaded.append([label, described])
            continue
        value = outcome(lambda: pickle.loads(base64.b64decode(str(data).encode())))
        loaded.append([label, value[0][1] if value[0][0] == "returned" else value[0]])  # type: ignore[index]
    return loaded


def without_timings(value: object) -> object:
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if k != "compiled" and not any(t in k for t in TIMING_KEYS)}
    if isinstance(value, list):
        return [without_timings(item) for item in value]
    return value


def printed_figures(text: str) -> list[str]:
    """The printed report's lines but those measuring time, the mode named as the same word."""
    return [
        ADDRESS.sub("?", line).replace("interpreted", "MODE").replace("compiled", "MODE")
        for line in text.splitlines()
        if not any(word in line for word in PRINTED_TIMINGS)
    ]


def simulate(seed: int, directory: str) -> Transcript:
    """The simulator on each preset (small runs): the JSON report without timings, and the printed tables' lines
    that carry no timing."""
    from kv_cache_manager_v2.__main__ import main

    transcript: Transcript = []
    runs = (
        ["--preset", "llama", "--requests", "4", "--gpu-mib", "160", "--host-mib", "96"],
        ["--preset", "gemma", "--requests", "4", "--gpu-mib", "64", "--host-mib", "0", "--scratch", "--chunk", "256"],
        ["--preset", "hybrid-ssm", "--requests", "4", "--gpu-mib", "96", "--host-mib", "64", "--disk-mib", "64"],
        ["--preset", "llama", "--requests", "4", "--gpu-mib", "160", "--batch-admission", "--bookkeeping"],
    )
    for index, flags in enumerate(runs):
        path = f"{directory}/run{index}.json"
        printed = io.StringIO()
        with redirect_stdout(printed):
            status = main(["simulate", "--backend", "cpu", "--plain", "--seed", str(seed), "--json", path, *flags])
        transcript.append([f"status {flags}", status])
        transcript.append([f"report {flags}", without_timings(json.loads(Path(path).read_text()))])
        transcript.append([f"printed {flags}", printed_figures(printed.getvalue())])
    return transcript
