"""The modules of flashtrain import one another one way: the import graph among flashtrain.* modules has no cycle.

Every `import` and `from ... import` counts, at module level and inside functions alike (a lazy import only hides
a cycle until the function runs). Relative imports are resolved, and `from package import name` is an edge to the
submodule `package.name` when that is a module (and to the package's `__init__` otherwise). A package's
`__init__` importing its own submodules is normal; a cycle through it appears only when one of those submodules
imports the package back, and then the submodule should import the concrete module instead."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "flashtrain"


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> source file, for every Python module under `root / package`; a package is named by
    its directory and stands for its `__init__.py`."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of the dotted `name` that is one of `modules`, or None (a name outside the package)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) if parts else None


def imported_modules(tree: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The package modules that the module's import statements (anywhere in it, functions included) import.
    `import a.b.c` is an edge to `a.b.c` alone: it also runs `a` and `a.b`, but a package's `__init__` that imports
    its submodules would then make every import of a submodule look like a cycle. `from pkg import name` is an
    edge to the submodule `pkg.name` when that is a module, and to `pkg`'s `__init__` when `name` is defined there."""
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(nearest_module(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per further dot
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in modules else nearest_module(source, modules))
    targets.discard(None)
    targets.discard(module)
    return targets


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = module_files(root, package)
    return {module: imported_modules(ast.parse(path.read_text(), filename=str(path)), module,
                                     path.name == "__init__.py", modules)
            for module, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None when it has none."""
    state = {}  # absent: not visited, 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            step = next(stack[-1], None)
            if step is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(step) == 1:
                return path[path.index(step):] + [step]
            elif step not in state and step in graph:
                state[step] = 1
                path.append(step)
                stack.append(iter(sorted(graph[step])))
    return None


def test_flashtrain_imports_have_no_cycle():
    cycle = find_cycle(import_graph(ROOT, PACKAGE))
    assert cycle is None, "import cycle among flashtrain modules: " + " -> ".join(cycle)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_finds_a_function_level_cycle(tmp_path):
    write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "from pkg.low.a import f\n",
        "pkg/low/a.py": "def f():\n    from .b import g\n    return g()\n",
        "pkg/low/b.py": "from pkg.low import a\n\ndef g():\n    return 1\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.low"] == {"pkg.low.a"}
    assert graph["pkg.low.a"] == {"pkg.low.b"}
    assert graph["pkg.low.b"] == {"pkg.low.a"}  # `from pkg.low import a` names the submodule, not the __init__
    assert find_cycle(graph) in (["pkg.low.a", "pkg.low.b", "pkg.low.a"], ["pkg.low.b", "pkg.low.a", "pkg.low.b"])


def test_a_package_init_importing_its_submodules_is_no_cycle(tmp_path):
    write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import f\nfrom . import b\n",
        "pkg/a.py": "import pkg.b\n\ndef f():\n    return pkg.b.g()\n",
        "pkg/b.py": "def g():\n    return 1\n",
        "pkg/c.py": "from pkg.a import f\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": {"pkg.a", "pkg.b"}, "pkg.a": {"pkg.b"}, "pkg.b": set(), "pkg.c": {"pkg.a"}}
    assert find_cycle(graph) is None
    write(tmp_path, {"pkg/b.py": "from pkg import f\n\ndef g():\n    return f()\n"})  # back into the __init__
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg", "pkg.a", "pkg.b", "pkg"]
