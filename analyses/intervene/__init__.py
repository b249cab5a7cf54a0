"""Causal tests of where a model's position comes from: sink ablation, position directions, patching.

A probe shows that the absolute index is *readable*; these interventions ask whether it is *made*
by the attention sink and whether the model *uses* it (issue 14). Kazemnejad et al. 2023
(NeurIPS), App. C, Theorem 1, and seed ``004_150f630256efbd1c.txt``: a head that spreads its
attention over the i + 1 visible keys writes 1/(i + 1) of the first token's value, so in a NoPE
model the index should come from the first token.

Three interventions, each a set of TransformerLens hooks added for the forward passes of one
measurement and removed afterwards, also when a pass raises (``model.hooks(...)``, the context
manager of ``HookedRootModule`` and ``TransformerBridge`` alike). Hooks that index rows (the first
real token of each row, a per-row patched state) are made per batch
(:data:`~nopelens.probes.collect.BatchHooks`, :func:`sink_batch_hooks`), so each batch of a
batched pass gets its own rows' indices; a hook handed a batch of another size refuses it.

- **Sink ablation** (:func:`sink_ablation`). In block l, the first real token is removed from the
  keys of every later query: ``hook_attn_scores`` gets -inf at (query > first, key = first), so
  the softmax renormalizes over the other keys; the query at the first token keeps its only key.
  Or (``mean_value``) the first token's value (``hook_v``) is replaced by the mean value of the
  other real tokens of the evaluation batch, which keeps it in the denominator but makes it an
  ordinary token. Every later layer is then probed again (refitted probes: is the index still
  readable?), and the loss or exact match is measured.
- **Position directions** (:func:`direction_interventions`). The regression probe for the index
  at layer l, mapped back to the residual stream through its scaler, gives a direction w with
  prediction = (x - mean) . w + b. Project it out (x - ((x - mean) . w^) w^), or move every
  state by k w / |w|^2, so the probe reads i + k. Report what the next layers read and the loss.
- **Activation patching** (:func:`position_patching`). The residual stream at layer l, position
  i of a sequence is replaced by the same token's state in a left-shifted copy of the sequence
  (the token sits at i - s there); a regression probe at the last layer reads the index at i. The
  effect is normalized as TransformerLens' ``patching`` module normalizes it (``PatchingResult.normalized``):
  (patched - corrupted) / (clean - corrupted), with the original sequence as the "corrupted"
  run and the shifted copy as the "clean" source, so 1 means all of the index moved with the
  patched state and 0 means the later layers recomputed it from the context.

Probed samples are the tokens after the first real one (position >= 1): the first token is never
touched by a sink ablation, and as the only BOS it would be identified by its content alone.

The modules, one per concern: :mod:`.hooks` (the hooks and :func:`intervention`), :mod:`.measure`
(re-probing and behaviour, shared by all three), :mod:`.sink`, :mod:`.directions`, :mod:`.patching`,
and :mod:`.run` (``nopelens intervene``'s run folder). Every name is importable from here too.
Nothing here draws: :mod:`nopelens.analyses.report` renders the tables (the CLI calls it).
"""

from nopelens.probes import HookList

from .directions import IndexDirection, clean_probe_reads, direction_interventions
from .hooks import (
    SINK_MODES,
    NotApplicable,
    SinkBatchHooks,
    first_real_index,
    intervention,
    patch_position_hook,
    project_out_hook,
    remove_first_key_hook,
    replace_first_value_hook,
    shift_hook,
    sink_batch_hooks,
    sink_hooks,
)
from .measure import ProbeSettings, behavior, behavior_change, later_tokens, reprobe, subset_sequences
from .patching import MIN_READ_SHIFT, position_patching, shifted_copy
from .run import InterveneSettings, run_intervene, sink_summary
from .sink import (
    CHECK_TOKENS,
    DROP_COLUMNS,
    PATTERN_TOLERANCE,
    PROBE_KEY,
    check_sink_ablation,
    first_real_tokens,
    later_token_probes,
    mean_values,
    refused_sink_blocks,
    sink_ablation,
    sink_ablation_drop,
    sink_ablation_drop_streamed,
    with_clean_values,
)

__all__ = [
    "CHECK_TOKENS",
    "DROP_COLUMNS",
    "MIN_READ_SHIFT",
    "PATTERN_TOLERANCE",
    "PROBE_KEY",
    "SINK_MODES",
    "HookList",
    "IndexDirection",
    "InterveneSettings",
    "NotApplicable",
    "ProbeSettings",
    "SinkBatchHooks",
    "behavior",
    "behavior_change",
    "check_sink_ablation",
    "clean_probe_reads",
    "direction_interventions",
    "first_real_index",
    "first_real_tokens",
    "intervention",
    "later_token_probes",
    "later_tokens",
    "mean_values",
    "patch_position_hook",
    "position_patching",
    "project_out_hook",
    "refused_sink_blocks",
    "remove_first_key_hook",
    "replace_first_value_hook",
    "reprobe",
    "run_intervene",
    "shift_hook",
    "shifted_copy",
    "sink_ablation",
    "sink_ablation_drop",
    "sink_ablation_drop_streamed",
    "sink_batch_hooks",
    "sink_hooks",
    "sink_summary",
    "subset_sequences",
    "with_clean_values",
]
