"""`profstream ...` commands: parse, call the package, print. Logic lives in the package.

One module per group of commands; ``common`` holds what they share, among it ``connect``,
the opening of every command that talks to Kafka. Importing the modules registers their
commands on ``app``, in the order ``profstream --help`` lists them.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys

from profstream.cli.common import app, err
from profstream.config import ConfigError

# The command modules register their commands, in the order `profstream --help` lists them.
# isort: off
from profstream.cli import stack, pipeline, sinks, offline, integrations, spool, control, stacks, acl, doctor, demo  # noqa: E402, F401
# isort: on

__all__ = ["app", "main"]


def main() -> None:
    from profstream.processors.checkpoint import FencedError, ProcessorUnavailable
    from profstream.stack import StackError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <pid>` prints every thread's stack to stderr: what a stuck process is doing
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        app()
    except (StackError, ConfigError, FencedError, ProcessorUnavailable) as e:
        err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
