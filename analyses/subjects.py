"""The models an analysis looks at ("subjects"), and the evaluation sequences each one reads.

A subject is named on the command line by one spec:

- a zoo name (``text-nope-4l``; trained and cached on first use, see ``nopelens.models.zoo``);
- a path to a nopelens checkpoint directory;
- ``hf:DIR``, a local HF causal-LM directory, loaded offline (:mod:`nopelens.models.hf_loading`) and
  bridged with TransformerLens;
- ``circuit``, the hand-built Theorem 1 + 2 NoPE circuit (positive control; ``nopelens.circuits``);
- ``untrained-nope``, a randomly initialized NoPE decoder read without BOS (negative control);
- ``factory:FILE.py:FUNCTION`` (or ``package.module:FUNCTION``), the user's own torch module (:mod:`.factory`);
- ``constant-METHOD``, a randomly initialized decoder with position method METHOD read on constant
  input: every token the same id, no BOS (negative control, issue 10). In exact arithmetic every
  position then has the same state at every layer for any method that puts position only into
  attention (``nope``, ``rope``, ``alibi``, ``shaw`` without value terms): keys and values are
  equal, so any pattern averages the same value. Float round-off is all that differs, and it is not
  signal. ``constant-rope+rope+rope+nope`` is a hybrid: the ``+`` list is repeated over the layers
  (here NoPE every fourth layer, as in SmolLM3). With ``learned`` or ``sinusoidal`` the input still
  carries the position table, so there it is a positive check, not a negative control.

Every subject carries its own evaluation batch: fresh sequences the model never trained on
(validation documents for text models, new samples for synthetic tasks). What a spec names before
any model is loaded (its training seeds, planned work, fixed length, display name and input
fingerprint) is read by :mod:`nopelens.analyses.specs`.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nopelens.circuits import distance
from nopelens.circuits.layout import BOS_TOKEN
from nopelens.models import Decoder, zoo
from nopelens.models.checkpoint import load_checkpoint
from nopelens.models.hf import SIZE_FIELDS as SIZE_FIELDS
from nopelens.models.hf import UnsupportedModelError, check_readable, describe, learned_sinks, trained_length

# HF loading lives in models/hf_loading.py; SIZE_FIELDS and these names were defined here before and
# still import from here
from nopelens.models.hf_loading import (  # noqa: F401
    DEVICES,
    DTYPES,
    INPUTS,
    HFInput,
    attention_shortfall,
    checked_hf_config,
    config_bos_id,
    eager_attention_bytes,
    load_hf_dir,
    load_tokenizer,
    text_windows,
)
from nopelens.models.hooks import act_name
from nopelens.models.masks import CAUSAL
from nopelens.models.placement import model_device
from nopelens.models.zoo import recipe
from nopelens.probes.collect import model_key_windows
from nopelens.probes.sinks import sink_read_reason, variance_read_reason
from nopelens.probes.stream import available_memory

from .audit.report import by_reason
from .factory import FACTORY_PREFIX, factory_subject
from .specs import (  # noqa: F401  (what a spec names before loading: defined there, re-exported here)
    CONSTANT_PREFIX,
    CONTROL_SPECS,
    HF_PREFIX,
    MODEL_FILES,
    QUICK_BATCH,
    display_name,
    fixed_length,
    has_training_seed,
    input_changes,
    input_fingerprint,
    is_model_file,
    planned_work,
)

CONSTANT_TOKEN = 3
"""The one token id of a ``constant-METHOD`` subject's sequences."""


@dataclass
class Subject:
    """A hooked model and the sequences to read it on.

    Attributes:
        name: label used in tables and figures.
        model: a ``Decoder``, ``TransformerBridge`` or ``HookedModule``.
        n_layers: number of blocks.
        position: the position method's name (``nope``, ``rope``, ...; ``hf`` when unknown).
        kind: ``trained``, ``circuit`` (positive control), ``untrained`` or ``constant`` (negative
            controls: random weights; read on constant input), or ``external``.
        tokens: int64 ``[batch, pos]`` evaluation sequences.
        attention_mask: int64 ``[batch, pos]``, 1 for real tokens.
        has_bos: whether every sequence starts with a dedicated BOS token.
        bos_token_id: the BOS id, if the model has one.
        train_lengths: ``[min_len, max_len]`` of training, when known.
        info: anything else worth reporting (steps, losses, recipe).
        targets: int64 ``[batch, pos]``, what each position should predict (trained models).
        loss_mask: bool ``[batch, pos]``, where a prediction is scored (trained models).
        hf: the :class:`~nopelens.models.hf.HFDescription` of an HF model (None otherwise).
        task: the :class:`~nopelens.models.tasks.Task` a trained model learned (None otherwise).
    """

    name: str
    model: Any
    n_layers: int
    position: str
    kind: str
    tokens: Tensor
    attention_mask: Tensor
    has_bos: bool
    bos_token_id: int | None = None
    train_lengths: list[int] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    targets: Tensor | None = None
    loss_mask: Tensor | None = None
    hf: Any = None
    task: Any = None

    def key_windows(self) -> dict:
        """Block -> its sliding window or chunk (:class:`~nopelens.models.masks.KeyWindow`), for the
        blocks of an HF model or a hooked module that have one; empty for nopelens' own models."""
        return self.hf.key_windows() if self.hf is not None else model_key_windows(self.model)

    def sparse_blocks(self) -> dict[int, str]:
        """Block -> why its attention over this subject's sequences is no static mask (a DSA indexer
        past ``index_topk`` keys, :meth:`nopelens.models.hf.LayerPosition.sparse_reason`): the
        reads that assume the window rule (sink mass, variance, scores) are not applicable there."""
        if self.hf is None:
            return {}
        length = int(self.attention_mask.sum(-1).max())
        reasons = {l: layer.sparse_reason(length) for l, layer in enumerate(self.hf.layers)}
        return {l: why for l, why in reasons.items() if why is not None}

    def sparse_note(self) -> str:
        """:meth:`sparse_blocks` as one line, blocks grouped by reason ("" when there is none)."""
        return by_reason(self.sparse_blocks(), noun="blocks")

    def variance_blocks(self) -> list[int]:
        """The attention blocks whose output variance can be read: not a linear-attention or SSM
        mixer, not a DSA block, a window that leaves a slope to fit (:meth:`unreadable_blocks`)."""
        unreadable = self.unreadable_blocks("variance read")
        return [
            l
            for l in range(self.n_layers)
            if (self.hf is None or self.hf.layers[l].mixer == "attention") and l not in unreadable
        ]

    def unreadable_blocks(self, read: str) -> dict[int, str]:
        """Block -> why ``read`` (``"sink read"`` or ``"variance read"``) cannot be made there: its
        kept keys are chosen by content (:meth:`sparse_blocks`: mass at key 0 mixes "not kept" with
        "not attended"), it has no attention (:meth:`attentionless_blocks`), or its window leaves nothing to average
        (:func:`~nopelens.probes.sinks.sink_read_reason`, :func:`~nopelens.probes.sinks.variance_read_reason`:
        a sliding window of 1 for the sink, fewer than 3 distinct visible-key counts for the variance slope,
        as in a causal block over 3 tokens after BOS).

        Raises:
            ValueError: if ``read`` is neither.
        """
        if read not in ("sink read", "variance read"):
            raise ValueError(f"read must be 'sink read' or 'variance read', got {read!r}")
        blocks = {**self.sparse_blocks(), **self.attentionless_blocks()}
        length = int(self.attention_mask.sum(-1).max())
        windows = self.key_windows()
        for block in range(self.n_layers):  # causal blocks too: 3 tokens after BOS leave 2 key counts
            keys = windows.get(block, CAUSAL)
            why = (
                sink_read_reason(keys, length)
                if read == "sink read"
                else variance_read_reason(keys, length, first_position=int(self.has_bos))
            )
            if why is not None and block not in blocks:
                blocks[block] = why
        return dict(sorted(blocks.items()))

    def attentionless_blocks(self) -> dict[int, str]:
        """Block -> what it is instead, for an HF model's blocks without softmax attention (an SSM,
        linear-attention or MLP-only block: no pattern, no sink, no attention output variance)."""
        if self.hf is None:
            return {}
        return {l: layer.label() for l, layer in enumerate(self.hf.layers) if layer.mixer != "attention"}

    def note_unreadable_reads(self) -> dict[str, dict[int, str]]:
        """Record in ``info["not_applicable"]`` the blocks the sink and variance reads skip
        (:meth:`unreadable_blocks`); returns read -> those blocks."""
        skipped = {read: self.unreadable_blocks(read) for read in ("sink read", "variance read")}
        for read, blocks in skipped.items():
            if blocks:
                self.info.setdefault("not_applicable", {})[read] = by_reason(blocks, noun="blocks")
        return skipped

    def sinks(self) -> dict:
        """Block -> (kind, per-head logits or None) of an HF model's non-token sinks (learned,
        per-token or output-scale, :attr:`nopelens.models.hf.LayerPosition.sink`); empty otherwise."""
        if self.hf is None:
            return {}

        logits = learned_sinks(self.model.original_model, self.hf)
        return {l: (layer.sink, logits.get(l)) for l, layer in enumerate(self.hf.layers) if layer.sink is not None}

    def usable(self, site: str) -> bool:
        """The model has hook ``site`` and it fires (bridged hook points that never fire are not)."""
        return site in self.model.hook_dict and (self.hf is None or self.hf.fires(site))


def qk_sites(source, layer: int) -> tuple[str, str] | None:
    """The (query, key) hooks of a block's content q.k read: the rotated ones where the model
    rotates q and k and those hooks fire, else the plain ``hook_q``/``hook_k``; None where the
    layer rotates but no hook that fires holds q and k rotated
    (:meth:`~nopelens.models.hf.HFDescription.unrotated_qk` says why).

    ``source`` is a :class:`Subject` (whose HF description says which hooks fire) or a bare
    hooked model (its ``hook_dict``).
    """
    usable = source.usable if isinstance(source, Subject) else (lambda site: site in source.hook_dict)
    rotated = (act_name("rot_q", layer), act_name("rot_k", layer))
    if all(usable(site) for site in rotated):
        return rotated
    hf = source.hf if isinstance(source, Subject) else None
    if hf is not None and hf.unrotated_qk(layer) is not None:
        return None
    return act_name("q", layer), act_name("k", layer)


def resolve(
    spec: str,
    n_sequences: int,
    seq_len: int,
    seed: int = 0,
    progress: bool = True,
    quick_steps: int | None = None,
    train_seed: int = 0,
    hf_input: HFInput | None = None,
) -> Subject:
    """Build the subject a spec names, with ``n_sequences`` fresh evaluation sequences.

    Args:
        spec: see the module docstring.
        n_sequences: evaluation sequences, >= 2 (probes split by sequence).
        seq_len: tokens per evaluation sequence (BOS included), >= 3.
        seed: seed of the evaluation sequences and of untrained weights.
        progress: show training progress bars, and say which copy of a zoo model was loaded.
        quick_steps: if given, a zoo model is trained afresh for only this many steps, on
            batches of :data:`QUICK_BATCH` sequences (not cached), for smoke tests.
        train_seed: training seed of a zoo model (each seed is its own cached model), and the
            offset added to ``seed`` for the untrained and constant models' weights; see
            :func:`has_training_seed`.
        hf_input: how an ``hf:DIR`` model is read (:class:`HFInput`; default: random ids, CPU, its dtype).

    Raises:
        KeyError: on an unknown zoo name (listing the available ones).
        FileNotFoundError: on a checkpoint or HF directory that does not exist (listing the cached
            zoo checkpoints).
        ValueError: on an invalid checkpoint or bad sizes.
    """
    if n_sequences < 2:
        raise ValueError(f"need at least 2 evaluation sequences (probes split by sequence), got {n_sequences}")
    if seq_len < 3:
        raise ValueError(f"seq_len (--seq-len) must be >= 3, got {seq_len}")
    check_spec(spec)
    if spec == "circuit":
        return _circuit(n_sequences, seq_len, seed)
    if spec == "untrained-nope":
        return _untrained(n_sequences, seq_len, seed, seed + train_seed)
    if spec.startswith(CONSTANT_PREFIX):
        return _constant(spec, n_sequences, seq_len, seed, seed + train_seed)
    if spec.startswith(HF_PREFIX):
        return _hf(Path(spec[len(HF_PREFIX) :]), n_sequences, seq_len, seed, hf_input or HFInput())
    if spec.startswith(FACTORY_PREFIX):
        return factory_subject(spec, n_sequences, seq_len, seed, Subject)
    if "/" in spec or Path(spec).exists():
        return _trained(load_checkpoint_dir(Path(spec)), str(spec), n_sequences, seq_len, seed)

    recipe = zoo.recipe(spec, train_seed)
    if quick_steps is not None:
        trained = _quick_train(recipe, quick_steps)
        return _trained(trained, f"{spec} ({quick_steps} steps)", n_sequences, seq_len, seed)
    return _trained(
        zoo.load(spec, progress=progress, seed=train_seed, announce=progress), spec, n_sequences, seq_len, seed
    )


def check_spec(spec: str) -> None:
    """Fail fast, before any work, on a spec that names nothing.

    Raises:
        KeyError: on an unknown zoo name (listing the available ones).
        FileNotFoundError: on a checkpoint or HF directory that does not exist.
    """
    if spec in CONTROL_SPECS or spec.startswith(FACTORY_PREFIX):
        return
    if spec.startswith(CONSTANT_PREFIX):
        constant_config(spec)
        return
    if spec.startswith(HF_PREFIX):
        if not spec[len(HF_PREFIX) :].strip():
            raise FileNotFoundError(f"{spec!r} names no directory: give hf:DIR, e.g. hf:./my-model")
        if not Path(spec[len(HF_PREFIX) :]).is_dir():
            raise FileNotFoundError(f"no such HF model directory: {spec[len(HF_PREFIX) :]}")
        return
    if "/" in spec or Path(spec).exists():
        if not Path(spec).is_dir():
            load_checkpoint_dir(Path(spec))  # raises, listing what exists
        return
    if spec not in zoo.RECIPES:
        close = difflib.get_close_matches(spec, zoo.names(), n=2)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise KeyError(
            f"unknown model {spec!r}: not a zoo model ({hint}`nopelens train --list` lists them), nor circuit, "
            "untrained-nope, constant-METHOD, a checkpoint directory, hf:DIR or factory:FILE.py:FUNCTION"
        )


def _circuit(n_sequences: int, seq_len: int, seed: int) -> Subject:
    model = distance(n_ctx=seq_len)
    tokens = _random_tokens(n_sequences, seq_len, 1, model.cfg.d_vocab, seed)
    tokens[:, 0] = BOS_TOKEN
    return Subject(
        "circuit",
        model,
        model.cfg.n_layers,
        "nope",
        "circuit",
        tokens,
        torch.ones_like(tokens),
        has_bos=True,
        bos_token_id=BOS_TOKEN,
        info={"construction": "Kazemnejad et al. 2023 Thm 1+2"},
    )


def _untrained(n_sequences: int, seq_len: int, seed: int, init_seed: int) -> Subject:
    config = recipe("text-nope-4l").config
    model = Decoder(config, seed=init_seed).eval()
    tokens = _random_tokens(n_sequences, seq_len, 0, config.d_vocab, seed)  # no distinct BOS
    return Subject(
        "untrained-nope",
        model,
        config.n_layers,
        "nope",
        "untrained",
        tokens,
        torch.ones_like(tokens),
        has_bos=False,
        info={"init_std": config.init_std},
    )


def constant_config(spec: str):
    """The untrained decoder config of a ``constant-METHOD`` spec: the text zoo shape, METHOD's position.

    Raises:
        ValueError: if METHOD is not a position method (the message lists them).
    """
    config = recipe("text-nope-4l").config
    methods = spec[len(CONSTANT_PREFIX) :].split("+")
    if len(methods) == 1:
        position = methods[0]
    else:
        position = tuple(methods[layer % len(methods)] for layer in range(config.n_layers))
    try:
        return config.replace(position=position)
    except ValueError as error:
        raise ValueError(f"{spec!r}: {error}") from None


def _constant(spec: str, n_sequences: int, seq_len: int, seed: int, init_seed: int) -> Subject:
    config = constant_config(spec)
    model = Decoder(config, seed=init_seed).eval()
    tokens = torch.full((n_sequences, seq_len), CONSTANT_TOKEN, dtype=torch.long)  # no BOS
    return Subject(
        spec,
        model,
        config.n_layers,
        config.position_name,
        "constant",
        tokens,
        torch.ones_like(tokens),
        has_bos=False,
        info={"init_std": config.init_std, "token": CONSTANT_TOKEN},
    )


def from_trained(trained, name: str, n_sequences: int, seq_len: int, seed: int = 0) -> Subject:
    """The subject of a loaded :class:`~nopelens.models.checkpoint.TrainedModel`, named ``name``, read on
    ``n_sequences`` fresh sequences of its task (see :func:`resolve`)."""
    return _trained(trained, name, n_sequences, seq_len, seed)


def _trained(trained, name: str, n_sequences: int, seq_len: int, seed: int) -> Subject:
    task = trained.task
    meta = trained.metadata
    batch = _evaluation_batch(task, n_sequences, seq_len, meta.get("train_lengths"), seed)
    config = trained.model.cfg
    info = {k: meta[k] for k in ("steps", "final_losses", "zoo_recipe") if k in meta}
    return Subject(
        name,
        trained.model.eval(),
        config.n_layers,
        config.position_name,
        "trained",
        batch.tokens,
        batch.attention_mask,
        has_bos=True,
        bos_token_id=task.bos_id,
        train_lengths=meta.get("train_lengths"),
        info=info,
        targets=batch.targets,
        loss_mask=batch.loss_mask,
        task=task,
    )


def _evaluation_batch(task, n_sequences: int, seq_len: int, train_lengths, seed: int):
    """Fresh sequences: validation text windows for text, new samples for synthetic tasks.

    Synthetic samples all have the longest training length, so every sequence covers every
    trained position (mixed lengths would leave long distances and late positions with too few
    sequences for grouped probes and sink windows).
    """
    if task.name == "text":
        return task.sample(n_sequences, seq_len - 1, seq_len - 1, seed, split="validation")
    _, high = train_lengths or (task.min_length, task.min_length)
    return task.sample(n_sequences, high, high, seed)


def _hf(directory: Path, n_sequences: int, seq_len: int, seed: int, how: HFInput) -> Subject:
    device = how.torch_device()  # a bad device fails before the model loads
    checked_hf_config(directory)  # a broken config.json is named as such, not as a missing tokenizer
    tokenizer = load_tokenizer(directory) if how.input == "text" else None
    model = load_hf_dir(directory, dtype=how.dtype, device=device, placement=how.placement)
    device = model_device(model)  # a device map's main device
    description = describe(model)
    check_readable(description)
    if description.max_positions is not None and seq_len > description.max_positions:
        raise UnsupportedModelError(
            f"--seq-len {seq_len} is longer than the learned position table of {directory.name} "
            f"({description.max_positions} positions); use --seq-len {description.max_positions} or less"
        )
    if any(layer.mixer == "attention" for layer in description.layers):  # refused before any token is drawn
        shortfall = attention_shortfall(
            seq_len,
            description.n_heads,
            next(model.parameters()).element_size(),
            available_memory(device),
            f"free on {device.type}",
        )
        if shortfall:
            raise ValueError(f"{HF_PREFIX}{directory}: {shortfall}")
    if tokenizer is not None:
        tokens, bos_id = text_windows(tokenizer, how.text, n_sequences, seq_len, seed, description.d_vocab)
    else:
        bos_id = config_bos_id(directory)
        if bos_id is not None and not 0 <= bos_id < description.d_vocab:
            raise ValueError(
                f"{directory}/config.json: bos_token_id {bos_id} is outside the vocabulary "
                f"(0..{description.d_vocab - 1})"
            )
        if how.input == "repeated":  # no BOS: every token the same is the known answer's input
            tokens = torch.full((n_sequences, seq_len), repeated_token(description.d_vocab, bos_id), dtype=torch.long)
            bos_id = None
        else:
            tokens = _random_tokens(n_sequences, seq_len, 0, description.d_vocab, seed)
        if bos_id is not None:
            tokens[:, 0] = bos_id
    methods = sorted(set(description.layer_methods))
    position = description.input_position or ",".join(description.layer_methods if len(methods) > 1 else methods)
    info = {
        "hf": description.summary(),
        "input": how.input,
        "device": str(device),
        **({"placement": "; ".join(model.placement.lines())} if model.placement else {}),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    if how.input == "text":
        info["text"] = how.text or "pydoc_data.topics (the corpus nopelens ships)"
    trained = trained_length(model.original_model.config)
    if description.max_positions is None and trained is not None and seq_len > trained:
        info["beyond_trained_length"] = (
            f"--seq-len {seq_len} passes max_position_embeddings {trained} of config.json: "
            f"positions from {trained} on are beyond the length the model was made for"
        )
    return Subject(
        display_name(f"{HF_PREFIX}{directory}"),
        model,
        description.n_layers,
        position,
        "external",
        tokens,
        torch.ones_like(tokens),
        has_bos=bos_id is not None,
        bos_token_id=bos_id,
        info=info,
        hf=description,
    )


def repeated_token(d_vocab: int, bos_id: int | None) -> int:
    """The token ``--input repeated`` repeats: :data:`CONSTANT_TOKEN`, or the next id that is not BOS."""
    token = CONSTANT_TOKEN % d_vocab
    return (token + 1) % d_vocab if token == bos_id else token


def load_checkpoint_dir(path: Path):
    """Load a nopelens checkpoint directory; a missing one names the zoo and the cached checkpoints.

    Raises:
        FileNotFoundError: if ``path`` is not a directory (the message lists what is available).
        ValueError: if it is not a valid nopelens checkpoint.
    """
    if not path.is_dir():
        cached = sorted(p.name for p in (zoo.cache_root() / "zoo").glob("*") if p.is_dir())
        available = ", ".join(cached) if cached else "none cached yet"
        raise FileNotFoundError(
            f"no checkpoint directory at {path}; zoo names: {', '.join(zoo.names())}; cached checkpoints "
            f"under {zoo.cache_root() / 'zoo'}: {available}"
        )
    return load_checkpoint(path)


def _quick_train(recipe, steps: int):
    batch = min(QUICK_BATCH, recipe.train_kwargs.get("batch_size", QUICK_BATCH))
    quick = dataclasses.replace(recipe, steps=steps, train_kwargs=recipe.train_kwargs | {"batch_size": batch})
    return quick.train(progress=False)


def _random_tokens(n: int, length: int, low: int, high: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n, length), generator=generator)
