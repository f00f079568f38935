"""fp4jax's modules import each other without a circle: read from the source (ast), nothing is imported."""

import ast
import pathlib

from helpers import module_name

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fp4jax"


def imports_of(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The fp4jax modules `path` imports, at module level or in a function: `from fp4jax.x import y` counts
    fp4jax.x.y when that is a module, else fp4jax.x (a package's __init__ is not counted for its
    submodules, which is how Python resolves them once the package is initialised)."""
    name, found = module_name(path), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base]).strip(".")
            named = [f"{base}.{alias.name}" for alias in node.names]
            found.update(named)
            if any(n not in modules for n in named):  # a name from the package's __init__, not a submodule
                found.add(base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def circles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components with more than one module (Tarjan), each as sorted names."""
    index, low, stack, on_stack, found = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle_and_only_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == {("a", "b", "c")}


def test_no_import_circle_inside_fp4jax():
    graph = import_graph()
    assert "fp4jax.training.trainer" in graph and "fp4jax.training.setup" in graph["fp4jax.training.trainer"]
    found = circles(graph)
    assert not found, f"import circles inside fp4jax: {sorted(found)}"


def top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def declared_all(tree: ast.Module) -> list[str] | None:
    """The names of a module-level `__all__ = [...]` (or `__all__: list[str] = [...]`), else None."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, ast.Assign | ast.AnnAssign) and any(
            getattr(t, "id", None) == "__all__" for t in targets
        ):
            return [elt.value for elt in node.value.elts]
    return None


def test_every_library_module_lists_its_public_names_and_each_exists():
    missing, false = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if path.name == "__main__.py":  # a command line, not a library module
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        listed = declared_all(tree)
        if listed is None:
            missing.append(name)
            continue
        false += [f"{name}.{n}" for n in listed if n not in top_level_names(tree)]
    assert not missing, f"modules without __all__: {missing}"
    assert not false, f"__all__ names that the module does not define: {false}"


# fp4jax.study's pipeline, lowest layer first (docs/design.md, Layout): a module imports only modules of its
# own layer or lower ones. The gate sits below the schedule because the schedule consults it.
STUDY_LAYERS = (
    ("runs", "runner", "stats", "command", "records"),
    ("plan",),
    ("gate", "analysis"),
    ("reuse", "progress", "schedule"),
    ("claims", "lr_stress", "branch_analysis", "instrument_trend", "power"),
    ("tables", "plots", "report"),
    ("trend",),
    ("scratch", "branching"),
    ("designs",),
    ("__main__",),
)


def test_the_study_layers_import_only_downwards():
    graph = import_graph()
    rank = {f"fp4jax.study.{m}": i for i, layer in enumerate(STUDY_LAYERS) for m in layer}
    study = {m for m in graph if m.startswith("fp4jax.study.")}
    assert study == set(rank), f"modules of fp4jax.study not in STUDY_LAYERS: {sorted(study ^ set(rank))}"
    upward = [(m, d) for m in study for d in graph[m] if d in rank and rank[d] > rank[m]]
    assert not upward, f"imports from a lower layer of fp4jax.study into a higher one: {sorted(upward)}"


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for d in graph[todo.pop()] - seen:
            seen.add(d)
            todo.append(d)
    return seen


def test_the_study_imports_neither_the_models_nor_the_ops():
    """Only the instruments command (fp4jax.instruments, imported inside it) needs jax's model and ops."""
    graph = import_graph()
    for module in (m for m in graph if m.startswith("fp4jax.study.") and m != "fp4jax.study.__main__"):
        bad = {d for d in reachable(graph, module) if d.startswith(("fp4jax.models", "fp4jax.ops"))}
        assert not bad, f"{module} reaches {sorted(bad)}"
    cli = {k: v - {"fp4jax.instruments"} if k == "fp4jax.study.__main__" else v for k, v in graph.items()}
    assert not any(
        d.startswith(("fp4jax.models", "fp4jax.ops")) for d in reachable(cli, "fp4jax.study.__main__")
    )
