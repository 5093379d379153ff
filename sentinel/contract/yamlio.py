"""YAML documents both sides read (a run's ``config.yaml``, a mixture file, ``--set`` values): one loader,
one bound and one error.

* ``Loader``: libyaml's safe loader when PyYAML was built with it (its wheels are), else PyYAML's own.
  Both build plain data only, never Python objects from tags. The C one reads a config ~10x faster and
  refuses nesting past 1,000 levels in milliseconds; the pure Python one spends ~0.7 s recursing into
  ``[[[[...`` 50,000 deep before Python's recursion limit stops it.
* ``parse_yaml(text)``: the document, or ``YamlError`` with a one-line reason (line and column, 1-based).
* ``read_yaml(path)``: the same from a regular file of at most ``limit`` bytes (``fsio.read_regular_file``).

A rules file has a loader of its own (``sentinel.rules.config``: no aliases, no duplicate keys).
"""

from __future__ import annotations

from typing import Any

import yaml

from sentinel.contract.fsio import read_regular_file
from sentinel.contract.limits import MAX_STATE_BYTES

__all__ = ["Loader", "YamlError", "parse_yaml", "read_yaml"]

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class YamlError(ValueError):
    """A document that is not YAML we can read. ``str()`` is one line without the file's name
    (``invalid YAML (nested too deep)``); ``reason`` is the part in brackets."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _invalid(reason: str) -> YamlError:
    return YamlError(f"invalid YAML ({reason})", reason)


def parse_yaml(text: str) -> Any:
    """``text`` parsed with ``Loader``; every way to fail is a ``YamlError`` of one line."""
    try:
        return yaml.load(text, Loader=Loader)  # noqa: S506 (a safe loader: plain data only)
    except RecursionError:  # the pure Python loader, nested thousands deep
        raise _invalid("nested too deep") from None
    except yaml.YAMLError as e:
        problem = str(getattr(e, "problem", None) or (str(e).splitlines() or ["unreadable"])[0])
        if "maximum nesting depth" in problem:  # libyaml's own bound (1,000 levels)
            raise _invalid("nested too deep") from None
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise _invalid(f"{problem[:120]}{where}") from None


def read_yaml(path, limit: int = MAX_STATE_BYTES) -> Any:
    """The YAML document in the regular file ``path`` (at most ``limit`` bytes, UTF-8). ``OSError`` (and
    ``FileNotFoundError``) pass through for the caller to word; bad content is a ``YamlError``."""
    try:
        text = read_regular_file(path, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise YamlError("not UTF-8 text", "not UTF-8 text") from None
    return parse_yaml(text)
