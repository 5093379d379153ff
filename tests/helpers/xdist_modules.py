"""How `make test` (``pytest -n 2 --dist loadgroup``) hands the tests to its xdist workers: one work unit per
test module, so a module's tests run on one worker and its module-scoped fixtures (a trained story, a fresh
venv, a started Prometheus) are built once; a module that says ``XDIST_SPREAD = True`` (independent cases
that mostly wait) gives one unit per test instead, and those units go last, where they fill the gap between
the worker that finished and the one still busy.

The unit is read from the test's node id here, in the controller's scheduler. xdist's own way, an
``xdist_group`` mark its worker writes into the node id as ``@group``, does nothing under pytest 9.2
(node ids became structured and the write is lost: pytest-xdist issue #1386), so every test was its own
unit and each module fixture was built on both workers.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

SPREAD = re.compile(r"^XDIST_SPREAD\s*=\s*True\b", re.M)


@functools.cache
def spreads(path: Path) -> bool:
    """Whether the test module at ``path`` asks for its tests to be spread over the workers."""
    try:
        return bool(SPREAD.search(path.read_text(encoding="utf-8")))
    except OSError:
        return False


def module_scheduler(config, log):
    """A ``LoadGroupScheduling`` whose unit is the test's module (or the test, in a module that spreads)."""
    from xdist.scheduler import LoadGroupScheduling

    root = Path(config.rootpath)

    class ModuleScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # an xdist_group mark that did reach the node id
                return super()._split_scope(nodeid)
            path = nodeid.split("::", 1)[0]
            return nodeid if spreads(root / path) else path

    return ModuleScheduling(config, log)
