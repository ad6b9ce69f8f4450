"""The serving simulator application, ``python -m kv_cache_manager_v2 simulate``.

Not part of the library's API and not compiled by mypyc (see ``setup_mypyc.py``): ``options`` (what a run is
built from), ``presets`` (model shapes), ``workload`` and ``mooncake_trace`` (the requests), ``scheduler`` (the
continuous-batching loop), ``metrics`` and ``reuse_sources`` (what it measures), ``result``, ``simulator`` (one
run end to end), ``report`` (tables, JSON), ``plot`` (PNGs), ``flags`` (the parser and its usage checks) and
``cli`` (progress, runs, printing).
"""
