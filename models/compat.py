"""Names that moved or went in the reorganisation of issue 39 keep answering: an old import still
works and warns once, in one line, where the name lives now; a name that went raises an
``AttributeError`` that says what to use instead.

A module opts in with ``__getattr__ = moved_names(__name__, moved={...}, gone={...})`` (PEP 562).
The new home is imported when the old name is first asked for, not before, so a module may point
at one that imports it (``streamed`` -> ``plan``) without an import loop.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import warnings
from typing import Any, Callable, Mapping


def moved_names(
    module: str, moved: Mapping[str, str] | None = None, gone: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for names that left ``module``.

    Args:
        module: the old module's ``__name__``.
        moved: old name -> the module that now defines it (same name).
        gone: old name -> what to use instead (a sentence).

    Returns:
        ``__getattr__(name)``: the moved object, after a one-line ``DeprecationWarning``.

    Raises:
        AttributeError: (from the returned function) for a name that went, with what to use
            instead, or for a name the module never had.

    >>> getattr_ = moved_names("old", moved={"sqrt": "math"}, gone={"cube": "use x ** 3"})
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     getattr_("sqrt")(4.0), str(caught[0].message)
    (2.0, 'old.sqrt moved to math.sqrt; import it from there')
    >>> getattr_("cube")
    Traceback (most recent call last):
    AttributeError: old.cube is gone: use x ** 3
    """
    moved, gone = dict(moved or {}), dict(gone or {})

    def __getattr__(name: str) -> Any:
        if name in moved:
            warnings.warn(
                f"{module}.{name} moved to {moved[name]}.{name}; import it from there", DeprecationWarning, stacklevel=2
            )
            return getattr(importlib.import_module(moved[name]), name)
        if name in gone:
            raise AttributeError(f"{module}.{name} is gone: {gone[name]}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


class _MovedModule(importlib.abc.Loader):
    """Loads an old module name as the module that now lives elsewhere (already executed there)."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        """The new module is already executed."""


def moved_module_spec(old: str, new: str) -> importlib.machinery.ModuleSpec:
    """The spec a :data:`sys.meta_path` finder returns for module ``old`` that moved to ``new``:
    importing ``old`` gives the module ``new``, after a one-line ``DeprecationWarning`` naming it.

    >>> import sys
    >>> class Finder:
    ...     def find_spec(self, fullname, path=None, target=None):
    ...         return moved_module_spec(fullname, "json") if fullname == "old_json_home" else None
    >>> sys.meta_path.append(Finder())
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     import old_json_home
    ...     old_json_home.dumps([1]), str(caught[0].message)
    ('[1]', 'old_json_home moved to json; import it from there')
    """
    warnings.warn(f"{old} moved to {new}; import it from there", DeprecationWarning, stacklevel=3)
    return importlib.machinery.ModuleSpec(old, _MovedModule(new))
