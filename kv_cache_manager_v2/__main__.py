"""``python -m kv_cache_manager_v2``: see ``cli.py``; ``events-listen`` is ``kv_events/listen.py``."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["events-listen"]:
        from kv_cache_manager_v2.kv_events.listen import main as listen_main

        sys.exit(listen_main(sys.argv[2:]))
    from kv_cache_manager_v2.cli import main

    sys.exit(main())
