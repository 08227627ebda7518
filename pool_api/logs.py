"""One log format for every pdserve process: the CLI's and the pool workers'.

A worker's records go to its stderr, which Ray streams to the driver (`log_to_driver`):
`pdserve serve`'s terminal, or the router pod's log, shows each line prefixed with the actor
and its pid, e.g. `(DecodeActor pid=4242) 12:00:01 WARNING decode_workers.worker: ...`.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"


def formatter() -> logging.Formatter:
    """pdserve's one format: every line a terminal or log file shows has the same timestamp."""
    return logging.Formatter(FORMAT, DATEFMT)


def log_to_stderr(level: str) -> None:
    """This process's Python logging at `level` (a logging level name), one line a record
    on stderr; the level applies even where a handler was installed before."""
    logging.basicConfig(level=level.upper(), format=FORMAT, datefmt=DATEFMT, stream=sys.stderr)
    logging.getLogger().setLevel(level.upper())


def adopt(name: str) -> None:
    """Give the handlers of a library's own logger pdserve's format (Ray's `ray` logger has
    its own handler and format, with another timestamp: a driver's terminal showed both)."""
    for handler in logging.getLogger(name).handlers:
        handler.setFormatter(formatter())
