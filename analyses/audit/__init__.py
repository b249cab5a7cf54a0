"""The ten-step position audit of seed ``002_c993a97fc3f160f5.txt``, run on a model.

Seed 002 ends with an audit order for a position bug that keeps every tensor shape. :func:`audit`
runs it on a nopelens :class:`~nopelens.models.Decoder` (any position method, per-layer hybrids
included), on an HF causal LM through TransformerLens' ``TransformerBridge``
(:func:`nopelens.models.adapters.bridge_hf_model`), or on any module hooked with no declaration
(:mod:`.hooked`), and says step by step what it verified, with
the evidence: each step is ``pass``, ``fail`` or ``not_applicable`` (with the reason).

1. token ids, padding, special tokens and the position ids the model used, incl. a left-padded row
2. index origin (first real token at 0) and the signed-offset convention of each method
3. masks are separate from finite score biases (blocked -> exactly 0, allowed -> > 0)
4. absolute additions: ``hook_pos_embed`` equals the table rows at the position ids
5. the per-layer detector (each layer's input held fixed, positions re-spaced and shifted:
   declared against measured, :mod:`.detector`), Q/K rotations (``hook_rot_q = R(p) hook_q``,
   rotated fraction, pairing, offset-only dot products) and Shaw relation lookups
6. content scores and position contributions, recorded separately, add up to the scores
7. softmax over the key axis, unmasked rows sum to 1, blocked entries exactly 0
8. interventions (zeroed, shifted, swapped positions) against each method's expected effect
9. cached (incremental) vs uncached decoding: position assignments and logits
10. training vs evaluation lengths, with the seed's warning that a computable index is not
    demonstrated generalization

Masks are per layer (a sliding window or chunk, :class:`nopelens.models.masks.KeyWindow`), and
tolerances follow the model's compute dtype (:meth:`Tolerance.for_dtype`).

Conventions are those of ``DESIGN.md``: query i, key j, positions from 0, relative distance
i - j >= 0, ALiBi bias -m_h (i - j), Shaw offset clip(j - i), RoPE dot products depending on the
offset (seed 002: (R(m theta) q)^T (R(n theta) k) = q^T R((n - m) theta) k).

Layout of this package (one concern per module):

- :mod:`.report` the report: checks, step results, Markdown / JSON / terminal summary
- :mod:`.subjects` what the audit needs of a model, and the nopelens ``Decoder`` as a subject
- :mod:`.hf` HF models as subjects: bridged by TransformerLens, or hooked with forward hooks
  where the bridge refuses (their family knowledge is in :mod:`nopelens.models.hf`)
- :mod:`.hooked` any module hooked with no declaration (``hook_any``, ``HookedModule``): the steps
  its recorded attention allows, the detector under re-spaced ids or a constant input, the rest
  not applicable with the reason
- :mod:`.detector` the per-layer NoPE detector (step 5)
- :mod:`.probe` the two-row probe batch and one run's records, reduced layer by layer as the pass goes
- :mod:`.streaming` hooks that hold one layer's tensors at a time, and the bytes they hold
- :mod:`.numerics` tolerances, agreement checks, the reference rotation
- :mod:`.steps_positions` steps 1, 2, 4; :mod:`.steps_scores` steps 3, 6, 7;
  :mod:`.steps_lookups` step 5; :mod:`.steps_runtime` steps 8, 9, 10
- :mod:`.core` :func:`audit` and the ordered :data:`STEPS`

What a step expects of a layer comes from its position method object
(:mod:`nopelens.models.methods`): where it acts, whether it is absolute, how its bias is
recomputed (``bias_kind``), its declared offsets and reference formulas. No step branches on a
method's name.
"""

from .core import STEPS, audit
from .numerics import Tolerance, rotate
from .report import STATUSES, STEP_TITLES, AuditReport, Check, StepResult

_rotate = rotate  # the reference rotation, R(+p theta) or R(-p theta), under its former name

__all__ = ["STATUSES", "STEPS", "STEP_TITLES", "AuditReport", "Check", "StepResult", "Tolerance", "audit", "rotate"]
