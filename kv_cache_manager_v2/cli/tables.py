"""Titled tables of strings, printed by rich when it is installed (the ``cli`` extra), else as aligned plain text:
the output of every subcommand (``simulate``, ``generate``, ``disagg-demo``)."""

from __future__ import annotations

import errno
from typing import Sequence


class Table:
    """A titled table of strings with an optional note below: rendered by rich when installed, else plain."""

    def __init__(self, title: str, headers: list[str], rows: list[list[str]], note: str = "") -> None:
        self.title = title
        self.headers = headers
        self.rows = rows
        self.note = note


def render_plain(tables: Sequence[Table]) -> str:
    """Aligned plain-text tables (the fallback when rich is not installed)."""
    blocks: list[str] = []
    for table in tables:
        widths = [len(header) for header in table.headers]
        for row in table.rows:
            for column, cell in enumerate(row):
                widths[column] = max(widths[column], len(cell))
        lines = [table.title]
        if any(table.headers):
            lines.append("  ".join(header.ljust(width) for header, width in zip(table.headers, widths)).rstrip())
            lines.append("  ".join("-" * width for width in widths))
        for row in table.rows:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if table.note:
            lines.append(f"({table.note})")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def print_tables(tables: Sequence[Table], plain: bool = False) -> None:
    """Print the tables with rich when it is installed (and ``plain`` is False), else as plain text."""
    if not plain:
        try:
            from rich.console import Console
            from rich.table import Table as RichTable
        except ImportError:
            plain = True
    if plain:
        print(render_plain(tables))
        return

    class PipeConsole(Console):
        """rich exits with status 1 when stdout's reader leaves; this hands it to ``__main__``, which tells that
        from a failure and stops every command the same way."""

        def on_broken_pipe(self) -> None:
            raise BrokenPipeError(errno.EPIPE, "stdout's reader left")

    console = PipeConsole()
    for table in tables:
        headers = any(table.headers)
        rich_table = RichTable(
            title=table.title,
            caption=table.note or None,
            show_header=headers,
            title_justify="left",
            caption_justify="left",
        )
        for position, header in enumerate(table.headers):
            rich_table.add_column(header, justify="left" if position < 2 else "right")
        for row in table.rows:
            rich_table.add_row(*row)
        console.print(rich_table)
        console.print()


# --------------------------------------------------------------------------------------------------- JSON
