"""The command line's shared parts (``tables``, ``parsing``: used by ``sim`` and ``models``, which never import each
other) and the top of it, ``main`` (``python -m kv_cache_manager_v2``), which puts their subcommands together."""
