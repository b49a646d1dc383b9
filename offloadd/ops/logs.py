"""Structured logs: one line per event, logfmt ``key=value`` pairs after a timestamp and level.

Every value is written by one rule (``logfmt_value``), applied here in the formatter, so no
call site has to remember it: a value that is empty or holds a space, ``=``, a quote, a
backslash or any non-printable character is double-quoted with backslash escapes. A value a
client chose (a job name, a shard id, a flush tag, an error text) therefore stays one field
of one record: it can neither end the record and forge the next nor add a field.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Mapping
from numbers import Number
from typing import Any

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
"""The short escapes; any other non-printable character is ``\\xNN``, ``\\uNNNN`` or
``\\UNNNNNNNN`` (Go's ``strconv.Quote``, which logfmt readers decode)."""

_KEY_VALUE_FORMAT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*=")
"""A log call whose format string starts like this writes fields; any other message (one
from asyncio or another library) is logged whole as the value of ``msg``."""


def _escape(char: str) -> str:
    if char in _ESCAPES:
        return _ESCAPES[char]
    if char.isprintable():
        return char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else (
        f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")


def logfmt_value(text: str) -> str:
    """``text`` as one logfmt value: bare if it is a plain token, else quoted and escaped."""
    if text and text.isprintable() and not any(c in text for c in ' ="\\'):
        return text
    return '"' + "".join(map(_escape, text)) + '"'


class _Field:
    """A log argument that formats (``%s`` or ``%r``) as one logfmt value.

    ``%r`` of a string gives the string itself, quoted by the rule when needed: the quotes
    ``repr`` added were the call site's way to keep a value with spaces whole, which the
    rule now does for every value.
    """

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __str__(self) -> str:
        return logfmt_value(str(self.value))

    def __repr__(self) -> str:
        value = self.value
        return logfmt_value(value if isinstance(value, str) else repr(value))


def _field(value: object) -> object:
    # Numbers print without spaces or quotes, and %d / %g need the number itself.
    return value if value is None or isinstance(value, Number) else _Field(value)


def render_message(record: logging.LogRecord) -> str:
    """The record's fields: its format string with every argument written as a logfmt value
    (a message that is no ``key=value`` format becomes one ``msg`` field)."""
    fmt = record.msg
    if not (isinstance(fmt, str) and _KEY_VALUE_FORMAT.match(fmt)):
        return "msg=" + logfmt_value(record.getMessage())
    args = record.args
    if not args:  # the code's own text: its quotes stay, a stray line break is escaped
        return "".join(c if c.isprintable() else _escape(c) for c in fmt)
    if isinstance(args, Mapping):
        fields: Any = {key: _field(value) for key, value in args.items()}
    else:
        fields = tuple(map(_field, args))
    try:
        return fmt % fields
    except (TypeError, ValueError):  # a format the fields cannot fill: still one record
        return "msg=" + logfmt_value(record.getMessage())


class KeyValueFormatter(logging.Formatter):
    """One logfmt line per record; every value goes through ``logfmt_value``."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = (f"ts={stamp}.{int(record.msecs):03d}Z level={record.levelname.lower()} "
                f"logger={logfmt_value(record.name)} {render_message(record)}")
        if record.exc_info:
            line += " exc=" + logfmt_value(self.formatException(record.exc_info))
        return line


def setup_logging(level: str = "info") -> None:
    """Send every logger's records to stderr, one logfmt line each, at ``level`` and up."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
