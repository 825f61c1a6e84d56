"""The consoles every command prints to, and the wrapper that turns kvlab errors into one line."""

from __future__ import annotations

import functools
import sys

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

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


class OneLineUsageErrors(TyperGroup):
    """The app's command group: click's own usage errors (`--threads abc`, `--repeats 0`, an unknown option)
    also print one line, `error: Invalid value for '--threads': ...`, and exit 2, like kvlab's errors."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:
            err_console.print("[bold red]aborted[/]", highlight=False)
            sys.exit(1)
        except typer.TyperException as exc:  # typer's (vendored) click exceptions: usage errors, bad values
            if type(exc).__name__ != "NoArgsIsHelpError":  # that one has printed the help already
                err_console.print(f"[bold red]error:[/] {escape(' '.join(exc.format_message().split()))}",
                                  highlight=False, soft_wrap=True)
            sys.exit(getattr(exc, "exit_code", 2))
        sys.exit(code if isinstance(code, int) else 0)
