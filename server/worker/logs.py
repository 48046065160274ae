"""Log lines of every vllm-srun process (front end, workers, the CLI) in one of two formats:
``text`` (``time LEVEL logger event key=value ...``) or ``json`` (one object per line).

Lifecycle lines are written as ``event key=value key=value`` (STYLE.md habit 8); the JSON
format parses that into keys: ``event``, then each field (numbers as numbers; a value is one
word, except the last field's, which runs to the end of the line, as ``error=`` does; other
words stay in ``message`` only), beside ``ts``, ``level``, ``logger``, ``pid`` and the whole
``message``. A line written while a request is handled carries its ``request_id``
(``trace.py``) in both formats.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Mapping

import orjson

from vllm_srun.runtime.errors import ConfigError
from vllm_srun.server.worker.trace import current

LOG_FORMAT_ENV = "VLLM_SRUN_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
_EVENT = re.compile(r"[a-z][a-z0-9_.]*")
_KEY = re.compile(r"(?:^|\s)([a-z][a-z0-9_]*)=")
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
_BASE = ("ts", "level", "logger", "pid", "event", "message")


def log_format(flag: str | None, env: Mapping[str, str] | None = None) -> str:
    """``--log-format``, else $VLLM_SRUN_LOG_FORMAT, else ``text``."""
    env = os.environ if env is None else env
    source, value = ("--log-format", flag) if flag is not None else (
        LOG_FORMAT_ENV, env.get(LOG_FORMAT_ENV, "").strip() or "text")
    if value not in LOG_FORMATS:
        raise ConfigError(f"{source} must be one of {', '.join(LOG_FORMATS)}, got {value!r}")
    return value


def fields(message: str) -> tuple[str | None, dict[str, object]]:
    """``event key=value ...`` as (event, {key: value}); (None, {}) for any other line."""
    head, _, rest = message.partition(" ")
    if not _EVENT.fullmatch(head):
        return None, {}
    keys = list(_KEY.finditer(rest))
    if rest and (not keys or keys[0].start() != 0):
        return head, {}  # prose after the first word: not a key=value line
    out: dict[str, object] = {}
    for i, m in enumerate(keys):
        last = i + 1 == len(keys)
        value = rest[m.end():len(rest) if last else keys[i + 1].start()]
        if not last:  # words after a value that is not the last field are prose
            value = value.split(" ", 1)[0]
        out[m.group(1)] = (float(value) if "." in value or "e" in value.lower() else
                           int(value)) if _NUMBER.fullmatch(value) else value
    return head, out


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        event, extra = fields(message)
        doc: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z", "level": record.levelname.lower(),
            "logger": record.name, "pid": record.process, "event": event}
        doc.update((k, v) for k, v in extra.items() if k not in _BASE)
        if "request_id" not in doc and (trace := current()) is not None:
            doc["request_id"] = trace.request_id
        doc["message"] = message
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self, label: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)s {label}%(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        line = super().formatMessage(record)
        trace = current()
        if trace is not None and "request_id=" not in line:
            line += f" request_id={trace.request_id}"
        return line


def configure(level: str, fmt: str, label: str = "") -> None:
    """The root logger's one handler, on stderr, in ``fmt``; ``label`` names the process in
    text lines (a worker's ``worker[pid] ``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(label))
    handler.vllm_srun = True  # ours: a second call replaces it, others' handlers stay
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "vllm_srun", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # Python warnings in the same format
