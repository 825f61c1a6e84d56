"""The consoles every command prints to, and the wrapper that turns kvlab errors into one line."""

from __future__ import annotations

import functools
import sys

import typer
from rich.console import Console

from .errors import KvlabError

console = Console(width=None if sys.stdout.isatty() else 140)  # tables stay readable when piped
err_console = Console(stderr=True)


def one_line_errors(fn):
    """Turn kvlab errors into `error: <message>` and exit code 2 instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvlabError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        except OSError as exc:  # a file the user named: unreadable, unwritable, a folder, a full disk
            where = f" {exc.filename}" if exc.filename else ""
            err_console.print(f"[bold red]error:[/]{where}: {exc.strerror or exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)

    return wrapper
