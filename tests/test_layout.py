"""The package's layout holds: hook names come from one helper, imports flow one way
(cli -> analyses -> probes -> models) without a loop, no module needs another to be imported first, and
no module of the package is longer than 600 lines."""

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from package_modules import imports, layer, modules, subpackages

from nopelens.models import hooks
from nopelens.models.hf.family import FAMILIES_PACKAGE, declared

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("models", "circuits", "probes", "analyses", "examples", "benchmarks", "src")

HAND_WRITTEN_HOOK = re.compile(r"""f["']blocks\.|["']blocks\.["']\s*\+""")


def source_files():
    for folder in SOURCE_FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_hook_names_are_built_by_the_helper_only():
    """No ``f"blocks.{l}...."`` outside :mod:`nopelens.models.hooks`."""
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in source_files()
        if path != ROOT / "models" / "hooks.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if HAND_WRITTEN_HOOK.search(line)
    ]
    assert not found, "build hook names with nopelens.models.hooks.act_name:\n" + "\n".join(found)


def test_act_name_gives_transformer_lens_names_and_refuses_unknown_ones():
    assert hooks.act_name("resid_pre", 0) == "blocks.0.hook_resid_pre"
    assert hooks.act_name("hook_rot_k", 3) == "blocks.3.attn.hook_rot_k"
    assert hooks.act_name("post", 1) == "blocks.1.mlp.hook_post"
    import numpy as np

    assert hooks.act_name("pattern", np.int64(2)) == "blocks.2.attn.hook_pattern"
    with pytest.raises(ValueError, match="unknown hook 'resid_pst'.*resid_post"):
        hooks.act_name("resid_pst", 0)
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="block index"):
            hooks.act_name("pattern", bad)


def test_act_name_knows_every_hook_a_decoder_has():
    from nopelens.models import Decoder, DecoderConfig

    cfg = DecoderConfig(d_vocab=8, n_ctx=8, n_layers=2, d_model=16, n_heads=2, position=["alibi", "rope"])
    names = {name for name in Decoder(cfg).hook_dict if name.startswith("blocks.") and ".ln" not in name}
    known = {hooks.act_name(name.rsplit(".", 1)[-1], int(name.split(".")[1])) for name in names}
    assert known == names and "blocks.1.attn.hook_rot_q" in names


# ----------------------------------------------------------------------------- the import graph


def test_imports_flow_one_way():
    """cli -> analyses -> probes -> (circuits ->) models: no module imports a later layer, at
    module level or inside a function."""
    backwards = [
        f"{module} imports {target}"
        for module, targets in sorted(imports().items())
        for target in sorted(targets)
        if layer(target) > layer(module)
    ]
    assert not backwards, "\n".join(backwards)


@pytest.mark.parametrize("type_checking", [False, True], ids=["run time", "type checking too"])
def test_no_import_loop(type_checking):
    """No module needs one that needs it back, in any layer: counting imports inside functions, and
    then also those under ``if TYPE_CHECKING:`` (a circle of types is still a circle of concepts)."""
    loops = [cycle for cycle in _cycles(dict(imports(type_checking))) if len(cycle) > 1]
    assert not loops, loops


def test_the_import_graph_reads_type_checking_imports_only_when_asked():
    """tl_compat imports the config for its annotations only (the case that makes the flag matter)."""
    config, tl_compat = "nopelens.models.config", "nopelens.models.tl_compat"
    assert config not in imports()[tl_compat] and config in imports(type_checking=True)[tl_compat]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan), each a list of modules."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_loop():
    assert sorted(map(sorted, _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}))) == [["a", "b"], ["c"]]


# ----------------------------------------------------------------------------- imports inside functions

MAX_LAZY_IMPORTS = 8
"""Imports inside a package function: each avoids a real cost (distributed is optional, a module
that takes seconds to import, the CLI's start-up), and says so on its line."""

LAZY_REASON = re.compile(r"#\s*lazy:\s*\S")


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """``(line number, line)`` of every import statement inside a function of ``path``."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    functions = [
        node for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    found = {
        node.lineno
        for function in functions
        for node in ast.walk(function)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    return [(number, lines[number - 1]) for number in sorted(found)]


def test_function_level_imports_are_few_and_each_says_why():
    package = [
        path for folder in [ROOT / "src" / "nopelens", *subpackages().values()] for path in sorted(folder.rglob("*.py"))
    ]
    lazy = [
        (path.relative_to(ROOT), number, line.strip())
        for path in package
        for number, line in function_level_imports(path)
    ]
    unexplained = [f"{path}:{number}: {line}" for path, number, line in lazy if not LAZY_REASON.search(line)]
    assert not unexplained, (
        "import at the module's top, or say on the line why not (`# lazy: distributed is "
        "optional`):\n" + "\n".join(unexplained)
    )
    assert len(lazy) <= MAX_LAZY_IMPORTS, "\n".join(f"{path}:{number}: {line}" for path, number, line in lazy)


def test_the_lazy_import_finder_reads_imports_inside_functions_only(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os\n\ndef f():\n    import json  # lazy: why\n    class C:\n        def g(self):\n"
        "            from a import b\n"
    )
    assert function_level_imports(source) == [(4, "    import json  # lazy: why"), (7, "            from a import b")]
    assert LAZY_REASON.search("    import json  # lazy: why") and not LAZY_REASON.search("    import json  # lazy:")


# ----------------------------------------------------------------------------- module size

MAX_LINES = 600
"""Issue 39: a module of the package longer than this holds more than one concern; split it by concern."""
SIZED_FOLDERS = ("models", "circuits", "probes", "analyses")


def longer_than(limit: int, folders: list[Path]) -> dict[Path, int]:
    """``{path: line count}`` of every ``.py`` file below ``folders`` with more than ``limit`` lines."""
    counts = {
        path: len(path.read_text(encoding="utf-8").splitlines())
        for folder in folders
        for path in sorted(folder.rglob("*.py"))
    }
    return {path: count for path, count in counts.items() if count > limit}


def test_every_module_is_at_most_600_lines():
    long = longer_than(MAX_LINES, [ROOT / folder for folder in SIZED_FOLDERS])
    assert not long, f"split by concern (issue 39), at most {MAX_LINES} lines a module:\n" + "\n".join(
        f"{path.relative_to(ROOT)}: {count} lines" for path, count in long.items()
    )


def test_the_size_rule_counts_every_python_file_below_a_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * 601)
    (tmp_path / "fits.py").write_text("x = 1\n" * 600)
    (tmp_path / "notes.txt").write_text("x\n" * 700)
    assert longer_than(600, [tmp_path]) == {tmp_path / "sub" / "long.py": 601}


def test_analyses_never_import_the_cli():
    cli = [
        f"{module} imports {target}"
        for module, targets in imports().items()
        if module.startswith("nopelens.analyses.") and not module.startswith("nopelens.analyses.cli")
        for target in targets
        if target.startswith("nopelens.analyses.cli")
    ]
    assert not cli, cli


def test_no_analysis_imports_the_rendering():
    """The analyses return tables; the CLI renders them (issue 39): only the CLI imports
    ``analyses.report`` (summary tables, Markdown and a sweep's run-folder figures)."""
    rendering = "nopelens.analyses.report"
    found = [
        f"{module} imports {rendering}"
        for module, targets in imports(type_checking=True).items()
        if module.startswith("nopelens.analyses.")
        and not module.startswith("nopelens.analyses.cli")
        and rendering in targets
    ]
    assert not found, found


@pytest.mark.slow
def test_each_module_imports_alone():
    """Import every module first, in a fresh set of nopelens modules (third-party ones stay loaded,
    so this takes seconds): an import that works only after another module would fail."""
    names = list(modules())
    code = textwrap.dedent(f"""
        import importlib, sys, traceback
        failed = []
        for name in {names!r}:
            for loaded in [m for m in sys.modules if m == "nopelens" or m.startswith("nopelens.")]:
                del sys.modules[loaded]
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
        print("\\n".join(failed) or "ok")
    """)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok", result.stdout


HF_CORE = (
    "models/hf/config.py",
    "models/hf/layout.py",
    "models/hf/census.py",
    "models/hf/family.py",
    "models/hf/__init__.py",
    "models/adapters.py",
    "models/hf_loading.py",
    "analyses/audit/hf.py",
)


def test_a_family_is_one_file():
    """Every HF family is declared by exactly one module of ``models/hf/families/``, and no model
    type is named anywhere else: not in the HF core, which reads declared traits only, nor in
    another family's module."""
    sources = declared()
    assert sources, "no family declared"
    elsewhere = {t: s for t, s in sources.items() if not s.startswith(FAMILIES_PACKAGE + ".")}
    assert not elsewhere, elsewhere
    files = {
        name: ROOT / "models" / "hf" / "families" / f"{name.rsplit('.', 1)[-1]}.py" for name in set(sources.values())
    }
    named = []
    for model_type, source in sources.items():
        quoted = re.compile(rf"""["']{re.escape(model_type)}["']""")
        named += [
            f"{path}: {model_type}"
            for path in [*(ROOT / c for c in HF_CORE), *files.values()]
            if path != files[source] and quoted.search(path.read_text())
        ]
    assert not named, "\n".join(named)
