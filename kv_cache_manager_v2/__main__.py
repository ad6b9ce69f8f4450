"""``python -m kv_cache_manager_v2``: see ``cli.py``."""

import sys

from kv_cache_manager_v2.cli import main

if __name__ == "__main__":
    sys.exit(main())
