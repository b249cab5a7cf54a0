"""Learned sink logits read from an HF model's weights, no forward pass needed: each logit s_h is
one more key with a zero value in every row of head h's softmax (GPT-OSS, Flint, MiMo-V2-Flash's
sliding layers). Their mass on real patterns is :func:`~nopelens.probes.sinks.sink_table`'s
``learned_sink_mass``."""

from __future__ import annotations

import re

import pandas as pd

from nopelens.models.hf import sink_parameters

LEARNED_SINK_COLUMNS = ["block", "head", "sink_logit", "parameter"]


def learned_sink_logits(source) -> pd.DataFrame:
    """The learned sink logits of an HF model, per block and head, from its weights (no forward pass).

    Readable even where the attention weights are not (DeepSeek V4's compressed attention): each
    logit s_h is a key with a zero value in every row's softmax, so against keys of scores a_j it
    takes exp(s_h) / (exp(s_h) + sum_j exp(a_j)) of the row (``eager_attention_forward`` of
    ``gpt_oss/modeling_gpt_oss.py``); that mass needs the scores, the logit alone does not.

    Args:
        source: an HF ``PreTrainedModel`` (or a bridge's ``original_model``), or what
            :func:`nopelens.models.hf.sink_parameters` read from one (a refusal keeps it as
            ``sink_parameters``).

    Returns:
        One row per (block, head): ``block``, ``head``, ``sink_logit`` (float64) and ``parameter``
        (the weight's name, e.g. ``model.layers.0.self_attn.sinks``); empty (same columns) when the
        model has no ``sinks`` parameter (:func:`nopelens.models.hf.sink_parameters`).
    """
    parameters = source if isinstance(source, dict) else sink_parameters(source)
    rows = [
        (block, head, float(logit), name)
        for block, (name, logits) in parameters.items()
        for head, logit in enumerate(logits.tolist())
    ]
    return pd.DataFrame(rows, columns=LEARNED_SINK_COLUMNS)


def learned_sink_line(table: pd.DataFrame) -> str | None:
    """One line naming a :func:`learned_sink_logits` table's parameters and summarising its logits
    (their mean and range over blocks and heads), or None when it is empty.

    Example:
        >>> t = pd.DataFrame({"block": [0, 0, 2, 2], "head": [0, 1, 0, 1], "sink_logit": [0.5, -1.0, 2.0, 0.0],
        ...                   "parameter": ["model.layers.0.self_attn.sinks"] * 2
        ...                                + ["model.layers.2.self_attn.sinks"] * 2})
        >>> learned_sink_line(t)
        'learned sink logits, from the weights (model.layers.{l}.self_attn.sinks, 2 blocks x 2 heads): mean 0.375, range -1 to 2'
    """
    if table.empty:
        return None
    names = sorted({re.sub(r"layers\.\d+\.", "layers.{l}.", name) for name in table["parameter"]})
    logits = table["sink_logit"]
    return (
        f"learned sink logits, from the weights ({', '.join(names)}, {table['block'].nunique()} blocks x "
        f"{table['head'].nunique()} heads): mean {logits.mean():.3g}, range {logits.min():.3g} to {logits.max():.3g}"
    )
