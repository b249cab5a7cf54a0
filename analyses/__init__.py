"""Experiments a user runs, by role.

- the analyses, which return (and write) tables: :mod:`.sweep` (the main job, one subpackage: its
  driver, settings, sites, reads, streamed measurements, plan, ETA, summary, curves per layer,
  numbers over seeds and workers), :mod:`.intervene` (causal tests), :mod:`.dynamics`,
  :mod:`.extreme_tokens`, :mod:`.lengthgen`, :mod:`.validate` (the known-answer suite),
  :mod:`.circuit_checks` (the hand-built circuits' checks and figures), :mod:`.audit` (seed 002's
  ten-step audit);
- :mod:`.subjects`: model specs -> a hooked model and its evaluation batch;
- :func:`~.sweep.layers.load_run` reads a sweep's run folder back
  (``from nopelens.analyses import load_run``);
- :mod:`.runs`: run folders (one claim rule, one slug, part folders, atomic writes);
- rendering, which the CLI calls and no analysis imports: :mod:`.report` (summary tables, Markdown, a
  sweep's run-folder figures and ``summary.md``) and :mod:`.figures` (the drawings);
- :mod:`.cli`: the ``nopelens`` command, thin over the rest; nothing here imports it.

The sweep's modules lived here before issue 49 (``nopelens.analyses.reads`` and the rest): their
old names still import, with a one-line ``DeprecationWarning`` naming the new home.
"""

import importlib.abc
import sys

SWEEP_MODULES = ("eta", "layers", "parallel", "plan", "reads", "seeds", "settings", "sites", "streamed", "summary")
"""The modules that moved into :mod:`.sweep` (issue 49)."""


class _MovedSweepModules(importlib.abc.MetaPathFinder):
    """``import nopelens.analyses.reads`` (or another of :data:`SWEEP_MODULES`) gives the module in
    :mod:`.sweep`, with a one-line deprecation (:func:`nopelens.models.compat.moved_module_spec`,
    imported only then: ``nopelens --help`` imports neither torch nor pandas)."""

    def find_spec(self, fullname, path=None, target=None):
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in SWEEP_MODULES:
            return None
        return _compat().moved_module_spec(fullname, f"{__name__}.sweep.{name}")


sys.meta_path.append(_MovedSweepModules())


def _compat():
    """:mod:`nopelens.models.compat`, when an old name is first asked for."""
    import nopelens.models.compat  # lazy: it imports nopelens.models (torch); `nopelens --help` imports neither

    return nopelens.models.compat


def __getattr__(name: str):
    """``load_run`` and ``layer_curves`` on first use (importing them eagerly would slow every command's
    start-up); a module that moved into :mod:`.sweep`, with a one-line deprecation."""
    if name in ("load_run", "layer_curves"):
        from .sweep import layers  # lazy: `nopelens --help` imports no pandas

        return getattr(layers, name)
    module = _compat().moved_names(__name__, moved={name: f"{__name__}.sweep" for name in SWEEP_MODULES})(name)
    globals()[name] = module  # warned once (``from nopelens.analyses import reads`` asks twice)
    return module
