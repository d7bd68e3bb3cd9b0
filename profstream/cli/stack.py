"""`profstream stack up / status / down`: the local development broker."""

from __future__ import annotations

from typing import Annotated

import typer

from profstream.cli.common import DirOpt, out, stack_app


@stack_app.command("up")
def stack_up_cmd(dir: DirOpt = None,
                 timeout: Annotated[float, typer.Option(help="seconds to wait for the broker")] = 120.0) -> None:
    """Start the local broker (or reuse the one running) and print its bootstrap address."""
    from profstream.stack import stack_up

    broker = stack_up(dir, timeout=timeout)
    out.print(broker.bootstrap, highlight=False)


@stack_app.command("status")
def stack_status_cmd(dir: DirOpt = None) -> None:
    """Print the local broker's address and pid; exit 1 when none is running."""
    from profstream.stack import stack_status

    broker = stack_status(dir)
    if broker is None:
        out.print("not running")
        raise typer.Exit(1)
    out.print(f"running  bootstrap={broker.bootstrap}  pid={broker.pid}  dir={broker.state_dir}", highlight=False)


@stack_app.command("down")
def stack_down_cmd(dir: DirOpt = None) -> None:
    """Stop the local broker."""
    from profstream.stack import stack_down

    out.print("stopped" if stack_down(dir) else "not running")
