"""The architecture as a test: imports run one way,

    cli -> training / deploy / diagnostics / mup tools -> models -> inference -> graphs

no two files import each other (directly or around a longer cycle), and the numerical
core a trained model runs imports no Pyro, NumPyro, JAX, ArviZ or networkx when it is
imported. Every import statement counts, including those inside functions."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("graphs", "inference", "probformer")
# (module prefix, floor): the longest matching prefix decides; higher floors import lower ones
FLOORS = {
    "graphs": 0,
    "inference": 1,
    "probformer.models": 2,
    "probformer.diagnostics": 3,
    "probformer.training": 3,
    "probformer.deploy": 3,
    "probformer.mup": 3,
    "probformer.cli": 4,
    "probformer.demo": 4,  # the main job: trains, diagnoses and exports
    "probformer.__main__": 4,
    "probformer": 4,  # the package itself: names imported on first use
}
RESEARCH_STACK = ("pyro", "numpyro", "jax", "arviz", "networkx", "xarray")
CORE = [
    "graphs.topology",
    "graphs.crf",
    "inference.mean_field.engine",
    "inference.mean_field.kernels.head_kernels",
    "inference.mean_field.halting",
    "inference.mean_field.folding",
    "inference.posterior",
    "probformer.models.registry",
    "probformer.models.blocks",
    "probformer.models.probabilistic_transformer",
    "probformer.models.particle_transformer",
    "probformer.models.baselines",
    "probformer.models.swarmformer",
    "probformer.models.folded_context",
    "probformer.deploy.reader",
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from a import b`` counts as ``a.b`` when that
    is a module, else ``a``)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m.split(".")[0] in PACKAGES and m != name}


def floor(name: str) -> int:
    prefix = max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len)
    return FLOORS[prefix]


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, name, set(found)) for name, path in found.items()}


def test_every_module_has_a_floor():
    assert all(floor(name) is not None for name in modules())


def test_no_import_runs_upward():
    upward = [
        f"{name} (floor {floor(name)}) imports {target} (floor {floor(target)})"
        for name, targets in graph().items()
        for target in targets
        if floor(target) > floor(name)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges = graph()
    # a file-level cycle is a strongly connected component with more than one module
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in edges:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    # a package's __init__ re-exporting its own submodules is not a cycle between files
    cycles = [c for c in cycles if not all(m.startswith(min(c, key=len) + ".") or m == min(c, key=len) for m in c)]
    assert not cycles, cycles


def test_the_layering_test_catches_an_upward_import():
    assert floor("probformer.models.blocks") < floor("probformer.training.trainer")
    assert floor("graphs.crf") < floor("inference.reference.exact") < floor("probformer.models.registry")
    assert floor("probformer.cli") > floor("probformer.deploy.exporter")


@pytest.mark.parametrize("module", CORE)
def test_the_numerical_core_imports_no_research_stack(module):
    script = (
        f"import sys, {module}\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & {set(RESEARCH_STACK)!r})\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", f"{module} imports {result.stdout.strip()}"
