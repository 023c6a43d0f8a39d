"""Log lines of bounded size: text a client sent (a rid, a grammar, a library's error quoting either) is cut to
`CLIP` characters plus its length, so no request can grow the log by more than a few KB (issue 33: a grammar that
failed wrote itself into the log several times, ~277 KB a request)."""

from __future__ import annotations

import logging

CLIP = 200  # characters of client text kept in a log line
LINE_LIMIT = 1000  # a formatted log line longer than this holds client text: cut it


def clip(text: object, limit: int = CLIP) -> str:
    """`text` as it goes into a log line or an error message: whole if short, else its head and its length."""
    s = text if isinstance(text, str) else repr(text)
    if len(s) <= limit:
        return s
    return f"{s[:limit]}... ({len(s)} characters)"


class BoundedLines(logging.Filter):
    """Cuts every line of a record's message and of its traceback that is longer than LINE_LIMIT (a backstop for
    client text that reached a log call uncut, such as uvicorn's request line or an exception's message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > LINE_LIMIT:
            record.msg, record.args = _cut_lines(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = _cut_lines(logging.Formatter().formatException(record.exc_info))
        return True


def _cut_lines(text: str) -> str:
    return "\n".join(line if len(line) <= LINE_LIMIT else clip(line) for line in text.split("\n"))


def bounded_logger(name: str) -> logging.Logger:
    """logging.getLogger(name) with BoundedLines on it (records logged on it directly are bounded)."""
    logger = logging.getLogger(name)
    bound(logger)
    return logger


def bound(logger: logging.Logger) -> None:
    if not any(isinstance(f, BoundedLines) for f in logger.filters):
        logger.addFilter(BoundedLines())
