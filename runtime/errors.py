"""Errors of the runtime, one hierarchy.

    RuntimeFault
    ├── ConfigError        a setting (environment variable, flag, engine argument) is invalid
    ├── ArtifactError      a model folder cannot be used (missing file, unsupported weights)
    ├── InputError         a request's input is invalid (names the field)
    │   └── InputTooLong   an input has more tokens than the model allows
    ├── Unsupported        the artifact or backend cannot do what was asked
    │   └── NonFiniteAnswer  the model answered NaN or infinity for an input
    ├── DeadlineExceeded   the caller's deadline or timeout_ms passed before an answer
    └── EngineStopped      the engine is shutting down or has failed

Foreign exceptions are translated at the boundary with ``raise ... from exc``. Each fault
carries the R7.2 ``code`` a caller sees; which HTTP status that is, is the front end's to say.
"""

from __future__ import annotations


class RuntimeFault(Exception):
    """Base of every error the runtime raises on purpose."""

    code = "internal_error"


class ConfigError(RuntimeFault):
    """A setting is invalid; the message names the variable, flag or key."""


class ArtifactError(RuntimeFault):
    """A model folder cannot be used."""


class InputError(RuntimeFault):
    """A request input is invalid; the message names the field."""

    code = "invalid_request"


class InputTooLong(InputError):
    """An input has more tokens than the model's limit and truncation was not asked for."""


class Unsupported(RuntimeFault):
    """The artifact or backend cannot do what was asked (e.g. classify without a head)."""

    code = "unsupported"


class NonFiniteAnswer(Unsupported):
    """The model's answer for an input holds NaN or infinity, which JSON cannot carry and no
    caller can use. It follows from the weights and the input, so another replica of the same
    model answers the same: a caller's error to see (422), not a replica's fault to eject."""


class DeadlineExceeded(RuntimeFault):
    """The deadline passed before the answer was ready."""

    code = "deadline_exceeded"


class EngineStopped(RuntimeFault):
    """The engine is not running."""

    code = "not_ready"
