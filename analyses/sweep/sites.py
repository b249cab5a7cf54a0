"""Where the sweep reads a subject (:func:`sweep_sites`): its residual stream, each block's finer
sites, q and k for the content read, pre-softmax scores for the score read, attention patterns for
the sinks and attention outputs for the variance; the blocks and reads a model leaves out are
noted in ``subject.info["not_applicable"]`` with the reason.
"""

from __future__ import annotations

from nopelens.models.hooks import act_name, act_names
from nopelens.probes import resid_site
from nopelens.probes.collect import site_block

from ..subjects import Subject, qk_sites
from . import reads
from .reads import SweepSites
from .settings import DEFAULT_SITES


def sweep_sites(
    subject: Subject, kinds: tuple[str, ...] = DEFAULT_SITES, blocks: tuple[int, ...] | None = None
) -> SweepSites:
    """The sites the sweep collects of ``subject`` (those it has and that fire); ``kinds`` as
    :attr:`~nopelens.analyses.sweep.settings.SweepSettings.sites`, ``blocks`` as
    :attr:`~nopelens.analyses.sweep.settings.SweepSettings.layers` (None: every block; otherwise each
    block's sites and its input and output residual stream, and the blocks left out are recorded
    in ``subject.info["not_applicable"]``).

    Raises:
        ValueError: for a block the model does not have.
    """
    layers = subject.n_layers
    chosen = probed_blocks(subject, blocks)
    finer = [kind for kind in kinds if kind != "resid"]
    inner = [act_name(kind, l) for l in chosen for kind in finer]
    # the variance of the model's first attention block is read whatever --layers says: the summary's slope is its
    variance_blocks = sorted(set(chosen) | ({first_variance_block(subject)} - {None} if blocks is not None else set()))
    outputs = [site for site in act_names("attn_out", variance_blocks) if subject.usable(site)]
    # a hybrid's linear-attention layers have no q, k or pattern, nor has a model hooked without the bridge
    pairs = {l: qk_sites(subject, l) for l in chosen}
    qk = [pair for pair in pairs.values() if pair is not None and all(subject.usable(s) for s in pair)]
    unrotated = _blocks_by_reason(
        {l: subject.hf.unrotated_qk(l) for l, pair in pairs.items() if pair is None}, "no rotated q and k to read"
    )
    if unrotated is not None:
        subject.info.setdefault("not_applicable", {})["content q·k read"] = unrotated
    sparse = subject.sparse_blocks()
    available = score_sites(subject.model, layers, subject.hf)
    scores, not_applicable = reads.readable_score_sites(
        available, subject.key_windows(), int(subject.attention_mask.sum(-1).max())
    )
    scores = [site for site in scores if site_block(site) not in sparse and site_block(site) in chosen]
    if sparse:
        not_applicable = "; ".join(filter(None, [not_applicable, subject.sparse_note()]))
    unscored = _unscored_note(
        subject, [l for l in chosen if l not in sparse and act_name("attn_scores", l) not in available]
    )
    not_applicable = "; ".join(filter(None, [unscored, not_applicable])) or None
    if not_applicable is not None:
        subject.info.setdefault("not_applicable", {})["score read"] = not_applicable
    residual = [resid_site(layer) for layer in sorted({l + step for l in chosen for step in (0, 1)})]
    patterns = [site for site in pattern_sites(subject) if site_block(site) in chosen]
    return SweepSites(
        residual=residual,
        inner=[site for site in inner if subject.usable(site)],
        outputs=outputs,
        qk=qk,
        scores=scores,
        patterns=patterns,
    )


def _unscored_note(subject: Subject, blocks: list[int]) -> str | None:
    """Why the score read leaves out softmax-attention ``blocks`` of an HF model that expose no
    pre-softmax scores (None: there are none; the reasons are the description's,
    :meth:`~nopelens.models.hf.HFDescription.scores_unreadable`)."""
    if subject.hf is None:
        return None
    return _blocks_by_reason(
        {
            l: subject.hf.scores_unreadable(act_name("attn_scores", l))
            for l in blocks
            if subject.hf.layers[l].mixer == "attention"
        },
        "no pre-softmax scores to read",
    )


def _blocks_by_reason(reasons: dict[int, str | None], what: str) -> str | None:
    """``{block: why}`` as one note, blocks grouped by reason (None where no block has one).

    >>> _blocks_by_reason({0: "a", 1: "a", 3: "b", 4: None}, "not read")
    'blocks 0-1: not read (a); blocks 3: not read (b)'
    """
    grouped: dict[str, list[int]] = {}
    for block, why in reasons.items():
        if why is not None:
            grouped.setdefault(why, []).append(block)
    return "; ".join(f"blocks {block_ranges(b)}: {what} ({why})" for why, b in grouped.items()) or None


def first_variance_block(subject: Subject) -> int | None:
    """The first of :meth:`~nopelens.analyses.subjects.Subject.variance_blocks` whose
    ``hook_attn_out`` fires, or None: the block of the
    summary's ``variance_slope_block0``."""
    return next((l for l in subject.variance_blocks() if subject.usable(act_name("attn_out", l))), None)


def probed_blocks(subject: Subject, blocks: tuple[int, ...] | None) -> list[int]:
    """The blocks a measurement of ``subject`` probes (``blocks``, or every block when None); the
    blocks left out are noted in ``subject.info["not_applicable"]``.

    Raises:
        ValueError: for a block the model does not have.
    """
    if blocks is None:
        return list(range(subject.n_layers))
    missing = [b for b in blocks if b >= subject.n_layers]
    if missing:
        raise ValueError(
            f"--layers {block_ranges(missing)}: {subject.name} has {subject.n_layers} blocks (0-{subject.n_layers - 1})"
        )
    left_out = [b for b in range(subject.n_layers) if b not in blocks]
    if left_out:
        subject.info.setdefault("not_applicable", {})["blocks not probed"] = (
            f"blocks {block_ranges(left_out)} (--layers {block_ranges(blocks)}): "
            "their sites, sinks and sink ablation were not "
            "measured (n/a in the per-layer and sink ablation tables), nor their variance except the model's first "
            "attention block's (the summary's slope); a first layer is the first probed one that clears"
        )
    return list(blocks)


def block_ranges(blocks) -> str:
    """Sorted block numbers as runs, for messages.

    >>> block_ranges([0, 1, 2, 3, 7]), block_ranges([5])
    ('0-3,7', '5')
    """
    parts, start = [], None
    for b, nxt in zip(blocks, list(blocks[1:]) + [None]):
        start = b if start is None else start
        if nxt != b + 1:
            parts.append(str(b) if start == b else f"{start}-{b}")
            start = None
    return ",".join(parts)


def pattern_sites(subject: Subject) -> list[str]:
    """Every block's ``hook_pattern`` that fires (a hybrid's linear-attention blocks have none)."""
    return [site for site in act_names("pattern", subject.n_layers) if subject.usable(site)]


def score_sites(model, n_layers: int, hf=None) -> list[str]:
    """The ``blocks.{l}.attn.hook_attn_scores`` sites the model has (none: no score-read column).

    With an HF description (``hf``), only sites that fire and hold the scores behind the pattern:
    a bridge whose scores hook carries the pattern itself (GPT-J, GPT-Neo, OPT, XGLM, Llama 4) has none.
    """
    if hf is not None and not hf.scores_hook:
        return []
    sites = act_names("attn_scores", n_layers)
    return [site for site in sites if site in model.hook_dict and (hf is None or hf.fires(site))]


def sink_sites(subject: Subject) -> list[str]:
    """The extra sites a subject's non-token sinks are read from: ``attn.hook_v`` and ``attn.hook_z``
    of its output-scale sink blocks (see :class:`~nopelens.probes.sinks.SinkStats`)."""
    return [
        act_name(name, block)
        for block, (kind, _) in subject.sinks().items()
        if kind == "output_scale"
        for name in ("v", "z")
    ]
