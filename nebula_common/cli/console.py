"""Every rich console of the CLI and the SDK is made here, so each prints text to the letter.

rich's ``Console`` turns ``:name:`` into an emoji by default: a certificate fingerprint holding an
``AB`` byte (``...:AB:...``) was printed wrong by ``pki export-ca``, ``trust add`` and ``trust list``.
``new_console`` makes consoles with emoji replacement off; ``tests/unit/test_cli_console.py`` fails if
a ``Console(`` is made anywhere else, so a new console cannot bring the bug back.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape


def new_console(*, stderr: bool = False, width: int | None = None) -> Console:
    """A rich console on stdout (or ``stderr``) that prints ``:name:`` as it is, never as an emoji;
    ``width`` fixes its width instead of the terminal's (measuring, or a table printed whole)."""
    return Console(emoji=False, stderr=stderr, width=width)


def print_error(message: str) -> None:
    """``error: <message>`` on stderr, in red; the message is printed as it is (no markup, no emoji)."""
    new_console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


__all__ = ["new_console", "print_error"]
