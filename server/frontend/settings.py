"""The command line's settings, each declared once: its flag, the config key it writes (R6.2:
flags and file are one resource) and the environment variable read where neither sets it.

:data:`DEPLOYMENT_SETTINGS` are written into the bound deployment of the canonical config
(``--threads 4`` is ``engine.num_threads: 4``); :data:`PROCESS_SETTINGS` apply to the whole
process and have no config key. Precedence, for every row: flag, then config file, then
environment variable, then the default. A flag writes the config, so it wins over the file;
the variable is the process-wide default under both, as it is for ``--threads``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vllm_srun.runtime.budget import THREADS_ENV
from vllm_srun.runtime.errors import ConfigError
from vllm_srun.runtime.precision import DTYPE_CHOICES
from vllm_srun.runtime.types import BackendName
from vllm_srun.server.frontend.auth import API_KEY_ENV
from vllm_srun.server.pool.fields import (
    ADAPTIVE_NAMES,
    check_revision,
    check_served_name,
)
from vllm_srun.server.worker.logs import LOG_FORMAT_ENV
from vllm_srun.tuner.modes import (
    ADAPTIVE_ENV,
    LEARNING_SHARE_ENV,
    MAX_THREADS_ENV,
    learning_share,
)

RECORD_ENV = "VLLM_SRUN_RECORD"  # read by records.host_record


@dataclass(frozen=True)
class Setting:
    """One setting: ``flag`` writes config ``key`` (dotted, under
    ``global.model_catalog.deployments.<bound>``; None: process-wide), ``env`` applies where
    neither the flag nor the file sets it."""

    flag: str
    help: str
    key: str | None = None
    env: str | None = None
    parse: Callable[[str], object] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    nargs: str | None = None  # "+": one or more values, written as a list (one: the value)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def full_help(self) -> str:
        where = [f"config: {self.key}"] if self.key else []
        where += [f"environment: ${self.env}"] if self.env else []
        return f"{self.help} ({'; '.join(where)})" if where else self.help


def _checked(check: Callable[[str], object]) -> Callable[[str], object]:
    """``check`` (a config validator) as an argparse type (argparse names the flag)."""
    def parse(text: str) -> object:
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _integer(flag: str, least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = least - 1
        if value < least:
            kind = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise argparse.ArgumentTypeError(f"{flag} must be {kind}, got {text!r}")
        return value
    return parse


def _share(flag: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not 0.0 <= value <= 1.0:
            raise argparse.ArgumentTypeError(f"{flag} must be a number within 0..1, got {text!r}")
        return value
    return parse


def _learning_share(text: str) -> float:
    try:
        return learning_share(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# The quality gate's thresholds (R1.5): figure -> what it bounds
_GATE = {"min_cosine": "least cosine of an embedding to float32's (default 0.999)",
         "min_label_agreement": "least share of labels (classify, token classify) that agree "
                                "with float32's (default 0.99)",
         "max_prob_diff": "largest class-probability difference allowed (default: reported, "
                          "no limit)",
         "min_order_agreement": "least share of rerank document pairs in float32's order "
                                "(default 0.99)",
         "min_span_agreement": "least share of entity spans found by both (default 0.99)"}
GATE_SETTINGS: tuple[Setting, ...] = tuple(
    Setting(f"--quality-gate-{key.replace('_', '-')}", f"quality gate: {what}",
            key=f"quality_gate.{key}", parse=_share(f"--quality-gate-{key.replace('_', '-')}"),
            metavar="X") for key, what in _GATE.items())

DEPLOYMENT_SETTINGS: tuple[Setting, ...] = (
    Setting("--backend", "CPU backend (default onnxruntime, which exports the model to ONNX "
                         "once per revision into the cache); GPU workers run torch",
            key="backend", choices=tuple(b.value for b in BackendName)),
    Setting("--dtype", "numeric precision of the forwards (default float32, which matches "
                       "sentence-transformers to 1e-5). bfloat16 (torch) and int8 serve only "
                       "if the quality gate passes against float32 at load; auto picks the "
                       "fastest that passes on this host", key="dtype", choices=DTYPE_CHOICES),
    Setting("--revision", "branch, tag or commit of a Hugging Face Hub id MODEL (default: "
                          "main)", key="revision",
            parse=_checked(check_revision), metavar="REV"),
    Setting("--served-model-name", "one or more model ids clients send; /v1/models lists "
                                   "each and answers report the first. They replace the "
                                   "model's own id (default: the built-in name, the Hub id or "
                                   "the folder's name). Put it after MODEL: it takes every "
                                   "word up to the next flag",
            key="served_model_name", parse=_checked(check_served_name),
            metavar="NAME", nargs="+"),
    Setting("--adaptive-threads", "learn the fastest intra-op thread count per input size: "
                                  "off; learn (learn and report, serve at the configured "
                                  "count); serve (also serve learned counts once verified). "
                                  "The variable takes 0, 1 or 2 for off, learn, serve",
            key="adaptive_threads", env=ADAPTIVE_ENV, choices=ADAPTIVE_NAMES),
    Setting("--threads", "intra-op threads per CPU worker (default: half the CPU budget in "
                         "1..16), capped by the CPU budget", key="engine.num_threads",
            env=THREADS_ENV, parse=_integer("--threads", 1)),
    Setting("--concurrent-forwards", "forwards a CPU worker runs at once, each at --threads "
                                     "threads (default 1; at most 16; together within the "
                                     "CPU budget; with adaptive threads a forward alone may "
                                     "take a learned count, one beside others what they "
                                     "leave)",
            key="engine.concurrent_forwards", parse=_integer("--concurrent-forwards", 1)),
    Setting("--max-num-seqs", "most rows in one forward (default: 32)",
            key="engine.max_num_seqs", parse=_integer("--max-num-seqs", 1)),
    Setting("--max-num-batched-tokens", "most padded tokens (rows x longest) in one forward "
                                        "(default: calibrated per worker at start)",
            key="engine.max_num_batched_tokens",
            parse=_integer("--max-num-batched-tokens", 1)),
    Setting("--timeout-ms", "longest a request may take (default 30000); a caller may ask "
                            "for less with the X-Request-Timeout-Ms header",
            key="engine.timeout_ms", parse=_integer("--timeout-ms", 1)),
    Setting("--cache-entries", "rows kept in the result cache (default 4096; 0 turns it off)",
            key="engine.cache_entries", parse=_integer("--cache-entries", 0)),
    *GATE_SETTINGS,
)

MAX_THREADS = Setting(
    "--max-threads", "adaptive threads: highest count learning tries. Learning tries 1, the "
                     "powers of two, the configured count and the CPU budget, up to the "
                     "budget and at most 16; this narrows that set (capped by the CPU budget)",
    env=MAX_THREADS_ENV, parse=_integer("--max-threads", 1))
LEARNING_SHARE = Setting(
    "--learning-share", "adaptive threads: the most of served forward time learning may take "
                        "where traffic leaves no idle CPU (shadows run beside served "
                        "forwards at normal priority), as a fraction within 0..0.5 "
                        "(default 0.02; 0: learn on idle CPU only)",
    env=LEARNING_SHARE_ENV, metavar="FRACTION", parse=_learning_share)
RECORD = Setting("--record", "host record file (default: host-record.sqlite in the user's "
                             "data folder)", env=RECORD_ENV)
API_KEY = Setting("--api-key", "require 'Authorization: Bearer KEY' on /v1/*; prefer the "
                               "variable: flags show in ps", env=API_KEY_ENV)
LOG_FORMAT = Setting("--log-format", "log lines as text (time LEVEL logger event key=value "
                                    "...) or JSON, one object per line (default: text); "
                                    "workers log the same way",
                     env=LOG_FORMAT_ENV, choices=("text", "json"))
PROCESS_SETTINGS: tuple[Setting, ...] = (MAX_THREADS, LEARNING_SHARE, RECORD, API_KEY,
                                          LOG_FORMAT)


PRECEDENCE = ("Each setting is taken from its flag, else the config file (--config), else its "
              "environment variable, else its default.")


def add_flags(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    """One flag per setting; each defaults to None (unset: the file, then the variable)."""
    for s in settings:
        parser.add_argument(s.flag, dest=s.dest, type=s.parse, choices=s.choices,
                            metavar=s.metavar, nargs=s.nargs, default=None,
                            help=s.full_help())


def deployment_edits(args: argparse.Namespace) -> dict[str, object]:
    """The config keys the given deployment flags write (dotted key -> value; a flag given
    one of several values it may take writes that value, not a list)."""
    edits = {s.key: value for s in DEPLOYMENT_SETTINGS
             if s.key is not None and (value := getattr(args, s.dest, None)) is not None}
    return {k: v[0] if isinstance(v, list) and len(v) == 1 else v for k, v in edits.items()}
