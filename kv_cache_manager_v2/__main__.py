"""``python -m kv_cache_manager_v2``: the command line lives in ``sim/cli.py``."""

import sys

from kv_cache_manager_v2.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
