"""Every module of the nopelens package, discovered from the source tree (nothing listed by hand),
and the nopelens modules each one imports, read from its source."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = ("models", "circuits", "probes", "analyses", "analyses.cli")
"""The direction imports flow in: a module imports only from its own layer or earlier ones."""


@lru_cache(maxsize=None)
def subpackages() -> dict[str, Path]:
    """``nopelens.<name>`` -> its source folder, as pyproject.toml's ``package-dir`` maps them: the
    source tree, whether nopelens is installed editable (as here) or not (as CI does)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items() if name != "nopelens"}


@lru_cache(maxsize=None)
def modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (source file, is a package), for every module of every subpackage and of
    ``nopelens`` itself (its ``__main__`` left out: importing it runs the CLI)."""
    found = {"nopelens": (ROOT / "src" / "nopelens" / "__init__.py", True)}
    for package, folder in subpackages().items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if is_package else parts)])
            found[name] = (path, is_package)
    return found


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``; ``nopelens`` itself (its version, nothing else)
    is at the bottom with ``models``."""
    if module == "nopelens":
        return 0
    inner = module.removeprefix("nopelens.")
    return max(i for i, name in enumerate(LAYERS) if inner == name or inner.startswith(name + "."))


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


@lru_cache(maxsize=None)
def imports(type_checking: bool = False) -> dict[str, frozenset[str]]:
    """Module -> the nopelens modules it imports at run time, at module level or inside a function;
    with ``type_checking``, also those imported only under ``if TYPE_CHECKING:`` (not run)."""
    known = modules()
    graph = {}
    for name, (path, is_package) in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        targets = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or (
                not type_checking and _type_checking_only(node, parents)
            ):
                continue
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = name if is_package else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = node.module if not node.level else ".".join(filter(None, [base, node.module]))
            targets.update(
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module for alias in node.names
            )
        resolved = set()
        for target in targets:
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != name and target.startswith("nopelens"):
                resolved.add(target)
        graph[name] = frozenset(resolved)
    return graph
