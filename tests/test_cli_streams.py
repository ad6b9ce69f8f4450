"""What a new user's shell does to the command line: a reader that leaves early (``| head -1``), an output whose
encoding is not UTF-8, a stdout closed at start, output paths the run cannot write, a trace path that is not a
file, Ctrl-C during the second run of ``--compare-no-reuse``, Ctrl-C while the command line is still importing, and
Ctrl-C in a command other than simulate.

Each case ended in a traceback (after the whole run, for the outputs) before; now the run stops quietly with the
shell's SIGPIPE status, writes ASCII words, or is a one-line usage error before any work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kv_cache_manager_v2.cli.streams import CLOSED_OUTPUT_STATUS, OUTPUT_FAILED_STATUS
from tests.helpers import status_once_reader_left
from tests.test_cli import IMPORT_ROOT, assert_one_line_error, simulate


def start_simulate(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    environment = dict(os.environ, PYTHONPATH=IMPORT_ROOT, **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "kv_cache_manager_v2", "simulate", "--backend", "cpu", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=environment, cwd=IMPORT_ROOT,
    )


@pytest.mark.parametrize("tables", ["rich", "plain"])
def test_a_reader_that_leaves_after_the_first_line_stops_the_run_quietly(tables: str) -> None:
    """``simulate | head -1``: the layout's first line is read, then the pipe closes; the tables at the end find
    no reader. rich's own handler exited 1 with no word; the plain tables raised a BrokenPipeError traceback."""
    process = start_simulate("--requests", "2", *(["--plain"] if tables == "plain" else []))
    assert process.stdout is not None and process.stderr is not None
    first = process.stdout.readline()
    process.stdout.close()
    errors = process.stderr.read().decode()
    status = process.wait(timeout=120)
    assert first.endswith(b": planned layout\n"), first
    assert "Traceback" not in errors and "Exception ignored" not in errors, errors[-3000:]
    assert status == CLOSED_OUTPUT_STATUS, (status, errors[-3000:])


# A run of minutes uninterrupted (64 requests of 50,000 decode steps each, one at a time), so that a process still
# alive this long after its reader left did not notice it.
LONG_RUN = ("--requests", "64", "--output-len", "50000,50000", "--max-batch", "1", "--gpu-mib", "65536",
            "--host-mib", "0", "--bookkeeping", "--no-check")
NOTICED_WITHIN_S = 60


@pytest.mark.parametrize("json_output", [False, True])
def test_a_reader_that_leaves_during_a_long_run_stops_it_there(json_output: bool, tmp_path: Path) -> None:
    """``simulate | head -20``: the layout is printed, then nothing until the end, so the run went on for minutes
    with no reader and stopped only at its first write after the last step. Now it stops quietly at a step's
    progress check. With ``--json`` (written at the end only), a reader that leaves without reading anything."""
    errors_file = tmp_path / "stderr"
    with open(errors_file, "wb") as errors_out:
        environment = dict(os.environ, PYTHONPATH=IMPORT_ROOT)
        process = subprocess.Popen(
            [sys.executable, "-m", "kv_cache_manager_v2", "simulate", "--backend", "cpu", "--plain", *LONG_RUN,
             *(["--json"] if json_output else [])],
            stdout=subprocess.PIPE, stderr=errors_out, stdin=subprocess.DEVNULL, env=environment, cwd=IMPORT_ROOT,
        )
    assert process.stdout is not None
    first = b""
    if not json_output:  # the whole layout, so that no write of it races with the close (PYTHONUNBUFFERED)
        first = process.stdout.readline()
        while not process.stdout.readline().startswith(b"  (a pool group = "):
            pass
    else:  # the run has started once its first progress line is out
        while b"requests finished" not in errors_file.read_bytes() and process.poll() is None:
            time.sleep(0.05)
    status = status_once_reader_left(process, NOTICED_WITHIN_S)
    errors = errors_file.read_text()
    assert json_output or first.endswith(b": planned layout\n"), first
    assert "Traceback" not in errors and "Exception ignored" not in errors, errors[-3000:]
    assert status == CLOSED_OUTPUT_STATUS, (status, errors[-3000:])


@pytest.mark.parametrize("tables", ["rich", "plain"])
def test_an_ascii_only_output_gets_the_units_in_ascii(tables: str) -> None:
    """A non-UTF-8 locale (``PYTHONIOENCODING=ascii``): the summary's "µs" raised UnicodeEncodeError after the
    whole run; it is written "us", a unit still."""
    process = start_simulate("--requests", "1", *(["--plain"] if tables == "plain" else []),
                             env={"PYTHONIOENCODING": "ascii"})
    output, errors = process.communicate(timeout=120)
    assert process.returncode == 0, errors.decode()[-3000:]
    assert b" us/busy step" in output and b"us/request-step" in output, output.decode()[-3000:]
    output.decode("ascii")  # every byte is ASCII


@pytest.mark.skipif(not os.path.isdir("/proc/sys"), reason="needs Linux's read-only /proc")
@pytest.mark.parametrize("directory", ["/proc/no_such_dir", "/proc/sys"])
def test_an_output_dir_that_cannot_be_written_is_refused_before_the_run(directory: str) -> None:
    """``os.access`` says yes to root for /proc: the run went to its end and died writing result.json."""
    result = simulate("--requests", "1", "--plain", "--output-dir", directory)
    assert_one_line_error(result, f"--output-dir {directory}: not writable")
    assert not os.path.exists("/proc/no_such_dir")


def test_a_file_of_the_output_dir_that_is_a_directory_is_refused_before_the_run(tmp_path: Path) -> None:
    """As ``--json DIR`` is: the run went to its end, then "error: --output-dir: cannot write D/summary.txt (Is a
    directory)", status 1 (result.json written, plot.png not)."""
    (tmp_path / "summary.txt").mkdir()
    result = simulate("--requests", "1", "--no-check", "--output-dir", str(tmp_path))
    assert_one_line_error(result, f"--output-dir {tmp_path}: {tmp_path / 'summary.txt'} is a directory, where")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["summary.txt"]


def test_a_new_output_dir_is_not_left_behind_by_the_check(tmp_path: Path) -> None:
    """The check creates the directory to try it, and removes it when a later flag is refused."""
    directory = tmp_path / "out"
    result = simulate("--requests", "1", "--plain", "--output-dir", str(directory), "--kv-events-topic", "t")
    assert_one_line_error(result, "--kv-events-topic, --kv-events-replay and --kv-events-wait need --kv-events")
    assert not directory.exists()


def test_a_trace_path_that_is_a_directory_says_so(tmp_path: Path) -> None:
    """It said "no such file" of a directory that exists."""
    result = simulate("--trace", str(tmp_path))
    assert_one_line_error(result, f"--trace {tmp_path}: not a regular file")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/mem")
def test_a_trace_that_cannot_be_read_is_one_line() -> None:
    """A regular file whose read fails (/proc/self/mem: EIO; for a user, a file only root may read) passed the
    trace checks, then the loader's OSError was a traceback."""
    result = simulate("--trace", "/proc/self/mem", "--bookkeeping")
    assert_one_line_error(result, "--trace /proc/self/mem: cannot read it (Input/output error)")


def test_a_trace_whose_name_is_not_utf8_is_named_in_the_summary_file(tmp_path: Path) -> None:
    """Linux file names are bytes: ``--trace $'t\\xff.jsonl' --output-dir D`` wrote result.json, then died in a
    UnicodeEncodeError traceback writing summary.txt (the tables name the trace), after the whole run."""
    from kv_cache_manager_v2.__main__ import main

    trace = tmp_path / os.fsdecode(b"t\xff.jsonl")
    try:
        trace.write_text('{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [0]}\n')
    except (OSError, UnicodeError):
        pytest.skip("this filesystem refuses a file name that is not UTF-8")
    out = tmp_path / "out"
    assert main(["simulate", "--trace", str(trace), "--bookkeeping", "--plain", "--output-dir", str(out)]) == 0
    assert os.fsencode(f"trace {trace}, bookkeeping only") in (out / "summary.txt").read_bytes()
    assert json.loads((out / "result.json").read_text())["options"]["trace"] == str(trace)


def test_a_stdout_closed_at_start_is_not_a_crash(tmp_path: Path) -> None:
    """``simulate >&-``: Python starts with ``sys.stdout`` None; flushing the layout raised AttributeError. The
    output goes nowhere, the run ends 0 and still writes the files asked for."""
    environment = dict(os.environ, PYTHONPATH=IMPORT_ROOT)
    report = tmp_path / "run.json"
    result = subprocess.run(
        [sys.executable, "-m", "kv_cache_manager_v2", "simulate", "--backend", "cpu", "--plain", "--requests", "1",
         "--json", str(report)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment,
        cwd=IMPORT_ROOT, timeout=120, preexec_fn=lambda: os.close(1),
    )
    errors = result.stderr.decode()
    assert result.returncode == 0 and "Traceback" not in errors, errors[-3000:]
    assert report.read_text().startswith("{")


def test_ctrl_c_during_the_run_without_reuse_keeps_the_complete_run() -> None:
    """``--compare-no-reuse``, Ctrl-C during its second run: the partial no-reuse figures were printed as the
    run's own ("finished": 0, "hit_rate": 0.0 of a run that had finished every request with reuse)."""
    environment = dict(os.environ, PYTHONPATH=IMPORT_ROOT)
    process = subprocess.Popen(
        [sys.executable, "-m", "kv_cache_manager_v2", "simulate", "--backend", "cpu", "--plain", "--requests", "6",
         "--no-check", "--compare-no-reuse", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=IMPORT_ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal (see test_cli)
    )
    assert process.stderr is not None
    for line in process.stderr:
        if line.startswith("simulate: without prefix reuse: "):  # the second run's first step is done
            break
    process.send_signal(signal.SIGINT)
    output, errors = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in errors, (process.returncode, errors[-3000:])
    assert "of the run without prefix reuse" in errors and "the run with reuse, complete" in errors, errors[-3000:]
    report = json.loads(output)
    assert report["interrupted"] is True and "no_reuse" not in report
    assert report["options"]["reuse"] is True
    assert report["finished"] == 6 and report["hit_rate"] > 0.0


def test_ctrl_c_during_a_sweep_prints_the_points_finished() -> None:
    """Ctrl-C in a sweep's second point printed only "simulate: interrupted": the finished points were lost,
    although a single run prints its figures so far."""
    environment = dict(os.environ, PYTHONPATH=IMPORT_ROOT)
    process = subprocess.Popen(
        [sys.executable, "-m", "kv_cache_manager_v2", "simulate", "--backend", "cpu", "--plain", "--requests", "4",
         "--no-check", "--sweep", "seed=0,1,2", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=IMPORT_ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert process.stderr is not None
    for line in process.stderr:
        if line.startswith("simulate: --seed 1: "):  # the second point runs
            break
    process.send_signal(signal.SIGINT)
    output, errors = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in errors, (process.returncode, errors[-3000:])
    assert "interrupted during --seed 1; the 1 points finished" in errors, errors[-3000:]
    report = json.loads(output)
    assert report["interrupted"] is True and [point["value"] for point in report["points"]] == ["0"]
    assert report["points"][0]["finished"] == 4


def test_sigterm_during_a_run_prints_the_figures_so_far() -> None:
    """``kill`` (SIGTERM) ended a run with no figures and status -15, while Ctrl-C prints the figures so far and
    exits 130: a run stopped by a supervisor now ends the same way."""
    environment = dict(os.environ, PYTHONPATH=IMPORT_ROOT)
    process = subprocess.Popen(
        [sys.executable, "-m", "kv_cache_manager_v2", "simulate", "--backend", "cpu", "--plain", "--requests", "400",
         "--no-check", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=IMPORT_ROOT,
    )
    assert process.stderr is not None
    for line in process.stderr:
        if line.startswith("simulate: "):  # the first step is done
            break
    process.send_signal(signal.SIGTERM)
    output, errors = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in errors, (process.returncode, errors[-3000:])
    report = json.loads(output)
    assert report["interrupted"] is True and report["finished"] < 400


# A sitecustomize (the child's own, from PYTHONPATH) that stops the command line's import of one module until SIGINT
# arrives: the Ctrl-C lands inside the import on every run, however fast or loaded the machine is.
PAUSE_IMPORT = '''
import sys
import time


class PauseAt:
    def find_spec(self, name, path, target=None):
        if name == {module!r}:
            sys.stderr.write("paused at " + name + "\\n")
            sys.stderr.flush()
            time.sleep(60)
        return None


sys.meta_path.insert(0, PauseAt())
'''


def interrupted_at_import(
    directory: Path, module: str, *args: str, signum: int = signal.SIGINT
) -> tuple[int, str, str]:
    """Run the command line with ``module``'s import paused, send ``signum`` once it is: (status, stdout, stderr)."""
    (directory / "sitecustomize.py").write_text(PAUSE_IMPORT.format(module=module))
    process = subprocess.Popen(
        [sys.executable, "-m", "kv_cache_manager_v2", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=IMPORT_ROOT,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(directory), IMPORT_ROOT])),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal (see test_cli)
    )
    assert process.stderr is not None
    first = process.stderr.readline()
    while first and not first.startswith("paused at "):  # a command's own progress lines before the pause
        first = process.stderr.readline()
    assert first == f"paused at {module}\n", first
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    return process.returncode, stdout, stderr


# "package": NumPy, whose first import is inside the package's own imports; the hook cannot pause one of the package's
# modules there, since compiled modules import each other without sys.meta_path (mypyc's group library).
@pytest.mark.parametrize(
    "module", ["numpy", "kv_cache_manager_v2.sim.cli"], ids=["package", "main-module"]
)
def test_ctrl_c_while_the_command_line_imports_prints_one_line(tmp_path: Path, module: str) -> None:
    """Ctrl-C in the first second (the package's imports, then ``__main__``'s apps) printed a KeyboardInterrupt
    traceback from inside importlib and the process died by SIGINT; every later Ctrl-C prints one line, exits 130."""
    status, stdout, stderr = interrupted_at_import(tmp_path, module, "simulate", "--backend", "cpu", "--requests", "2")
    assert (status, stderr, stdout) == (130, "kv_cache_manager_v2: interrupted while starting\n", "")


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("kv_cache_manager_v2.kv_events.listen", ["events-listen", "tcp://127.0.0.1:1"]),  # its lazy import
        ("rich.table", ["generate", "--model", "bamba-tiny", "--max-new-tokens", "2"]),  # while it runs
    ],
    ids=["events-listen-import", "generate"],
)
def test_ctrl_c_in_any_command_prints_one_line(tmp_path: Path, module: str, args: list[str]) -> None:
    """Only simulate caught KeyboardInterrupt: generate and disagg-demo (and events-listen's import) ended in a
    traceback with the process killed by SIGINT; events-listen's own loop exited 130 without a word. ``main``
    now ends every command alike: "<command>: interrupted" and status 130."""
    status, _, stderr = interrupted_at_import(tmp_path, module, *args)
    assert status == 130 and "Traceback" not in stderr, (status, stderr[-3000:])
    assert stderr.endswith(f"{args[0]}: interrupted\n"), stderr[-3000:]


def test_ctrl_c_while_a_library_user_imports_the_package_stays_a_keyboard_interrupt(tmp_path: Path) -> None:
    """Only the command line turns it into a line and a status: an engine importing the package gets its
    KeyboardInterrupt (its own handler, or Python's traceback) as from any import."""
    (tmp_path / "sitecustomize.py").write_text(PAUSE_IMPORT.format(module="numpy"))
    process = subprocess.Popen(
        [sys.executable, "-c", "try:\n import kv_cache_manager_v2\nexcept KeyboardInterrupt:\n print('engine: caught')"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=IMPORT_ROOT,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), IMPORT_ROOT])),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert process.stderr is not None
    assert process.stderr.readline() == "paused at numpy\n"
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert (process.returncode, stdout, stderr) == (0, "engine: caught\n", "")


def test_a_stdout_that_cannot_be_written_is_one_line_and_status_1() -> None:
    """``simulate > /dev/full`` (a full disk, an I/O error) ended in an ``OSError: [Errno 28]`` traceback from the
    layout's first print; now one line names stdout and the status is 1 (the results are lost)."""
    environment = dict(os.environ, PYTHONPATH=IMPORT_ROOT)
    for json_flag in ([], ["--json"]):
        with open("/dev/full", "w") as full:
            result = subprocess.run(
                [sys.executable, "-m", "kv_cache_manager_v2", "simulate", "--backend", "cpu", "--plain", "--no-check",
                 "--requests", "2", *json_flag],
                stdout=full, stderr=subprocess.PIPE, text=True, env=environment, cwd=IMPORT_ROOT, timeout=120,
            )
        assert result.returncode == OUTPUT_FAILED_STATUS, (json_flag, result.stderr[-3000:])
        assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr[-3000:]
        assert result.stderr.splitlines()[-1] == (
            "error: stdout: cannot write the output (No space left on device); nothing more was printed"
        )


def test_an_output_file_the_disk_cannot_hold_is_not_left_half_written(tmp_path: Path) -> None:
    """A file size limit (as a full disk) while writing --json FILE: a traceback, and FILE kept its first 4 KiB
    (an earlier run's result overwritten by a cut-off one). Now one line naming --json, status 1, and FILE as it
    was; the tables are still printed."""
    import resource

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, not a kill

    report = tmp_path / "run.json"
    report.write_text('{"an earlier run": true}\n')
    result = subprocess.run(
        [sys.executable, "-m", "kv_cache_manager_v2", "simulate", "--backend", "cpu", "--plain", "--no-check",
         "--requests", "2", "--json", str(report)],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=IMPORT_ROOT), cwd=IMPORT_ROOT, timeout=120,
        preexec_fn=small_files,
    )
    assert result.returncode == OUTPUT_FAILED_STATUS, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == f"error: --json: cannot write {report} (File too large); it was not written"
    assert report.read_text() == '{"an earlier run": true}\n'
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run.json"]  # no partial file beside it
    assert "prefix hit rate" in result.stdout and "written:" not in result.stdout


def test_an_output_file_behind_a_symbolic_link_is_written_at_its_target(tmp_path: Path) -> None:
    """Files are written whole through a temporary file renamed over the path: through a link, over its target
    (renamed over the link itself, the link would become a file and the target keep the earlier run)."""
    target = tmp_path / "runs" / "latest.json"
    target.parent.mkdir()
    target.write_text("{}\n")
    link = tmp_path / "run.json"
    link.symlink_to(target)
    result = simulate("--plain", "--no-check", "--requests", "2", "--json", str(link))
    assert result.returncode == 0, result.stderr[-3000:]
    assert link.is_symlink() and json.loads(target.read_text())["finished"] == 2
    assert sorted(path.name for path in target.parent.iterdir()) == ["latest.json"]
