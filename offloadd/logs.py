"""Structured logs: one line per event, ``key=value`` pairs after a timestamp and level."""

from __future__ import annotations

import logging
import sys
import time


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = (f"ts={stamp}.{int(record.msecs):03d}Z level={record.levelname.lower()} "
                f"logger={record.name} {record.getMessage()}")
        if record.exc_info:
            line += " exc=" + repr(self.formatException(record.exc_info))
        return line


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
