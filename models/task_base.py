"""What every training task shares: the :class:`Batch` it samples, the :class:`Task` interface,
the synthetic tasks' special token ids and the sampling helpers.

The tasks themselves are in :mod:`nopelens.models.tasks` (synthetic, and the registry) and
:mod:`nopelens.models.text` (the byte-level text task); the module docstring of the former gives
every layout and the loss convention.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

PAD_ID, BOS_ID, SEP_ID, EOS_ID = 0, 1, 2, 3
N_SPECIAL = 4

SeedLike = int | torch.Generator


@dataclass
class Batch:
    """A batch of right-padded sequences.

    Attributes:
        tokens: int64 ``[batch, pos]``; BOS at position 0, ``pad_id`` after the end of each row.
        loss_mask: bool ``[batch, pos]``; True where the prediction of the logits at that position
            is scored.
        attention_mask: int64 ``[batch, pos]``; 1 for real tokens, 0 for padding.
        targets: int64 ``[batch, pos]``; what the logits at each position should predict
            (``pad_id`` where nothing is scored).
        lengths: int64 ``[batch]``; the problem size of each row (see the module docstring).
    """

    tokens: Int[Tensor, "batch pos"]
    loss_mask: Bool[Tensor, "batch pos"]
    attention_mask: Int[Tensor, "batch pos"]
    targets: Int[Tensor, "batch pos"]
    lengths: Int[Tensor, " batch"] = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(
            *(t.to(device) for t in (self.tokens, self.loss_mask, self.attention_mask, self.targets, self.lengths))
        )


def as_generator(seed: SeedLike) -> torch.Generator:
    """A CPU generator: ``seed`` itself if it is one, else a new one seeded with it.

    Raises:
        TypeError: if ``seed`` is neither an int nor a ``torch.Generator``.
    """
    if isinstance(seed, torch.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or a torch.Generator, got {type(seed).__name__}")
    return torch.Generator().manual_seed(seed)


def check_sizes(n: int, min_len: int, max_len: int, smallest: int = 1) -> None:
    """Check the arguments of :meth:`Task.sample`.

    Raises:
        TypeError: on a size that is not an int. ValueError: on sizes out of range.
    """
    for name, value in (("n", n), ("min_len", min_len), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if n < 1:
        raise ValueError(f"n (number of sequences) must be >= 1, got {n}")
    if min_len < smallest:
        raise ValueError(f"min_len must be >= {smallest}, got {min_len}")
    if max_len < min_len:
        raise ValueError(f"max_len={max_len} is smaller than min_len={min_len}")


def pad_rows(rows: list[tuple[list[int], list[int], list[bool]]], pad_id: int, lengths: Tensor) -> Batch:
    """Right-pad (tokens, targets, scored) rows into a :class:`Batch`."""
    width = max(len(r[0]) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full_like(tokens, pad_id)
    loss_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    attention_mask = torch.zeros_like(tokens)
    for b, (toks, tgts, scored) in enumerate(rows):
        tokens[b, : len(toks)] = torch.tensor(toks)
        targets[b, : len(tgts)] = torch.tensor(tgts)
        loss_mask[b, : len(scored)] = torch.tensor(scored)
        attention_mask[b, : len(toks)] = 1
    return Batch(tokens, loss_mask, attention_mask, targets, lengths)


class Task(abc.ABC):
    """A source of training sequences; subclasses define the layout.

    Attributes:
        name: registry name (``make_task(name, **kwargs)`` rebuilds the task).
        kwargs: the keyword arguments that rebuild it; JSON-ready.
        d_vocab: vocabulary size the model needs.
        bos_id: the token at position 0 of every sequence.
        pad_id: the token after the end of a row.
        min_length: the smallest problem size the task accepts.
    """

    name: str = ""
    d_vocab: int
    bos_id: int = BOS_ID
    pad_id: int = PAD_ID
    min_length: int = 1
    tokenizer: Any = None
    """Maps text to the task's token ids (a :class:`~nopelens.models.text.ByteTokenizer`); None for
    the synthetic tasks (they have no text)."""

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}

    @abc.abstractmethod
    def seq_len(self, length: int) -> int:
        """Number of tokens in a sequence of problem size ``length`` (BOS and EOS included)."""

    @abc.abstractmethod
    def sample(self, n: int, min_len: int, max_len: int, seed: SeedLike) -> Batch:
        """Sample ``n`` sequences with problem sizes drawn uniformly from ``[min_len, max_len]``.

        Args:
            n: number of sequences, >= 1.
            min_len: smallest problem size, >= ``self.min_length``.
            max_len: largest problem size, >= ``min_len``.
            seed: an int (a fresh generator seeded with it) or a ``torch.Generator`` (advanced).

        Returns:
            A right-padded :class:`Batch` as wide as its longest row.

        Raises:
            ValueError: on sizes out of range. TypeError: on a seed of the wrong type.
        """

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{type(self).__name__}({args})"
