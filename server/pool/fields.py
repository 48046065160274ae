"""Checks of single values of ``config.yaml`` (R6.1) that a YAML type cannot state: names
clients send, Hub revisions, endpoint URLs, environment variable names, the adaptive-threads
mode. Each returns the value (normalised) or raises ``ValueError`` saying what it must be;
:mod:`.config`'s validators call them, and so do the ``serve`` flags that write those keys.
"""

from __future__ import annotations

import re

_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
_SERVED = re.compile(r"^[^\s\x00-\x1f\x7f](?:[^\x00-\x1f\x7f]{0,254}[^\s\x00-\x1f\x7f])?$")
ADAPTIVE_NAMES = ("off", "learn", "serve")  # VLLM_SRUN_CPU_ADAPTIVE_THREADS=0, 1, 2


def check_endpoint(url: str) -> str:
    """An attached replica's base URL, http(s), without its trailing slash."""
    if not re.match(r"^https?://[^\s/]+(/\S*)?$", url):
        raise ValueError(f"endpoint must be an http(s) URL, got {url!r}")
    return url.rstrip("/")


def check_served_name(name: str, key: str = "served_model_name") -> str:
    """An id clients send: 1-256 printable characters, no surrounding whitespace."""
    if not isinstance(name, str) or not _SERVED.match(name):
        raise ValueError(f"{key} must be 1-256 printable characters without "
                         f"leading or trailing whitespace, got {name!r}")
    return name


def check_served_names(value: object) -> str | list[str]:
    """``served_model_name``: one id, or a list of distinct ids (the first is the one answers
    report, every one is accepted in a request's ``model``), as vLLM's flag takes them."""
    if isinstance(value, str):
        return check_served_name(value)
    if not isinstance(value, list | tuple):
        raise ValueError(f"served_model_name must be a name or a list of names, got {value!r}")
    if not value:
        raise ValueError("served_model_name must list at least one name (omit the key for "
                         "the model's own id)")
    names = [check_served_name(v, f"served_model_name[{i}]") for i, v in enumerate(value)]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"served_model_name[{i}] repeats {name!r}; list each name once")
    return names


def check_revision(rev: str) -> str:
    """A Hub branch, tag or commit: letters, digits, '.', '_', '-' and '/'."""
    if not isinstance(rev, str) or not _REVISION.match(rev) or ".." in rev:
        raise ValueError(f"revision must be a Hugging Face Hub branch, tag or commit "
                         f"(letters, digits, '.', '_', '-', '/'), got {rev!r}")
    return rev


def check_adaptive(value: object) -> object:
    """``off``, ``learn`` or ``serve``; YAML reads an unquoted ``off`` as false."""
    if value is False:
        return "off"
    if value not in ADAPTIVE_NAMES:
        raise ValueError(f"adaptive_threads must be one of {', '.join(ADAPTIVE_NAMES)}, got "
                         f"{value!r}" + (" (YAML reads unquoted on/yes/true as true)"
                                         if value is True else ""))
    return value


def check_env_name(name: str | None) -> str | None:
    """``api_key_env``: the name of an environment variable, never the key itself."""
    if name is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
        raise ValueError(f"api_key_env names an environment variable (the key itself never "
                         f"goes in the file), got {name!r}")
    return name
