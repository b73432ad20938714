"""The package's layering, read from the source (no imports run): no module uses another llmcompress module's
private (`_name`) functions, classes, methods or attributes, and the module-level imports between llmcompress
modules form no cycle (imports inside functions, the lazy ones, are allowed to point anywhere)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llmcompress"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def modules(root: Path = PACKAGE) -> dict[str, ast.Module]:
    """{dotted module name: its AST} for every .py file under `root` (a package's __init__ is the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = ast.parse(path.read_text(), str(path))
    return out


def _defined_private(tree: ast.Module) -> set[str]:
    """Private attributes a module's classes define: methods, nested classes and `self._x = ...` attributes
    (a module's private functions are reached through the module: see `_module_aliases`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names |= {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(n.name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    return names


def _module_aliases(tree: ast.Module, mods: dict) -> dict[str, str]:
    """{local name: llmcompress module} for the names a module binds to llmcompress modules (anywhere in it)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in mods and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmcompress"):
            for a in node.names:
                if f"{node.module}.{a.name}" in mods:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def private_uses(mods: dict[str, ast.Module]) -> list[str]:
    """`module:line what` for each use of another llmcompress module's private name."""
    defined = {name: _defined_private(tree) for name, tree in mods.items()}
    found = []
    for name, tree in mods.items():
        aliases = _module_aliases(tree, mods)
        elsewhere = set().union(*(d for m, d in defined.items() if m != name)) - defined[name]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmcompress") and node.module != name:
                found += [f"{name}:{node.lineno} from {node.module} import {a.name}" for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name):
                base = node.value.id
                if base in aliases and aliases[base] != name:
                    found.append(f"{name}:{node.lineno} {base}._{node.attr.lstrip('_')} of {aliases[base]}")
                elif base not in ("self", "cls") and node.attr in elsewhere:
                    found.append(f"{name}:{node.lineno} {base}.{node.attr} (defined in another llmcompress module)")
    return found


def import_graph(mods: dict[str, ast.Module]) -> dict[str, set[str]]:
    """{module: the llmcompress modules it imports at module level} (not under `if TYPE_CHECKING:`, not in functions)."""
    def owner(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = {}
    for name, tree in mods.items():
        deps = set()
        for node in tree.body:  # module level only
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.startswith("llmcompress")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmcompress"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(mods)
                deps |= subs if len(subs) == len(node.names) else subs | {owner(node.module)}
        graph[name] = {d for d in deps if d and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_private_names_across_modules():
    found = private_uses(modules())
    assert not found, "private names used across modules (make them public where they live):\n" + "\n".join(found)


def test_no_module_level_import_cycles():
    found = cycles(import_graph(modules()))
    assert not found, f"module-level import cycles (import one side inside a function, or move the shared piece down): {found}"


def _tree(files: dict[str, str], tmp_path: Path) -> dict[str, ast.Module]:
    root = tmp_path / "llmcompress"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return modules(root)


def test_the_checks_catch_what_they_look_for(tmp_path):
    """Each kind of violation in a small package is found; the allowed forms are not."""
    mods = _tree({
        "a.py": "def _helper():\n    pass\n\n\nclass Runner:\n    def _prefix(self):\n        return self._x\n",
        "b.py": "from llmcompress.a import _helper\n",
        "c.py": "from llmcompress import a\n\n\ndef f(r):\n    a._helper()\n    return r._prefix()\n",
        "d.py": "def f(m):\n    return m._buffers, m.__class__\n",  # torch's private names and dunders are not ours
        "e.py": "import llmcompress.f\n",
        "f.py": "from llmcompress import e\n",
        "g.py": "from llmcompress.a import Runner\n\n\ndef f():\n    from llmcompress import g2\n",
        "g2.py": "from llmcompress import g\n",  # g imports g2 inside a function only: no cycle
    }, tmp_path)
    found = private_uses(mods)
    assert any(s.startswith("llmcompress.b:1 from llmcompress.a import _helper") for s in found), found
    assert any(s.startswith("llmcompress.c:5 a._helper") for s in found), found
    assert any(s.startswith("llmcompress.c:6 r._prefix") for s in found), found
    assert len(found) == 3, found
    assert cycles(import_graph(mods)) == [["llmcompress.e", "llmcompress.f"]]
