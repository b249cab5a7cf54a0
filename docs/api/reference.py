"""How mkdocs reads the API reference: a hook (``hooks:`` in mkdocs.yml) that lays out the source
tree, and a griffe extension (``extensions:``) for the project's docstring sections.

The distribution maps top-level folders to subpackages (``package-dir`` in pyproject.toml:
``models/`` is ``nopelens.models``), which an installed copy resolves but a source checkout or an
editable install does not: griffe, which mkdocstrings reads the docstrings with (statically, without
importing), looks for ``nopelens/models/``. This hook lays the package out as installed, from
symlinks into the checkout, under ``build/api-source/`` (ignored by git), and points mkdocstrings
at it, so the reference always documents the checkout's code.

The docstrings head their doctests ``Example:`` (DESIGN.md's template; Napoleon reads it), which
griffe's Google parser does not know (it knows ``Examples:``) and would render as prose, its output
lines as Markdown: :class:`ExampleSections` reads one as the other.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import griffe
from mkdocs.plugins import event_priority

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "build" / "api-source"


def source_tree(root: Path = ROOT, tree: Path = TREE) -> Path:
    """Lay out ``tree/<package>/`` as pyproject.toml's ``package-dir`` maps it, from symlinks into
    ``root``; returns ``tree``.

    Raises:
        ValueError: when a mapped subpackage is nested deeper than one level below the package.
    """
    mapping = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    top_name = min(mapping, key=len)
    shutil.rmtree(tree, ignore_errors=True)
    top = tree / top_name
    top.mkdir(parents=True)
    for item in (root / mapping[top_name]).iterdir():
        if item.name != "__pycache__":
            (top / item.name).symlink_to(item.resolve())
    for name, folder in mapping.items():
        if name == top_name:
            continue
        relative = name.removeprefix(f"{top_name}.")
        if "." in relative:
            raise ValueError(f"package-dir maps {name}, deeper than one level below {top_name}")
        (top / relative).symlink_to((root / folder).resolve(), target_is_directory=True)
    return tree


@event_priority(100)  # before mkdocstrings reads its handlers' options
def on_config(config):
    """Point mkdocstrings' Python handler at :func:`source_tree`."""
    handler = config["plugins"]["mkdocstrings"].config["handlers"].setdefault("python", {})
    handler["paths"] = [str(source_tree())]
    return config


ROLE = re.compile(r":(?:func|meth|class|mod|data|attr|exc|obj):`(?:[^`<]*<)?~?([\w.]+)>?`")
"""A Sphinx cross-reference in a docstring (``:func:`~nopelens.probes.collect```, ``:meth:`fit```,
``:attr:`title <nopelens.x.Y>```): its target."""


SHOWN_ROLE = re.compile(r":(?:func|meth|class|mod|data|attr|exc|obj):`([^`]+)`")


def _shown(match: re.Match) -> str:
    """A Sphinx cross-reference as the reference shows it: code, the title or (``~``) the last name.

    >>> _shown(SHOWN_ROLE.search(":func:`~nopelens.probes.collect`")), _shown(SHOWN_ROLE.search(":attr:`a <x.A>`"))
    ('`collect`', '`a`')
    """
    text = match.group(1)
    if "<" in text:
        return f"`{text.split('<')[0].strip()}`"
    return f"`{text[1:].rsplit('.', 1)[-1]}`" if text.startswith("~") else f"`{text}`"


class DocstringConventions(griffe.Extension):
    """The project's docstring conventions, for griffe: ``Example:`` sections are read as
    ``Examples:`` (doctests as code), and every Sphinx cross-reference (``:func:`...```) must name
    an object of the package, or the build warns (and ``mkdocs build --strict`` fails).

    A target (or ``.target``) is looked up from the object that documents it outward (its class,
    module, parent packages), then from the package root; a dotted target whose first name is none of those
    (``torch.Tensor``) is another package's and is not checked.
    """

    HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.M)

    def __init__(self) -> None:
        super().__init__()
        self.references: list[tuple[griffe.Object, str]] = []

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is None:
            return
        self.references += [(obj, target) for target in ROLE.findall(obj.docstring.value)]
        text = self.HEADING.sub(r"\1Examples:", obj.docstring.value)
        obj.docstring.value = SHOWN_ROLE.sub(_shown, text)

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj, target in self.references:
            if obj.package is pkg and not resolves(obj, target, pkg):
                griffe.logger.warning(
                    f"{obj.relative_filepath}:{obj.lineno}: {obj.path} refers to {target!r}, "
                    "which is no object of the package"
                )
        self.references = []


def resolves(obj: griffe.Object, target: str, pkg: griffe.Module) -> bool:
    """Whether ``target``, as written in ``obj``'s docstring, names an object (see
    :class:`DocstringConventions`)."""
    first, *rest = target.lstrip(".").split(".")  # .name: from this module outward, as Sphinx looks
    scopes = [scope for scope in _outward(obj)] + [None]
    for scope in scopes:
        if scope is None:  # from the root: nopelens.x.y, or another package's name
            if first != pkg.name:
                return bool(rest)
            found, rest_path = pkg, rest
        elif first in scope.members:
            found, rest_path = scope.members[first], rest
        else:
            continue
        try:
            for name in rest_path:
                found = _target(found, pkg.name).members[name]
            _target(found, pkg.name)  # an import from the package must resolve too
            return True
        except _External:
            return True
        except (KeyError, AttributeError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return False
    return False


def _outward(obj: griffe.Object):
    while obj is not None:
        yield obj
        obj = obj.parent


def _target(obj, package: str):
    """An alias's final target (an import from the package), else the object; AttributeError for
    an import from another package (``json``, ``torch``), whose members are not checked."""
    if isinstance(obj, griffe.Alias):
        if obj.target_path.split(".")[0] != package:
            raise _External
        return obj.final_target
    return obj


class _External(AttributeError):
    """A name imported from another package: not checked."""
