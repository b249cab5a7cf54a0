"""The one palette of every nopelens figure: a fixed colour per position method, a line style per
role (trained model, or which control), so a method looks the same in every figure of every run.

A model's colour is keyed by what it is, its position method(s) as its run records them
(``position`` in ``done.json``: ``nope``, ``rope+nope`` for a hybrid decoder, ``rope,rope,nope`` for
an HF model's layers), never by the order models come in. A hybrid (several methods) gets a colour
of its own, fixed by its set of methods. The line style says the model's role (``kind`` in
``done.json``): solid for a trained or external model, dashed for the hand-built circuit (positive
control), dotted for an untrained model and dash-dot for a model read on constant input (negative
controls, :mod:`nopelens.analyses.subjects`). Models of one method and role differ by marker.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Mapping

from nopelens.models.methods import METHODS

METHOD_COLORS = {
    "nope": "#CC6677",  # rose
    "rope": "#332288",  # indigo
    "alibi": "#117733",  # green
    "shaw": "#AA4499",  # purple
    "t5": "#44AA99",  # teal
    "learned": "#DDCC77",  # sand
    "sinusoidal": "#88CCEE",  # cyan
}
"""Position method -> its colour: Paul Tol's "muted" qualitative scheme, distinct for the common
colour-vision deficiencies (https://personal.sron.nl/~pault/). Every registered method has one
(``tests/test_figures.py`` checks it)."""

HYBRID_COLORS = ("#882255", "#999933")
"""The colours of hybrids (wine, olive; Tol muted): a hybrid's set of methods picks one, the same in
every run (``nope+rope`` is always olive)."""

UNKNOWN_COLOR = "#777777"
"""A model whose position method is not recorded or not one nopelens knows."""

ROLE_LINESTYLES = {"trained": "-", "external": "-", "circuit": "--", "untrained": ":", "constant": "-."}
"""Subject kind -> line style: controls are drawn in their own style."""

ROLE_NAMES = {
    "circuit": "positive control",
    "untrained": "negative control, untrained",
    "constant": "negative control, constant input",
}
"""How a legend names a control's role."""

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<")


@dataclasses.dataclass(frozen=True)
class Style:
    """How one model is drawn in every figure: colour (its method), line style (its role), marker,
    and what it is (``description``: method and role, empty when unknown)."""

    color: str
    marker: str
    linestyle: str = "-"
    description: str = ""

    def label(self, model: str) -> str:
        """The legend's entry of ``model``: its name, then its method and role."""
        return f"{model} ({self.description})" if self.description else model


def methods_of(position: str | None) -> tuple[str, ...]:
    """The distinct position methods of a recorded ``position`` string, sorted.

    >>> methods_of("rope+nope"), methods_of("rope,rope,nope"), methods_of("alibi"), methods_of(None)
    (('nope', 'rope'), ('nope', 'rope'), ('alibi',), ())
    """
    return tuple(sorted({part for part in re.split(r"[+,]", position or "") if part}))


def method_color(position: str | None) -> str:
    """The colour of a model whose position method(s) ``position`` records: one method's fixed
    colour, a hybrid's (fixed by its set of methods), or grey for an unknown one.

    >>> method_color("nope"), method_color("rope+nope") == method_color("nope,rope,rope")
    ('#CC6677', True)
    """
    methods = methods_of(position)
    if not methods or any(method not in METHOD_COLORS for method in methods):
        return UNKNOWN_COLOR
    if len(methods) == 1:
        return METHOD_COLORS[methods[0]]
    return HYBRID_COLORS[zlib.crc32("+".join(methods).encode()) % len(HYBRID_COLORS)]


def method_label(position: str | None) -> str:
    """A legend's name of ``position``: ``NoPE``, ``hybrid NoPE+RoPE``, or the string itself when unknown."""
    methods = methods_of(position)
    if not methods or any(method not in METHODS for method in methods):
        return position or "method unknown"
    labels = "+".join(METHODS[method].label for method in methods)
    return f"hybrid {labels}" if len(methods) > 1 else labels


def model_styles(models, subjects: Mapping[str, Mapping] | None = None) -> dict[str, Style]:
    """A style per model of ``models``, from what ``subjects`` records of each (``position`` and
    ``kind``, keyed by model name or by run label with ``name`` inside, as
    :attr:`SweepResult.subjects <nopelens.analyses.sweep.driver.SweepResult>` holds them). A model ``subjects``
    does not describe is grey and solid. Markers tell apart the models that share a colour and a
    line style, in the order of their names.

    >>> styles = model_styles(["b", "a", "c"], {"a": {"position": "nope", "kind": "trained"},
    ...                                         "b": {"position": "nope", "kind": "circuit"},
    ...                                         "c": {"position": "nope", "kind": "trained"}})
    >>> styles["a"].color == styles["b"].color, styles["b"].linestyle, styles["a"].marker, styles["c"].marker
    (True, '--', 'o', 's')
    """
    records = _records(subjects or {})
    styles, taken = {}, {}
    for model in sorted(dict.fromkeys(models)):
        record = records.get(model, {})
        position, kind = record.get("position"), record.get("kind", "trained")
        color, linestyle = method_color(position), ROLE_LINESTYLES.get(kind, "-")
        index = taken[color, linestyle] = taken.get((color, linestyle), -1) + 1
        role = ROLE_NAMES.get(kind)
        description = f"{method_label(position)}{f'; {role}' if role else ''}" if record else ""
        styles[model] = Style(color, MARKERS[index % len(MARKERS)], linestyle, description)
    return {model: styles[model] for model in dict.fromkeys(models)}


def _records(subjects: Mapping[str, Mapping]) -> dict[str, Mapping]:
    """Model name -> its record (the first one, for a model measured at several training seeds)."""
    records: dict[str, Mapping] = {}
    for key, record in subjects.items():
        records.setdefault(record.get("name", key), record)
    return records


LINESTYLE_KEY = "line: solid trained, dashed circuit (positive control), dotted untrained, dash-dot constant input"
"""What the line styles mean, for a figure's subtitle."""
