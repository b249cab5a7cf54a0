"""What a sweep measures (:class:`SweepSettings`): its models, sequences, probes' folds and
bootstrap, training seeds, sites and, for ``nopelens probe hf:DIR``, the streamed run's batch size
and memory. The run folder's stamp is :meth:`SweepSettings.to_dict`; :func:`~nopelens.analyses.sweep.driver.sweep`
runs them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from nopelens.models.hf_loading import HFInput

from .. import runs
from ..subjects import CONTROL_SPECS, has_training_seed

DEFAULT_MODELS = {
    "text": ("text-nope-4l", "text-rope-4l", "text-hybrid-4l", "bb-rope-2l", "bb-nope-3l"),
    "copy": ("copy-nope-3l", "copy-rope-3l"),
}
"""The zoo models of the default sweep: the text models, and two Bigram-Backcopy models whose
attention sink forms in training (Guo et al. 2024). Those of ``text`` ship with the package."""


SITE_KINDS = ("resid", "attn_out", "resid_mid", "mlp_out")
"""What ``--sites`` may name: ``resid`` (every residual layer 0 .. n_layers, where every read's
curve lives) and each block's finer sites, in the order a block computes them."""


DEFAULT_SITES = ("resid", "attn_out", "mlp_out")


@dataclass(frozen=True)
class SweepSettings:
    """What a sweep measures. Two runs with equal settings give equal numbers on CPU.

    Attributes:
        models: subject specs (zoo names, checkpoint paths, ``hf:DIR``, ``circuit``,
            ``untrained-nope``, ``constant-METHOD``), in order.
        n_sequences: fresh evaluation sequences per subject.
        seq_len: tokens per evaluation sequence (BOS included).
        n_boot: bootstrap replicates for the 95 % CIs.
        n_splits: GroupKFold folds over sequences.
        seed: seed of the sequences, pairs, controls and bootstrap.
        quick_steps: train zoo models afresh for only this many steps (smoke tests).
        train_seeds: training seeds; each zoo model (and the untrained control's weights) is
            measured once per seed. Models that no seed changes (circuit, checkpoints, HF
            directories) are measured once.
        sites: where absolute index is probed (:data:`SITE_KINDS`): ``resid`` (required) and any
            of the finer sites ``attn_out``, ``resid_mid``, ``mlp_out`` of every block. Relative
            distance is read on the residual stream and every block's attention either way.
        hf_input: how ``hf:DIR`` models are read (:class:`~nopelens.models.hf_loading.HFInput`:
            text through their tokenizer, random ids or one token repeated; device; dtype).
        streamed: plan the run under a memory budget (``nopelens probe hf:DIR``): the plan is
            printed, a run that cannot fit refused, and the batch size, keep budget, memory,
            ``--layers`` and sink-ablation settings below apply. Otherwise (``nopelens sweep``)
            every batch's features are kept, in batches of 32: one pass
            (:func:`~nopelens.analyses.sweep.driver.analyse_subject` measures both through the streaming engine).
        batch_size: sequences per forward pass of a streamed measurement, or ``"auto"``: at most 32,
            fewer where a forward pass of 32 would not fit half the memory free on the model's
            device (:func:`~nopelens.analyses.sweep.budget.auto_batch_size`).
        keep_mib: MiB of features a streamed measurement may keep for its predictions instead of
            a second forward pass (None: 512 MiB or a quarter of the memory the run may use, whichever
            is less, and no more than leaves room for the largest site's statistics,
            :func:`~nopelens.analyses.sweep.budget.auto_keep_bytes`; 0: none, so memory is the
            statistics' whatever the number of tokens).
        memory_mib: MiB a streamed measurement may add on the model's device (None: what is free
            there when it starts): the keep budget, the batch size and the groups of sites whose
            statistics are summed in one run (:func:`~nopelens.analyses.sweep.budget.statistics_groups`)
            follow from it. It changes no number, so a run folder does not record it.
        layers: the blocks a streamed measurement probes (None: every block): each one's input and
            output residual stream (layers l and l + 1), its attention and MLP outputs, q.k and
            score reads, sinks, variance and sink ablation (and the variance of the model's first
            attention block, :func:`~nopelens.analyses.sweep.sites.first_variance_block`, which the
            summary's slope reads); each forward pass stops after the deepest
            (:func:`~nopelens.analyses.sweep.sites.sweep_sites`). The summary's first layers are then the
            first probed ones that clear, and the run says which blocks it left out.
        sink_ablation: measure the sink ablation of a streamed subject (about n_layers / 2 extra
            forward passes; ``nopelens probe --no-sink-ablation`` turns it off). The in-memory
            sweep always measures it.
    """

    models: tuple[str, ...]
    n_sequences: int = 80
    seq_len: int = 64
    n_boot: int = 200
    n_splits: int = 5
    seed: int = 0
    quick_steps: int | None = None
    train_seeds: tuple[int, ...] = (0,)
    sites: tuple[str, ...] = DEFAULT_SITES
    hf_input: HFInput = HFInput()
    streamed: bool = False
    batch_size: int | str = "auto"
    keep_mib: int | None = None
    sink_ablation: bool = True
    memory_mib: int | None = None
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "train_seeds", tuple(self.train_seeds))
        object.__setattr__(self, "sites", tuple(sorted(set(self.sites), key=_site_order)))
        if "resid" not in self.sites:
            raise ValueError(
                f"--sites must include resid (every read's layer curve is on the residual stream), "
                f"got {','.join(self.sites) or 'nothing'}"
            )
        if not self.train_seeds or len(set(self.train_seeds)) < len(self.train_seeds):
            raise ValueError(f"--seeds must list distinct training seeds, got {list(self.train_seeds)}")
        if min(self.train_seeds) < 0:
            raise ValueError(f"training seeds must be >= 0, got {list(self.train_seeds)}")
        if self.batch_size != "auto" and (
            isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1
        ):
            raise ValueError(f"--batch-size must be a positive integer or auto, got {self.batch_size!r}")
        if self.keep_mib is not None and (
            isinstance(self.keep_mib, bool) or not isinstance(self.keep_mib, int) or self.keep_mib < 0
        ):
            raise ValueError(f"--keep-mib must be an integer >= 0, got {self.keep_mib!r}")
        if self.memory_mib is not None and (
            isinstance(self.memory_mib, bool) or not isinstance(self.memory_mib, int) or self.memory_mib < 1
        ):
            raise ValueError(f"--memory-mib must be an integer >= 1, got {self.memory_mib!r}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
            if not self.layers or any(
                isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0 for b in self.layers
            ):
                raise ValueError(f"--layers must name blocks by numbers >= 0, got {list(self.layers)}")
            if not self.streamed:
                raise ValueError("--layers applies to hf:DIR models (the streamed probe)")

    @classmethod
    def default(
        cls, task: str = "text", models: tuple[str, ...] | None = None, controls: bool = True, **kw
    ) -> "SweepSettings":
        """The default sweep: the zoo models of ``task`` (text: NoPE, RoPE and the RoPE/NoPE hybrid
        language models and the two Bigram-Backcopy models) plus the controls."""
        if models is None:
            if task not in DEFAULT_MODELS:
                raise ValueError(f"task must be one of {sorted(DEFAULT_MODELS)}, got {task!r}")
            models = DEFAULT_MODELS[task]
        models = tuple(models) + (CONTROL_SPECS if controls else ())
        return cls(models=tuple(dict.fromkeys(models)), **kw)

    @classmethod
    def quick(cls, task: str = "text", models: tuple[str, ...] | None = None, controls: bool = True) -> "SweepSettings":
        """A tiny sweep for smoke tests: few sequences, short sequences, briefly trained models."""
        return cls.default(task, models, controls, n_sequences=24, seq_len=32, n_boot=50, n_splits=4, quick_steps=30)

    RESUMABLE_CHANGES = ("train_seeds", "batch_size", "keep_mib")
    """Settings a run folder may change between runs: adding seeds measures just the new ones; the
    batch size and the keep budget cut the same work into other forward passes (``auto`` already
    follows the memory free), which changes round-off only. The stamp records the latest."""

    UNSET = {
        "hf_input": dataclasses.asdict(HFInput()),
        "streamed": "one pass, every feature kept, as nopelens sweep measures",
        "batch_size": "auto (32, or fewer where 32 do not fit the memory free)",
        "keep_mib": "512 MiB or a quarter of the memory available",
        "sink_ablation": "on",
        "sites": ",".join(DEFAULT_SITES),
        "layers": "every block",
    }
    """What a setting :meth:`to_dict` leaves out (at its default) means, for a refused run folder's message."""

    def to_dict(self) -> dict:
        """The settings as the run folder's stamp holds them. ``sites`` is written only when it is
        not :data:`DEFAULT_SITES`, so folders made before ``--sites`` existed keep their digest."""
        settings = dataclasses.asdict(self)
        del settings["memory_mib"]  # how the work is split in runs, not what is measured
        del settings["hf_input"]["placement"]  # where the model's modules live: the same numbers
        if self.sites == DEFAULT_SITES:
            del settings["sites"]
        # written only when set, so folders made before they existed keep their digest
        for name, default in (
            ("hf_input", {k: v for k, v in dataclasses.asdict(HFInput()).items() if k != "placement"}),
            ("streamed", False),
            ("batch_size", "auto"),
            ("keep_mib", None),
            ("sink_ablation", True),
            ("layers", None),
        ):
            if settings[name] == default:
                del settings[name]
        return settings

    def digest(self) -> str:
        """Hash of what each (model, seed) measurement depends on (the run folder's stamp,
        :func:`~nopelens.analyses.runs.claim`); :data:`RESUMABLE_CHANGES` are left out."""
        return runs.settings_digest(self.to_dict(), ignore=self.RESUMABLE_CHANGES)

    def tasks(self) -> list[tuple[str, int]]:
        """The (model spec, training seed) pairs a sweep measures, in table order."""
        return [
            (spec, seed)
            for spec in self.models
            for seed in (self.train_seeds if has_training_seed(spec) else self.train_seeds[:1])
        ]


def _site_order(kind: str) -> int:
    if kind not in SITE_KINDS:
        raise ValueError(f"unknown site kind {kind!r} for --sites; choose from {', '.join(SITE_KINDS)}")
    return SITE_KINDS.index(kind)
