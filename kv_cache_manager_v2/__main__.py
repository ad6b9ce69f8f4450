"""``python -m kv_cache_manager_v2``: see ``cli/main.py``; ``events-listen`` is ``kv_events/listen.py``."""

import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["events-listen"]:
        from kv_cache_manager_v2.kv_events.listen import main as listen_main

        return listen_main(args[1:])
    from kv_cache_manager_v2.cli.main import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
