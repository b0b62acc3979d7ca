"""The layout's rules, read from the source with `ast` (imports inside functions count too).

- `trainers` imports neither `emulator` nor `harness`; `emulator` never imports `harness` or
  `trainers`; `harness` may import both.
- No import cycle between modules, at file level.
- No module imports a private name (`_x`) of another module.
- No code touches another object's private attribute (`obj._x` where `obj` is not `self`, `cls`,
  `super()`, `type(self)` or the enclosing class), but for an allow-list with reasons.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("emulator", "harness", "trainers")
FORBIDDEN = {"emulator": {"harness", "trainers"}, "trainers": {"emulator", "harness"}, "harness": set()}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `module`)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for every import statement, nested ones too."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(module, path.name == "__init__.py", node)
            names = [alias.name for alias in node.names]
            # `from pkg import mod` imports the module pkg.mod
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            if submodules:
                found += [(s, [], node.lineno) for s in submodules]
                names = [n for n in names if f"{target}.{n}" not in modules]
            if names or not submodules:
                found.append((target, names, node.lineno))
    return found


def project_graph() -> dict[str, set[str]]:
    modules = all_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for target, _, _ in imports_of(module, path, modules):
            # importing a.b.c runs a/__init__ and a/b/__init__ too, but those are not the module's
            # own dependency on the code it names: the edge goes to the named module only
            if target in modules and target != module:
                graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as a list of modules, or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {node: WHITE for node in graph}
    stack: list[str] = []

    def visit(node):
        colour[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == GREY:
                return stack[stack.index(nxt):] + [nxt]
            if colour[nxt] == WHITE:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        colour[node] = BLACK
        return None

    for node in sorted(graph):
        if colour[node] == WHITE:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_cycle_finder_finds_a_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_relative_imports_resolve_like_python():
    node = ast.parse("from ..plan import Plan").body[0]
    assert resolve("emulator.backends.tc", False, node) == "emulator.plan"
    node = ast.parse("from .base import Backend").body[0]
    assert resolve("emulator.backends", True, node) == "emulator.backends.base"


def test_no_import_cycle():
    cycle = find_cycle(project_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_run_one_way(package):
    modules = all_modules()
    bad = []
    for module, path in modules.items():
        if module.split(".")[0] != package:
            continue
        for target, _, line in imports_of(module, path, modules):
            if target.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, f"{package} must not import {sorted(FORBIDDEN[package])}:\n" + "\n".join(bad)


def test_no_private_name_imported_from_another_module():
    modules = all_modules()
    bad = []
    for module, path in modules.items():
        for target, names, line in imports_of(module, path, modules):
            if target.split(".")[0] not in PACKAGES:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {', '.join(private)} from {target}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


# Reaching into another object's private attribute (`obj._x`), by exact (module, expression), each
# with the reason it cannot go through a public name.
PRIVATE_ACCESS_ALLOWED = {
    # the documented way to leave a forked child without running the parent's clean-up (atexit,
    # buffered files): the stdlib's name for it is private by spelling only
    ("emulator.node_enter", "os._exit"),
    ("trainers.__main__", "os._exit"),
    # torch.distributed has no public accessor for the sender of an irecv from any source;
    # torch.distributed.recv itself returns work._source_rank() for src=None
    ("trainers.comm.torch_backend", "work._source_rank"),
}


def is_private_name(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def refers_to_self(node: ast.expr, classes: list[str]) -> bool:
    """Whether ``node`` is the object itself or its class: ``self``, ``cls``, ``super()``,
    ``type(self)`` or the name of a class the code sits in."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls") or node.id in classes
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "super":
            return True
        if node.func.id == "type" and len(node.args) == 1 and not node.keywords:
            return isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls")
    return False


def private_accesses(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, expression) for every ``obj._x`` in ``source`` where ``obj`` is not the object itself
    (:func:`refers_to_self`)."""
    found = []

    def visit(node: ast.AST, classes: list[str]) -> None:
        if isinstance(node, ast.ClassDef):
            classes = classes + [node.name]
        if isinstance(node, ast.Attribute) and is_private_name(node.attr) and not refers_to_self(node.value, classes):
            found.append((node.lineno, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, classes)

    visit(ast.parse(source, filename), [])
    return found


def test_private_access_finder_tells_self_from_others():
    source = (
        "class A:\n"
        "    def f(self, other):\n"
        "        self._a; cls._b; super()._c; type(self)._d; A._e; self.__dict__\n"
        "        other._x\n"
        "        self.peer._y\n"
        "def g(obj):\n"
        "    return obj._z()\n"
    )
    assert private_accesses(source) == [(4, "other._x"), (5, "self.peer._y"), (7, "obj._z")]


def test_no_private_attribute_of_another_object():
    bad = []
    for module, path in all_modules().items():
        for line, expression in private_accesses(path.read_text(), str(path)):
            if (module, expression) not in PRIVATE_ACCESS_ALLOWED:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {expression}")
    assert not bad, ("private attributes of another object (give the owner a public name, or allow-list "
                     "the exact (module, expression) with a reason):\n" + "\n".join(bad))
