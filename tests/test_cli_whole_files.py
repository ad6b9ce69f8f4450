"""``cli/whole_files.write_whole`` (``simulate --json FILE``, ``--plot``, ``--output-dir``): a SIGTERM while the
file is written killed the process with the hidden temporary (``.NAME.partial-PID.ext``) left beside the target;
now the temporary is removed and the process still ends as killed by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.test_cli import IMPORT_ROOT

# Writes half of the file, says so on stdout, then waits for the test's SIGTERM.
WRITER = """
import sys, time
from kv_cache_manager_v2.cli.whole_files import write_whole

def write(path):
    with open(path, "w") as file:
        file.write('{"cut": ')
        file.flush()
        print("writing", flush=True)
        time.sleep(60)
        file.write('"off"}')

write_whole(sys.argv[1], write)
"""


def test_sigterm_while_a_file_is_written_removes_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "run.json"
    target.write_text('{"an earlier run": true}\n')
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=IMPORT_ROOT), cwd=IMPORT_ROOT,
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "writing\n"
    process.send_signal(signal.SIGTERM)
    _, errors = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGTERM, errors
    assert "Traceback" not in errors, errors
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run.json"]  # no .run.partial-PID.json beside it
    assert target.read_text() == '{"an earlier run": true}\n'
