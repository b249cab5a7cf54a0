"""Experiments a user runs, by role.

- the analyses, which return (and write) tables: :mod:`.sweep` (the main job; its settings in
  :mod:`.settings`, the sites it reads in :mod:`.sites`, its summary in :mod:`.summary`, the streamed
  run of an ``hf:DIR`` model in :mod:`.streamed` and its plan in :mod:`.plan`), :mod:`.intervene`
  (causal tests), :mod:`.dynamics`, :mod:`.extreme_tokens`, :mod:`.lengthgen`, :mod:`.validate`
  (the known-answer suite), :mod:`.circuit_checks` (the hand-built circuits' checks and figures),
  :mod:`.audit` (seed 002's ten-step audit);
- :mod:`.subjects`: model specs -> a hooked model and its evaluation batch;
- :mod:`.reads`: what the sweep reads, one :class:`~.reads.SweepRead` per summary column and figure panel;
- :mod:`.layers`: the main curves per layer (``layers.csv``) and :func:`~.layers.load_run`, which
  reads a run folder back (``from nopelens.analyses import load_run``);
- :mod:`.runs`: run folders (one claim rule, one slug, part folders, atomic writes);
- rendering, which the CLI calls and no analysis imports: :mod:`.report` (summary tables, Markdown, a
  sweep's run-folder figures and ``summary.md``) and :mod:`.figures` (the drawings);
  :mod:`.seeds`: numbers over training seeds;
  :mod:`.parallel`: local worker processes and Dask;
- :mod:`.cli`: the ``nopelens`` command, thin over the rest; nothing here imports it.
"""


def __getattr__(name: str):
    """``load_run`` and ``layer_curves`` on first use (importing them eagerly would slow every command's start-up)."""
    if name in ("load_run", "layer_curves"):
        from . import layers  # lazy: `nopelens --help` imports no pandas

        return getattr(layers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
