"""``nopelens extreme-tokens MODEL``: what Guo et al. 2024 measure on the Bigram-Backcopy task.

On a model trained on :class:`~nopelens.models.tasks.BigramBackcopyTask` (the zoo's ``bb-*``),
three tables (Guo et al. 2024, "Active-dormant attention heads", §2; the measurements are in
:mod:`nopelens.probes.extreme_tokens`):

- ``heads.csv``: per head, the attention on the first token (BOS) and on the previous token, for
  trigger and non-trigger queries, with CIs; a head is *dormant* on a class when its BOS mass is
  above Gu's 0.3 and *active* when most of its attention is on the previous token;
- ``norms.csv``: the first token's value norm (per head, ``hook_v``) and residual norm (per
  layer) over the other tokens' (value-state drain: ratio < 1; residual-state peak: ratio > 1);
- ``ablation.csv``: what the sink carries: the loss on trigger and non-trigger predictions (with
  the task's floor, the loss of the process itself), clean and with the first token removed from
  the keys of one block (``remove_key``) or its value replaced by the mean value (``mean_value``),
  the sink ablations of ``nopelens intervene``; plus the back-copy accuracy after triggers.

On a model of another task every query is one class (``all``) and the ablation reports the loss.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from nopelens.models.compat import moved_names
from nopelens.models.hf import family_of
from nopelens.models.hooks import act_name, act_names
from nopelens.models.tasks import Batch
from nopelens.probes import resid_sites
from nopelens.probes.extreme_tokens import ActiveDormantStats, FirstTokenNorms
from nopelens.probes.stream import Sequences, run

from . import intervene as iv
from .subjects import Subject


def query_classes(subject: Subject) -> tuple[torch.Tensor, dict[str, bool]]:
    """``(flags [batch, pos], classes)``: True where the query token is a trigger (BB task), with the
    class names; a task without triggers gives all False and one class, ``all``."""
    if subject.task is not None and hasattr(subject.task, "is_trigger"):
        return subject.task.is_trigger(subject.tokens), {"trigger": True, "non_trigger": False}
    return torch.zeros_like(subject.tokens, dtype=torch.bool), {"all": False}


def per_position_loss(model, subject: Subject, hooks: iv.HookList = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(nats ``[batch, pos]``, right ``[batch, pos]``) of every prediction under ``hooks`` (0 /
    False where not scored)."""
    with torch.no_grad(), iv.intervention(model, list(hooks)):
        logits = model(subject.tokens, attention_mask=subject.attention_mask).float()
    nats = F.cross_entropy(logits.transpose(1, 2), subject.targets, reduction="none") * subject.loss_mask
    right = (logits.argmax(-1) == subject.targets) & subject.loss_mask
    return nats, right


def ablation_table(subject: Subject, modes: tuple[str, ...] = iv.SINK_MODES) -> pd.DataFrame:
    """Loss and accuracy per query class: clean, with the task's floor, and under each sink ablation per block.

    Returns:
        Rows ``condition`` (``clean``, ``floor`` or a mode of :data:`~nopelens.analyses.intervene.SINK_MODES`),
        ``ablated_block`` (NaN for clean and floor), ``query_class``, ``n``, ``loss`` (nats per
        prediction) and ``accuracy`` (argmax right), ``status`` and ``note`` (``not_applicable``
        when the ablation cannot be checked to act on this model).
    """
    if subject.targets is None:
        return pd.DataFrame(
            [
                dict(
                    condition="clean",
                    status="not_applicable",
                    note=f"{subject.name} has no task targets: no loss to measure",
                )
            ]
        )
    flags, classes = query_classes(subject)
    model, scored = subject.model, subject.loss_mask

    def rows_of(condition: str, block, nats, right) -> list[dict]:
        out = []
        for name, flag in classes.items():
            cls = scored & (flags == flag)
            if cls.any():
                out.append(
                    dict(
                        condition=condition,
                        ablated_block=block,
                        query_class=name,
                        n=int(cls.sum()),
                        loss=float(nats[cls].double().mean()),
                        accuracy=float(right[cls].float().mean()) if right is not None else np.nan,
                        status="measured",
                        note="",
                    )
                )
        return out

    rows = rows_of("clean", np.nan, *per_position_loss(model, subject))
    if hasattr(subject.task, "oracle_nats"):
        batch = Batch(subject.tokens, scored, subject.attention_mask, subject.targets)
        rows += rows_of("floor", np.nan, subject.task.oracle_nats(batch), None)
    first = iv.first_real_index(subject.attention_mask)
    means = (
        iv.mean_values(model, subject.tokens, subject.attention_mask, range(subject.n_layers))
        if "mean_value" in modes
        else {}
    )
    for mode in modes:
        for block in range(subject.n_layers):
            try:
                iv.check_sink_ablation(model, block, mode, subject.tokens, subject.attention_mask, means.get(block))
            except iv.NotApplicable as reason:
                rows.append(dict(condition=mode, ablated_block=block, status="not_applicable", note=str(reason)))
                continue
            hooks = iv.sink_hooks(block, mode, first, means.get(block))
            rows += rows_of(mode, block, *per_position_loss(model, subject, hooks))
    return pd.DataFrame(rows)


def values_head_first(subject: Subject) -> bool:
    """``hook_v`` is ``[batch, head_index, pos, d_head]``, not ``[batch, pos, head_index, d_head]``:
    TransformerLens' bridge hands an MLA attention's values so (DeepSeek-V3: each head's value is
    decompressed from the shared latent by ``kv_b_proj``, so its norm per head is well defined)."""
    return subject.hf is not None and subject.hf.adapter == "TransformerBridge" and family_of(subject.hf.family).mla


def unread_blocks(subject: Subject, hook: str) -> dict[int, str]:
    """Block -> why its ``blocks.{l}.attn.hook_{hook}`` is not read: the block has no attention
    (:meth:`~nopelens.analyses.subjects.Subject.attentionless_blocks`, e.g. ``ssm (no attention)``)
    or the model has no such hook point there (no value projection to hook)."""
    absent = subject.attentionless_blocks()
    return {
        l: absent.get(l, f"no hook point {site}")
        for l, site in enumerate(act_names(hook, subject.n_layers))
        if l in absent or not subject.usable(site)
    }


def measure(subject: Subject, n_boot: int = 200, seed: int = 0) -> dict[str, pd.DataFrame]:
    """The three tables of the module docstring for one subject; each holds a ``status`` column:
    ``not_applicable`` rows name the blocks a read skips and why (:func:`unread_blocks`)."""
    layers = subject.n_layers
    sequences = Sequences.of(subject.tokens, subject.attention_mask)
    flags, classes = query_classes(subject)
    real = subject.attention_mask.bool()
    per_sequence = [row[mask].numpy() for row, mask in zip(flags, real)]
    skipped = {hook: unread_blocks(subject, hook) for hook in ("pattern", "v")}
    patterns, values = (
        [act_name(hook, l) for l in range(layers) if l not in skipped[hook]] for hook in ("pattern", "v")
    )
    head_major = values if values_head_first(subject) else []
    # statistics summed batch by batch while the model runs (issue 38): no pattern outlives its batch
    norms = FirstTokenNorms(sequences, values + resid_sites(layers), head_major=head_major)
    if patterns:
        heads, norms = run(
            subject.model,
            sequences,
            [ActiveDormantStats(sequences, patterns, per_sequence, classes, n_boot, seed), norms],
            batch_size=32,
        )
    else:
        heads, norms = pd.DataFrame(), run(subject.model, sequences, [norms], batch_size=32)[0]
    tables = {
        "heads": with_unread(heads, skipped["pattern"], "pattern"),
        "norms": with_unread(norms, skipped["v"], "v"),
        "ablation": ablation_table(subject),
    }
    return {name: table.assign(model=subject.name) for name, table in tables.items()}


def with_unread(table: pd.DataFrame, unread: dict[int, str], hook: str) -> pd.DataFrame:
    """``table`` (status ``measured``) with a ``not_applicable`` row per unread block, its ``note`` saying why."""
    rows = pd.DataFrame(
        [dict(site=act_name(hook, l), block=l, status="not_applicable", note=why) for l, why in unread.items()]
    )
    measured = table.assign(status="measured", note=table["note"] if "note" in table else "")
    return pd.concat([measured, rows], ignore_index=True) if len(rows) else measured


__getattr__ = moved_names(__name__, moved={"format_report": "nopelens.analyses.cli.extreme_tokens"})
