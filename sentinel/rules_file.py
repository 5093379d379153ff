"""Reading an operator's rules file (``--rules``, ``sentinel rules check``): the I/O edge of the
rules. The pure core (``sentinel.rules``) parses text and never opens a path an operator chose.

Only a regular file of at most ``MAX_RULES_BYTES`` is read: ``--rules /dev/zero`` (or a FIFO, or a
symlink to either) would otherwise be read forever. Every failure is a one-line ``RulesError``,
except a missing file (``FileNotFoundError``), which the commands word themselves."""

from __future__ import annotations

import os

from sentinel.protocol import UnreadableFileError, read_regular_file
from sentinel.rules.config import MAX_RULES_BYTES, RulesError, RuleSet, parse_rules


def load_rules(path: str | os.PathLike) -> RuleSet:
    """Read and validate a rules file. Raises ``RulesError`` (one line) or FileNotFoundError."""
    try:
        data = read_regular_file(path, MAX_RULES_BYTES)
    except FileNotFoundError:
        raise
    except UnreadableFileError as e:
        raise RulesError(f"{path}: {e}; a rules file is a small YAML file") from None
    except OSError as e:  # a directory, a symlink loop, a name too long, no permission
        raise RulesError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise RulesError(f"{path}: not a text file") from None
    return parse_rules(text, str(path), allow_empty=False)
