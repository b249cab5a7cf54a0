"""From a hooked model to numbers: activation collection, position targets, grouped linear probes
with controls, and attention-sink and attention-variance measurements."""

from .collect import (
    Activations,
    BatchHooks,
    HookList,
    collect,
    hooks_added,
    hooks_for_batch,
    is_pattern_site,
    resid_site,
    resid_sites,
    site_block,
    site_layer,
)
from .learned_sinks import learned_sink_logits
from .linear import (
    RESULT_COLUMNS,
    PooledLDA,
    extrapolation_splits,
    first_recoverable_layer,
    make_probe,
    out_of_fold_predictions,
    probe_features,
    sequence_splits,
)
from .metrics import bootstrap_scores, mad_chance, mad_chance_of, score
from .mlp_probe import MLPPositionProbe, no_information_floor, probe_positions_mlp
from .sink_patterns import sink_mass, sink_mass_by_position, sink_scores, strip_padding
from .sinks import compare_bos, sink_rate, sink_table
from .stream_probes import probe_absolute_index, probe_relative_distance
from .targets import (
    DistancePairs,
    bilinear_features,
    control_labels,
    pair_features,
    sample_distance_pairs,
    score_features,
    shuffled_labels,
    token_identity_predictions,
)
from .variance import attention_variance, variance_shrinkage, variance_slopes

__all__ = [
    "MLPPositionProbe",
    "no_information_floor",
    "probe_positions_mlp",
    "Activations",
    "BatchHooks",
    "HookList",
    "hooks_added",
    "hooks_for_batch",
    "DistancePairs",
    "PooledLDA",
    "RESULT_COLUMNS",
    "attention_variance",
    "compare_bos",
    "learned_sink_logits",
    "sink_mass",
    "sink_mass_by_position",
    "sink_rate",
    "sink_scores",
    "sink_table",
    "strip_padding",
    "variance_shrinkage",
    "variance_slopes",
    "bilinear_features",
    "bootstrap_scores",
    "collect",
    "control_labels",
    "extrapolation_splits",
    "first_recoverable_layer",
    "is_pattern_site",
    "mad_chance",
    "mad_chance_of",
    "make_probe",
    "out_of_fold_predictions",
    "pair_features",
    "probe_absolute_index",
    "probe_features",
    "probe_relative_distance",
    "resid_site",
    "resid_sites",
    "sample_distance_pairs",
    "score",
    "score_features",
    "sequence_splits",
    "shuffled_labels",
    "site_block",
    "site_layer",
    "token_identity_predictions",
]
