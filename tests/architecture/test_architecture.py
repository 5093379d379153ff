"""The dependency rules of docs/architecture.md, checked on the source (every import statement, at
module level or inside a function) and on a fresh interpreter (what importing the core really loads).

- The contract (``sentinel/contract/``) imports nothing of ours but itself; ``sentinel/protocol.py``,
  its compatibility facade, imports only the contract.
- No import cycle among our modules, counting every import statement (in-function ones too).
- The pure core (``sentinel/detectors/``, ``sentinel/rules/``, ``sentinel/policy*.py``) imports only
  the contract and itself, pydantic, YAML and numpy (arithmetic, no I/O), and no stdlib module that
  does I/O over a network or other processes; importing it loads no torch, redis or trainer.
- Only the offline tools import ``trainer``: ``sentinel/offline/`` at module level; the CLI
  commands that start them (replay-batch, verify-resume, demo) and the demo's drill only inside
  functions, so ``sentinel --help`` and the daemon never load torch.
- ``trainer/`` imports from the sentinel only the contract (and its facade), the bus's connection helpers and its
  public client library (``sentinel.client``, which any training loop may use), and the hardened
  ``/metrics`` endpoint both sides serve (``sentinel.metrics_http``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = (sorted((ROOT / "sentinel" / "detectors").glob("*.py")) + sorted((ROOT / "sentinel" / "rules").glob("*.py"))
        + sorted((ROOT / "sentinel").glob("policy*.py")))  # policy.py and its parts (policy_*.py)
CORE_MAY_IMPORT_OF_OURS = ("sentinel.contract", "sentinel.protocol", "sentinel.detectors", "sentinel.rules",
                           "sentinel.policy_types", "sentinel.policy_lineage", "sentinel.policy_episode",
                           "sentinel.policy_recovery", "sentinel.policy_state")
CORE_MAY_IMPORT_THIRD_PARTY = ("pydantic", "yaml", "numpy")
IO_MODULES = ("socket", "ssl", "http", "urllib", "subprocess", "multiprocessing", "threading", "asyncio", "shutil",
              "sqlite3", "select", "selectors")
TRAINER_MAY_IMPORT = ("sentinel.contract", "sentinel.protocol", "sentinel.bus", "sentinel.client", "sentinel.embedded", "sentinel.metrics_http")
# sentinel modules that may import trainer inside a function (they start an offline tool or the demo)
LAZY_TRAINER_USERS = ("sentinel/cli/replay_cmd.py", "sentinel/cli/verify_cmd.py", "sentinel/cli/demo_cmd.py", "sentinel/drill.py",
                      "sentinel/cli/docgen.py")  # docgen: the trainer's --help, for docs/cli.md


def _imports(path: Path, root: Path = ROOT) -> list[tuple[str, bool]]:
    """(absolute module name, at module level?) of every import statement in ``path``; a relative
    import is resolved against the file's package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    top_level = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "__future__":
                continue
            # ``from sentinel import detectors`` depends on sentinel.detectors: name each imported item
            out += [(f"{base}.{a.name}", id(node) in top_level) for a in node.names]
    return out


def _is(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_import_reader_sees_nested_relative_and_from_imports(tmp_path):
    """The reader the rules below rely on: it must not miss the forms a violation could take."""
    assert ("sentinel.detectors.robust.median_of", True) in _imports(ROOT / "sentinel" / "detectors" / "level.py")
    probe = tmp_path / "sentinel" / "detectors" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("import os\nfrom . import robust\nfrom .. import bus\ndef f():\n    import torch\n    from trainer.train import x\n")
    got = _imports(probe, root=tmp_path)
    assert ("os", True) in got and ("sentinel.detectors.robust", True) in got and ("sentinel.bus", True) in got
    assert ("torch", False) in got and ("trainer.train.x", False) in got


def test_the_contract_imports_nothing_of_ours():
    contract = sorted((ROOT / "sentinel" / "contract").glob("*.py"))
    bad = [f"{p.name}: {n}" for p in contract for n, _ in _imports(p)
           if _is(n, ("sentinel", "trainer")) and not _is(n, ("sentinel.contract",))]
    bad += [f"protocol.py: {n}" for n, _ in _imports(ROOT / "sentinel" / "protocol.py")
            if _is(n, ("sentinel", "trainer")) and not _is(n, ("sentinel.contract",))]
    assert bad == [] and len(contract) >= 10


def _module_graph(root: Path = ROOT, packages=("sentinel", "trainer")) -> dict[str, set[str]]:
    """Our modules and, for each, the modules of ours it imports (every import statement; an import
    of a package's own ``__init__`` from inside the package does not count)."""
    mods = {}
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            name = ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            mods[name] = p

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for name, _ in _imports(p, root):
            r = resolve(name)
            if r and r != m and not m.startswith(r + "."):
                graph[m].add(r)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function(tmp_path):
    pkg = tmp_path / "sentinel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from sentinel import b\n")
    (pkg / "b.py").write_text("def f():\n    from sentinel.a import x\n")
    (pkg / "c.py").write_text("import sentinel.a\n")
    assert _cycles(_module_graph(tmp_path, ("sentinel",))) == [["sentinel.a", "sentinel.b"]]


def test_no_import_cycles_in_function_imports_included():
    graph = _module_graph()
    assert len(graph) > 100 and _cycles(graph) == []


def test_the_pure_core_imports_only_the_protocol_itself_pydantic_yaml_and_numpy():
    stdlib = sys.stdlib_module_names
    problems = []
    for path in CORE:
        for name, _ in _imports(path):
            top = name.split(".")[0]
            if _is(name, ("sentinel", "trainer")):
                ok = _is(name, CORE_MAY_IMPORT_OF_OURS)
            elif top in stdlib:
                ok = not _is(name, IO_MODULES)
            else:
                ok = _is(name, CORE_MAY_IMPORT_THIRD_PARTY)
            if not ok:
                problems.append(f"{path.relative_to(ROOT)}: {name}")
    assert problems == []
    assert len(CORE) >= 14  # the detector and rule modules, their packages and the policy: the globs found them


def test_importing_the_core_loads_no_torch_redis_or_trainer():
    code = ("import json, sys\nimport sentinel.policy, sentinel.rules, sentinel.detectors\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'redis', 'trainer', 'prometheus_client', 'rich'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == []


def test_only_the_offline_tools_import_the_trainer():
    problems = []
    for path in sorted((ROOT / "sentinel").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name, top_level in _imports(path):
            if not _is(name, ("trainer",)):
                continue
            if rel.startswith("sentinel/offline/") or (not top_level and rel in LAZY_TRAINER_USERS):
                continue
            problems.append(f"{rel}: {name} ({'module level' if top_level else 'in a function'})")
    assert problems == []


def test_the_trainer_imports_only_the_contract_and_the_bus_helpers():
    problems = []
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        for name, _ in _imports(path):
            if _is(name, ("sentinel",)) and name != "sentinel" and not _is(name, TRAINER_MAY_IMPORT):
                problems.append(f"{path.relative_to(ROOT)}: {name}")
    assert problems == []


def test_no_command_loads_torch_for_its_help():
    """Every command's module is loaded (the group loads them lazily) and asked for its help."""
    code = ("import sys\nfrom sentinel.cli import COMMANDS, main\nn = 0\n"
            "for args in [['--help']] + [[c, '--help'] for c in COMMANDS]:\n"
            "    try:\n        main(args)\n    except SystemExit as e:\n        n += e.code == 0\n"
            "print(n, len(COMMANDS) + 1, 'TORCH' if 'torch' in sys.modules else 'NO TORCH', file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    last = out.stderr.strip().splitlines()[-1].split(" ", 2)
    assert last[0] == last[1] and int(last[0]) > 10, out.stderr[-2000:]  # every help exited 0
    assert last[2] == "NO TORCH", out.stderr[-2000:]
