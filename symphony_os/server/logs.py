"""Structured logs: one JSON object per line, with the event's fields (pid, tenant, ...) as
keys, so a log collector can filter by process or tenant."""
from __future__ import annotations

import json
import logging
import re
import sys
import time


def event(logger: logging.Logger, name: str, /, **fields) -> None:
    """Log event `name` at level info with `fields` (JSON-serialisable values)."""
    logger.info(name, extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                "event": record.getMessage(), **getattr(record, "fields", {})}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class RedactTokens(logging.Filter):
    """Blanks `token=...` in the URLs a record carries: a token someone put in a query string
    (the server reads tokens only from the Authorization header) must not be kept in a log."""

    _TOKEN = re.compile(r"([?&][A-Za-z_]*token=)[^&\s\"]*", re.IGNORECASE)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self._TOKEN.sub(r"\1REDACTED", a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = self._TOKEN.sub(r"\1REDACTED", record.msg)
        return True


def redact_tokens_in_uvicorn_logs() -> None:
    """Install RedactTokens on the loggers uvicorn writes request lines to (once)."""
    for name in ("uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger.filters):
            logger.addFilter(RedactTokens())


def configure(level: str = "info") -> None:
    """Send Symphony's and uvicorn's logs to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in ("symphony", "uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
    logging.Formatter.converter = time.gmtime
