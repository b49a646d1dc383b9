"""Structured logs: one line per event, ``key=value`` pairs after a timestamp and level."""

from __future__ import annotations

import logging
import sys
import time

_LINE_BREAKERS = [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029]
ESCAPES = {code: f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
           for code in _LINE_BREAKERS}
"""Control characters and line separators, as backslash escapes (``str.translate`` table)."""


class KeyValueFormatter(logging.Formatter):
    """One line per record. Values come from clients (job names, shard ids, error text):
    control characters are escaped, so no value can end a record and forge the next."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = (f"ts={stamp}.{int(record.msecs):03d}Z level={record.levelname.lower()} "
                f"logger={record.name} {record.getMessage().translate(ESCAPES)}")
        if record.exc_info:
            line += " exc=" + repr(self.formatException(record.exc_info))
        return line


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
