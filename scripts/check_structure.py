"""Check the package's structure without importing anything: no module outside `cli/` imports the CLI, no import
cycle among the package's modules, no file longer than MAX_LINES, and no cache layer that keeps hold of its cache.

    python scripts/check_structure.py            # the kvzip/ package beside this script
    python scripts/check_structure.py path/pkg   # any package folder (the tests use a crafted bad one)

Every `.py` file is parsed with `ast`. An import names a module of the package when it is `import pkg.x`,
`from pkg.x import y` (`pkg.x.y` when y is itself a module, else `pkg.x`) or the relative forms of these.

- The CLI rule counts every import, wherever it sits: a library module that imports `pkg.cli` even inside a function
  still depends on the command line. The package's `__main__` (what `python -m pkg` runs) is an entry point like the
  console script, not library code: it may import the CLI.
- The cycle rule counts module-level imports only (class bodies and module-level `if`/`try` included, `if
  TYPE_CHECKING:` blocks excluded): those run while a module is being initialised, where a cycle means a
  half-initialised module. An import inside a function runs when the function is called, after every module has
  finished loading, so it cannot deadlock initialisation; it is how a command keeps torch off its start-up path, and
  the count of such imports (with those under TYPE_CHECKING, which never run) is printed for information.
- A submodule's import of its parent package is implied by Python and never counted (`pkg.m.a` importing `pkg.m.b`
  runs `pkg/m/__init__.py` first, but that package is already initialising), so only the names written count.

- The size rule keeps each file readable in one sitting: a module that outgrows it splits (a method moves its
  machinery into a module of its own, as `methods/coded/` and `methods/thoughts/` do).
- The layer rule: a class under `methods/` whose name ends in `Layer` reads what its cache hands it each forward
  (`ForwardState`) and never keeps the cache or state shared among layers: none of its methods assigns `self.cache`
  or `self.rope_memo`, or stores on `self` a parameter annotated with a cache class or a cache it builds (a cache
  class: `Cache`, `KVCache`, or any class of the package deriving from one, by name).

Exit code 0 when every rule holds, 1 with one line per violation otherwise.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_LINES = 400
LAYER_REACH = ("cache", "rope_memo")  # what a cache layer may not keep: its cache, state its cache's layers share


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package folder `root`."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> list[tuple[ast.stmt, bool]]:
    """Every import statement with whether it runs at module initialisation (False: inside a function body)."""
    out = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((child, top))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                visit(ast.Module(body=child.body, type_ignores=[]), False)
                visit(ast.Module(body=child.orelse, type_ignores=[]), top)
            else:
                visit(child, top)

    visit(tree, True)
    return out


def targets(node: ast.stmt, module: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The package modules an import statement in `module` names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    named = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    rest = [a for a in node.names if f"{base}.{a.name}" not in known]
    return named + ([base] if rest and base in known else [])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def cache_classes(trees: list[ast.Module]) -> set[str]:
    """Names of the cache classes: `Cache`, `KVCache` and every class of the package deriving from one (by name)."""
    bases: dict[str, list[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
    found, grown = {"Cache", "KVCache"}, True
    while grown:
        new = {name for name, of in bases.items() if name not in found and any(b in found for b in of)}
        found |= new
        grown = bool(new)
    return found


def _annotation_names(node: ast.AST | None) -> set[str]:
    """Every name an annotation mentions, string annotations ("ThoughtCache", "list[X]") included."""
    names: set[str] = set()
    for sub in ast.walk(node) if node is not None else ():
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            names.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            try:
                names |= _annotation_names(ast.parse(sub.value, mode="eval"))
            except SyntaxError:
                pass
    return names


def layer_reaches(tree: ast.Module, path: Path, caches: set[str]) -> list[str]:
    """The layer rule's violations in one module (module docstring)."""
    problems = []
    for cls in ast.walk(tree):
        if not (isinstance(cls, ast.ClassDef) and cls.name.endswith("Layer")):
            continue
        for func in cls.body:
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = func.args
            held = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
                    if _annotation_names(a.annotation) & caches}
            for node in ast.walk(func):
                if isinstance(node, ast.Assign):
                    pairs = [(t, node.value) for t in node.targets]
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                    pairs = [(node.target, node.value)]
                else:
                    continue
                for target, value in list(pairs):  # a, b = x, y: each target with its own value
                    if isinstance(target, ast.Tuple):
                        values = value.elts if isinstance(value, ast.Tuple) and len(value.elts) == len(target.elts) \
                            else [value] * len(target.elts)
                        pairs += list(zip(target.elts, values))
                for target, value in pairs:
                    if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id == "self"):
                        continue
                    called = value.func if isinstance(value, ast.Call) else None
                    if target.attr in LAYER_REACH:
                        what = f"self.{target.attr}"
                    elif isinstance(value, ast.Name) and value.id in held:
                        what = f"a cache (self.{target.attr} = {value.id})"
                    elif called is not None and _annotation_names(called) & caches:
                        what = f"a cache it builds (self.{target.attr})"
                    else:
                        continue
                    problems.append(f"{path}:{node.lineno}: {cls.name}.{func.name} keeps {what}: a layer reads what "
                                    "its cache hands it each forward (`state`), never the cache")
    return problems


def check(root: Path) -> tuple[list[str], str]:
    """(violations, summary line) for the package folder `root`."""
    known = modules(root)
    cli = f"{root.name}.cli"
    graph: dict[str, set[str]] = {m: set() for m in known}
    problems, lazy, eager = [], 0, 0
    trees = {module: ast.parse(path.read_text(), filename=str(path)) for module, path in known.items()}
    caches = cache_classes(list(trees.values()))
    for module, path in known.items():
        tree = trees[module]
        if module.startswith(f"{root.name}.methods."):
            problems += layer_reaches(tree, path, caches)
        for node, top in _imports(tree):
            for target in targets(node, module, path.name == "__init__.py", known):
                if target == module:
                    continue
                in_cli = module in (cli, f"{root.name}.__main__") or module.startswith(cli + ".")
                if not in_cli and (target == cli or target.startswith(cli + ".")):
                    problems.append(f"{path}:{node.lineno}: {module} imports {target}: only {cli} may import the CLI")
                if top:
                    eager += 1
                    graph[module].add(target)
                else:
                    lazy += 1
    for module, path in known.items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            problems.append(f"{path}: {lines} lines; a file stays under {MAX_LINES}: split it (a method moves its "
                            "machinery into a module of its own)")
    for component in cycles(graph):
        problems.append(f"import cycle among module-level imports: {' <-> '.join(component)}")
    summary = (f"{len(known)} modules, {eager} module-level and {lazy} deferred (in a function or TYPE_CHECKING) "
               f"imports of {root.name} modules; "
               f"no module outside {cli} imports it, no import cycle, no file over {MAX_LINES} lines, "
               "no layer that keeps its cache")
    return problems, summary


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "kvzip"
    if not (root / "__init__.py").is_file():
        print(f"check_structure: {root} is not a package folder (no __init__.py)", file=sys.stderr)
        sys.exit(2)
    problems, summary = check(root.resolve())
    for line in problems:
        print(line)
    if problems:
        sys.exit(1)
    print(f"ok: {summary}")


if __name__ == "__main__":
    main()
