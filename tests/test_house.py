"""The house rules the code is held to (issue 26): functions that read in a screen, no import
circle between files, adapters that stop at the runtime's public surface, a README that is a
front door with the rest in docs/.

Static checks over the source (ast): cheap, and each names the offender and what to do."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protrain", "protrain_ds", "protrain_megatron")
ADAPTERS = ("protrain_ds", "protrain_megatron")
MAX_FUNCTION_LINES = 120
MAX_README_LINES = 250


def _sources(*packages: str):
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_function_longer_than_a_screen_and_a_half():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _sources(*PACKAGES) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines (split them into phases named "
                      f"for what they decide): {long}")


def _import_graph() -> dict[str, set[str]]:
    trees = {_module_name(p): (p, t) for p, t in _sources(*PACKAGES)}

    def owner(name: str) -> str | None:
        while name and name not in trees:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in trees}
    for mod, (path, tree) in trees.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):                    # imports inside functions count too
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in trees else base for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in map(owner, targets) if t and t != mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_files():
    circles = _cycles(_import_graph())
    assert not circles, (f"modules that import each other (directly or round a circle, imports inside "
                         f"functions included): {circles}; move what both need into a module of its own")


# What each layer may not import: the runtime stands below the measuring code, the cost and
# search models, the planning session, the CLI and the adapters (it runs a Plan it is given);
# the profile values stand below the runtime and the measuring code that fills them in.
_LAYERS_BELOW = {
    "protrain.runtime": ("protrain.measure", "protrain.cost", "protrain.search", "protrain.session",
                         "protrain.cli", *ADAPTERS),
    "protrain.profile": ("protrain.runtime", "protrain.measure"),
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_layers_import_only_downward():
    graph = _import_graph()
    assert all(any(_within(mod, layer) for mod in graph) for layer in _LAYERS_BELOW)
    upward = sorted(f"{mod} -> {dep}" for mod, deps in graph.items()
                    for layer, banned in _LAYERS_BELOW.items() if _within(mod, layer)
                    for dep in deps if any(_within(dep, b) for b in banned))
    assert not upward, (f"imports that run back up a layer: {upward}; move what the lower layer "
                        f"needs down into it (a value beside Plan, the runtime's own meter), or the "
                        f"code that uses the upper layer up into it (protrain/measure/)")


def _runtime_private_names() -> set[str]:
    """Private attributes and methods the runtime's classes define for themselves."""
    names = set()
    for _, tree in _sources("protrain/runtime"):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_adapters_stop_at_the_runtime_surface():
    private = _runtime_private_names()
    uses = [f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}"
            for path, tree in _sources(*ADAPTERS) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in private
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    assert not uses, (f"adapters reach into the runtime's private state: {uses}; give the runtime "
                      f"a public method named for the event instead")


def test_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= MAX_README_LINES, (
        f"README.md has {len(readme.splitlines())} lines (at most {MAX_README_LINES}): move "
        f"reference and design text into docs/ and link it")
    links = set(re.findall(r"\]\((docs/[^)#\s]+)", readme))
    assert links, "README.md links no page of docs/"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links pages that do not exist: {missing}"
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in links]
    assert not unlinked, f"pages of docs/ the README does not link: {unlinked}"
