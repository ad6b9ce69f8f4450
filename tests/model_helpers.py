"""Shared by the real-model tests: load a model once per process, serve prompts, check against the dense path.

Without the model packages a test skips outside CI (a developer without the ``models`` extra) and fails in CI
(``CI`` set), where ``.ci/run`` installs them: a missing install step must not turn into silently skipped tests.
"""

from __future__ import annotations

import os
from typing import Sequence

import pytest

from kv_cache_manager_v2.models.check import CheckResult, check_against_dense
from kv_cache_manager_v2.models.gguf_model import Model, load_model
from kv_cache_manager_v2.models.serving import GenerationOptions, GenerationResult, Prompt, Server
from kv_cache_manager_v2.models.sources import ModelPackageMissing, require_packages


def require_model(name: str) -> Model:
    try:
        require_packages(name)
    except ModelPackageMissing as error:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs the model packages, yet: {error}")
        pytest.skip(str(error))
    return load_model(name)


def serve(name: str, prompts: Sequence[Prompt], **options: object) -> GenerationResult:
    return Server(require_model(name), GenerationOptions(**options)).run(prompts)  # type: ignore[arg-type]


def serve_and_check(name: str, prompts: Sequence[Prompt], **options: object) -> tuple[GenerationResult, CheckResult]:
    """Serve on the paged path, rerun every sequence on the dense path, require identical greedy tokens and logits
    within the backend's tolerance."""
    return serve_model_and_check(require_model(name), prompts, **options)


def serve_model_and_check(
    model: Model, prompts: Sequence[Prompt], **options: object
) -> tuple[GenerationResult, CheckResult]:
    """``serve_and_check`` of a loaded model (a variant of one: another window, sink tokens)."""
    server = Server(model, GenerationOptions(**options))  # type: ignore[arg-type]
    result = server.run(prompts)
    check = check_against_dense(server.transformer, result)
    for verdict, sequence in zip(check.sequences, result.sequences):
        assert verdict.equal, f"sequence {sequence.index}: paged {sequence.output_ids} != dense {verdict.output_ids}"
        assert len(sequence.output_ids) == len(sequence.logits) >= 1
    assert check.within_tolerance(result.options.backend), check.max_logit_delta
    return result, check
