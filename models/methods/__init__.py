"""Position methods, one module each, and the registry that maps config names to them.

Every method is a :class:`~nopelens.models.methods.base.PositionMethod`: it declares where it acts
(input embedding, q/k rotation, score bias, value term), its config fields and parameters, computes
its part from position ids with the pure formulas of :mod:`nopelens.models.positions`, and states
what an audit may expect of it (absolute or relative, sign and offset convention). The decoder,
the audit and the sweep ask these objects; nothing outside this package branches on a method's
name.

How to add a method (e.g. ``foo``):

1. ``models/methods/foo.py``: a ``PositionMethod`` subclass with ``name = "foo"``, ``label``,
   ``acts_on``, ``absolute``, ``convention``, ``config_fields``, and the hooks of the places it acts
   on (``add_parameters`` + ``score_bias`` for a score bias, ``rotate`` for a q/k rotation,
   ``add_input_parameters`` + ``input_vectors`` for an input method, ``value_term``).
   Its formula, if new, goes into ``models/positions.py`` as a pure function with a doctest.
2. One line in :data:`METHODS` below.
3. New config fields, if any: declare them in ``DecoderConfig`` (``models/config.py``) and add
   them to its ``_WRITTEN_WHEN_SET`` (so older configs keep their JSON and zoo digests); validate
   them in the method's ``validate_config``.
4. Tests: ``tests/test_method_foo.py`` (the formula against a reference implementation, hooks,
   fused path, KV cache, left padding, checkpoint, ``nopelens train``; ``tests/test_method_t5.py``
   is the template) and ``tests/test_audit_foo.py`` (the audit passes every applicable step, a
   shape-preserving bug fails one; see ``tests/test_audit_t5.py``). ``tests/test_decoder.py``
   runs every registered method automatically.

What the audit (``nopelens.analyses.audit``) reads of a method: ``acts_on`` (which steps apply),
``absolute`` (step 8's shift), ``bias_kind``: ``linear`` (``reference_slopes``, ``reference_bias``)
or ``lookup`` (a :class:`~nopelens.models.methods.base.LookupBias`: ``relative_ids``,
``reference_bias``, the declared and mirrored offsets), ``reference_vectors`` of input methods, and
``describe`` (the report's model entries). Optional: a zoo recipe (``COPY_METHODS`` in
``models/zoo.py``) and a ``nopelens lengthgen`` row (``VARIANTS`` in ``analyses/kazemnejad.py``).
"""

from __future__ import annotations

from .alibi import ALiBi
from .base import INPUT, PLACES, QK_ROTATION, SCORE_BIAS, VALUE, PositionMethod
from .learned import Learned
from .nope import NoPE
from .rope import RoPE
from .shaw import Shaw
from .sinusoidal import Sinusoidal
from .t5 import T5

METHODS: dict[str, type[PositionMethod]] = {cls.name: cls for cls in (NoPE, RoPE, ALiBi, Shaw, T5, Learned, Sinusoidal)}
"""Registry: config name -> method class. Attention methods first, then input methods."""


def get_method(name: str) -> PositionMethod:
    """The method object of a config name.

    Raises:
        ValueError: on an unknown name, listing the known ones.
    """
    try:
        return METHODS[name]()
    except (KeyError, TypeError):
        raise ValueError(f"unknown position method {name!r}; known: {tuple(METHODS)}") from None


def method_names(per_layer: bool | None = None) -> tuple[str, ...]:
    """Registered names; ``per_layer=True`` only attention methods, ``False`` only input methods."""
    return tuple(n for n, cls in METHODS.items() if per_layer is None or cls().per_layer == per_layer)


__all__ = [
    "INPUT",
    "METHODS",
    "PLACES",
    "QK_ROTATION",
    "SCORE_BIAS",
    "VALUE",
    "PositionMethod",
    "get_method",
    "method_names",
]
