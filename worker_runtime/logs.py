"""Log lines of every tandem process: text, or one JSON object a line (`--log-format
json`) for log pipelines (Loki, Elasticsearch, Cloud Logging) that index fields.

Hand-written rather than python-json-logger: a dozen lines, and the access log's fields
(router/access.py) become top-level keys, which is this formatter's one job.
"""

from __future__ import annotations

import json
import logging

LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and an access line's
    fields as keys of their own."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()  # as logging.Formatter leaves it, for other handlers
        out = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.message,
        }
        fields = getattr(record, "access", None)
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def use_log_format(fmt: str, text_format: str, logger: logging.Logger | None = None) -> None:
    """Format every handler of `logger` (the root logger) as `fmt` says (text: `text_format`)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    formatter = JsonFormatter() if fmt == "json" else logging.Formatter(text_format)
    for h in (logger or logging.getLogger()).handlers:
        h.setFormatter(formatter)
