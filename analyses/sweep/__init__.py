"""The sweep: at which layer each model's absolute index and relative distance become linearly
recoverable, and where its attention sinks are (``nopelens sweep`` and ``nopelens probe``).

- :mod:`.driver`: the one driver, :func:`~.driver.sweep` over (model, seed) tasks and
  :func:`~.driver.analyse_subject` per model; its names import from this package
  (``from nopelens.analyses.sweep import SweepSettings, sweep``);
- :mod:`.settings`: what a sweep measures; :mod:`.sites`: where it reads; :mod:`.reads`: one
  :class:`~.reads.SweepRead` per summary column and figure panel, one target function per target;
- :mod:`.streamed`: every model's measurements through the streaming engine; :mod:`.budget`: the
  memory it holds (keep budget, statistics groups, batch size); :mod:`.plan`: an
  ``hf:DIR`` probe's forward passes, memory and ETA before it runs; :mod:`.eta`: the sweep's ETA;
- :mod:`.summary`, :mod:`.layers` (the curves per layer, :func:`~.layers.load_run`),
  :mod:`.seeds` (numbers over training seeds): what the run folder reports;
- :mod:`.parallel`: local worker processes and Dask.

Nothing is imported until asked for, so importing one module (``reads``, ``eta``) does not load
the driver and everything it imports.
"""

import importlib

SUBMODULES = (
    "budget",
    "driver",
    "eta",
    "layers",
    "parallel",
    "plan",
    "reads",
    "seeds",
    "settings",
    "sites",
    "streamed",
    "summary",
)


def __getattr__(name: str):
    """A submodule by its name; any other name from :mod:`.driver` (PEP 562, lazily)."""
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(f"{__name__}.driver"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
