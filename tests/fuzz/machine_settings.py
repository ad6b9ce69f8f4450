"""How long a Hypothesis state machine of the suite runs.

Examples and steps come from ``KV_CACHE_MANAGER_V2_<NAME>_EXAMPLES`` / ``_STEPS`` (longer runs by hand, the suite's
own figures otherwise); no deadline, since a step drives a real manager, and the health checks a stateful fuzzer
trips by design (slow draws, rules filtered out in some states) stay quiet.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def machine_settings(name: str, examples: int, steps: int) -> settings:
    """Settings for ``run_state_machine_as_test``: ``examples`` runs of ``steps`` steps unless the environment
    variables named after ``name`` (``FUZZ``, ``ORACLE``) say otherwise."""
    return settings(
        max_examples=int(os.environ.get(f"KV_CACHE_MANAGER_V2_{name}_EXAMPLES", str(examples))),
        stateful_step_count=int(os.environ.get(f"KV_CACHE_MANAGER_V2_{name}_STEPS", str(steps))),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
