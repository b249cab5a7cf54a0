"""Training tasks: synthetic sequence tasks and a byte-level language model over real text.

This module holds the synthetic tasks and the registry (:data:`TASKS`, :func:`make_task`); the
shared :class:`Batch` and :class:`Task` are in :mod:`nopelens.models.task_base`, the ``text`` task and
its corpus in :mod:`nopelens.models.text` (both re-exported here).

Every task samples a :class:`Batch` of right-padded sequences that start with BOS at position 0.
A task's *length* is its problem size (the number of tokens to copy, digits per operand, bits,
text bytes), not the number of tokens in the sequence; ``task.seq_len(length)`` gives the latter.

The token layouts, in the manner of minGPT's ``AdditionDataset`` (``x_i`` random symbols, ``n``
the length; ``|`` marks where the loss starts, everything after it up to EOS is scored):

===================  ==================================================================
task                 layout
===================  ==================================================================
``copy``             ``BOS x_1 .. x_n SEP | x_1 .. x_n EOS``  (Kazemnejad et al. 2023)
``repeat``           ``BOS x x .. x SEP | x x .. x EOS``, one symbol n times both sides
``reverse``          ``BOS x_1 .. x_n SEP | x_n .. x_1 EOS``
``previous_token``   ``BOS x_1 .. x_n``; the logits at position p predict the token at p - 1
``addition``         ``BOS a_{n-1} .. a_0 + b_{n-1} .. b_0 SEP | c_0 c_1 .. c_n EOS``,
                     operands with n digits (leading zeros allowed), the sum reversed with
                     n + 1 digits
``parity``           ``BOS b_1 .. b_n SEP | p EOS``, p = b_1 xor .. xor b_n
``text``             ``BOS byte_1 .. byte_n``, a window of UTF-8 bytes of a corpus
``bigram_backcopy``  ``BOS x_1 .. x_n``: a bigram chain whose tokens after a trigger copy the
                     token before it (Guo et al. 2024); every prediction is scored
===================  ==================================================================

Token ids of the synthetic tasks: 0 PAD, 1 BOS, 2 SEP, 3 EOS, then the task's own symbols
(``+`` then the digits for ``addition``; the bits ``0``, ``1`` for ``parity``).

Loss convention: ``targets[b, p]`` is what the logits at position p should predict and
``loss_mask[b, p]`` says whether that prediction is scored. For next-token tasks
``targets[b, p] = tokens[b, p + 1]``; for ``previous_token`` ``targets[b, p] = tokens[b, p - 1]``.
Exact match asks every scored prediction of a sequence to be right; with teacher forcing this
equals greedy decoding of the answer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .task_base import (
    BOS_ID,
    EOS_ID,
    N_SPECIAL,
    PAD_ID,
    SEP_ID,
    Batch,
    SeedLike,
    Task,
    as_generator,
    check_sizes,
    pad_rows,
)
from .text import (
    DOCUMENT_SEPARATOR,
    VALIDATION_FRACTION,
    ByteTokenizer,
    TextTask,
    default_documents,
    file_documents,
    help_text_bigrams,
    is_validation_document,
)

__all__ = [  # the names of task_base and text stay importable from here, where they were defined first
    "BOS_ID",
    "DOCUMENT_SEPARATOR",
    "EOS_ID",
    "N_SPECIAL",
    "PAD_ID",
    "SEP_ID",
    "TASKS",
    "VALIDATION_FRACTION",
    "AdditionTask",
    "Batch",
    "BigramBackcopyTask",
    "ByteTokenizer",
    "CopyTask",
    "ParityTask",
    "PreviousTokenTask",
    "RepeatTask",
    "RepeatTwiceTask",
    "ReplaceTask",
    "ReverseTask",
    "SeedLike",
    "SymbolTask",
    "Task",
    "TextTask",
    "as_generator",
    "default_documents",
    "file_documents",
    "help_text_bigrams",
    "is_validation_document",
    "make_task",
]


class SymbolTask(Task):
    """A synthetic task whose sequences are ``BOS prompt answer`` with the answer scored.

    Subclasses implement ``_example(length, generator) -> (prompt, answer)`` as lists of token ids;
    the answer ends with EOS and every token of it is a scored target.
    """

    def __init__(self, n_symbols: int = 16) -> None:
        super().__init__()
        if isinstance(n_symbols, bool) or not isinstance(n_symbols, int) or n_symbols < 1:
            raise ValueError(f"n_symbols must be a positive integer, got {n_symbols!r}")
        self.n_symbols = n_symbols
        self.kwargs = {"n_symbols": n_symbols}
        self.d_vocab = N_SPECIAL + n_symbols

    def _symbols(self, k: int, generator: torch.Generator) -> list[int]:
        return (torch.randint(0, self.n_symbols, (k,), generator=generator) + N_SPECIAL).tolist()

    def _example(self, length: int, generator: torch.Generator) -> tuple[list[int], list[int]]:
        """One problem of size ``length``: (prompt tokens, answer tokens ending with EOS).

        Every subclass that keeps :meth:`_row` as is defines it.
        """
        raise NotImplementedError(f"{type(self).__name__} defines no _example")

    def _row(self, length: int, generator: torch.Generator) -> tuple[list[int], list[int], list[bool]]:
        """(tokens, targets, scored) of one problem of size ``length``: ``BOS prompt answer``."""
        prompt, answer = self._example(length, generator)
        tokens = [self.bos_id] + prompt + answer
        return tokens, tokens[1:] + [self.pad_id], [False] * len(prompt) + [True] * len(answer) + [False]

    def sample(self, n: int, min_len: int, max_len: int, seed: SeedLike) -> Batch:
        check_sizes(n, min_len, max_len, self.min_length)
        generator = as_generator(seed)
        lengths = torch.randint(min_len, max_len + 1, (n,), generator=generator)
        return pad_rows([self._row(length, generator) for length in lengths.tolist()], self.pad_id, lengths)


class CopyTask(SymbolTask):
    """``copy``: ``BOS x_1 .. x_n SEP | x_1 .. x_n EOS`` (Kazemnejad et al. 2023, copy task)."""

    name = "copy"

    def seq_len(self, length: int) -> int:
        return 2 * length + 3

    def _example(self, length, generator):
        xs = self._symbols(length, generator)
        return xs + [SEP_ID], xs + [EOS_ID]


class RepeatTask(SymbolTask):
    """``repeat``: ``BOS x^n SEP | x^n EOS``, one symbol repeated n times, copied n times.

    The copy variant of Kazemnejad et al. 2023 used for length generalization: the content is
    trivial, so getting it right at unseen lengths is a question of counting (where to put EOS).
    """

    name = "repeat"

    def seq_len(self, length: int) -> int:
        return 2 * length + 3

    def _example(self, length, generator):
        xs = self._symbols(1, generator) * length
        return xs + [SEP_ID], xs + [EOS_ID]


class RepeatTwiceTask(SymbolTask):
    """``repeat_twice``: ``BOS x^n SEP | x^2n EOS`` (Kazemnejad et al. 2023's ``rsc2x``: the same-token
    copy whose answer is twice as long as the prompt; ``make_copy_dataset.py`` of their repository)."""

    name = "repeat_twice"

    def seq_len(self, length: int) -> int:
        return 3 * length + 3

    def _example(self, length, generator):
        x = self._symbols(1, generator)
        return x * length + [SEP_ID], x * (2 * length) + [EOS_ID]


class ReplaceTask(SymbolTask):
    """``replace``: ``BOS a b a^n SEP | b^n EOS`` with two different symbols a, b: "replace a with b in
    a .. a" (Kazemnejad et al. 2023's ``rdc``, the A->B copy; their prompt is ``Replace a with b in a
    .. a [SEP]``, ``make_copy_dataset.py`` of their repository). Needs ``n_symbols >= 2``."""

    name = "replace"

    def __init__(self, n_symbols: int = 16) -> None:
        super().__init__(n_symbols)
        if n_symbols < 2:
            raise ValueError(f"replace needs two different symbols: n_symbols must be >= 2, got {n_symbols}")

    def seq_len(self, length: int) -> int:
        return 2 * length + 5

    def _example(self, length, generator):
        a, b = (torch.randperm(self.n_symbols, generator=generator)[:2] + N_SPECIAL).tolist()
        return [a, b] + [a] * length + [SEP_ID], [b] * length + [EOS_ID]


class ReverseTask(SymbolTask):
    """``reverse``: ``BOS x_1 .. x_n SEP | x_n .. x_1 EOS``."""

    name = "reverse"

    def seq_len(self, length: int) -> int:
        return 2 * length + 3

    def _example(self, length, generator):
        xs = self._symbols(length, generator)
        return xs + [SEP_ID], xs[::-1] + [EOS_ID]


class PreviousTokenTask(SymbolTask):
    """``previous_token``: ``BOS x_1 .. x_n``; the logits at position p predict token p - 1.

    Every position p >= 1 is scored (position 1 predicts BOS). A 2-layer NoPE model solves it:
    the causal mask lets it infer its own position and attend one step back.
    """

    name = "previous_token"

    def seq_len(self, length: int) -> int:
        return length + 1

    def _row(self, length, generator):
        tokens = [self.bos_id] + self._symbols(length, generator)
        return tokens, [self.pad_id] + tokens[:-1], [False] + [True] * length


class AdditionTask(SymbolTask):
    """``addition``: ``BOS a + b SEP | reversed(a + b) EOS`` with n-digit operands.

    Operands are drawn uniformly from ``[0, 10^n)`` and written most significant digit first with
    leading zeros; the sum is written least significant digit first with n + 1 digits, so each
    answer digit depends only on digits already seen and a carry (minGPT's ``AdditionDataset``).
    Token ids: 4 is ``+``, 5 + d is digit d.
    """

    name = "addition"
    PLUS_ID = N_SPECIAL

    def __init__(self) -> None:
        Task.__init__(self)
        self.d_vocab = N_SPECIAL + 1 + 10

    def seq_len(self, length: int) -> int:
        return 3 * length + 5

    def _digits(self, value: int, width: int) -> list[int]:
        return [N_SPECIAL + 1 + int(c) for c in str(value).zfill(width)]

    def _example(self, length, generator):
        high = 10**length
        if length <= 18:
            a, b = torch.randint(0, high, (2,), generator=generator).tolist()
        else:  # beyond int64: draw digit by digit
            a, b = (
                int("".join(map(str, torch.randint(0, 10, (length,), generator=generator).tolist()))) for _ in range(2)
            )
        prompt = self._digits(a, length) + [self.PLUS_ID] + self._digits(b, length) + [SEP_ID]
        return prompt, self._digits(a + b, length + 1)[::-1] + [EOS_ID]


class ParityTask(SymbolTask):
    """``parity``: ``BOS b_1 .. b_n SEP | p EOS`` with p the xor of the bits. Bits are ids 4, 5."""

    name = "parity"

    def __init__(self) -> None:
        Task.__init__(self)
        self.d_vocab = N_SPECIAL + 2

    def seq_len(self, length: int) -> int:
        return length + 4

    def _example(self, length, generator):
        bits = torch.randint(0, 2, (length,), generator=generator).tolist()
        return [N_SPECIAL + b for b in bits] + [SEP_ID], [N_SPECIAL + sum(bits) % 2, EOS_ID]


class BigramBackcopyTask(Task):
    """``bigram_backcopy``: the Bigram-Backcopy (BB) task of Guo et al. 2024 ("Active-dormant
    attention heads: mechanistically demystifying extreme-token phenomena in LLMs", §2).

    Layout ``BOS x_1 .. x_n``. The symbols are the ``n_symbols`` most frequent bytes of CPython's
    help texts and the triggers the ``n_triggers`` most frequent of them (the paper: the
    characters of tiny Shakespeare, the three most frequent as triggers). x_1 is drawn from the
    unigram marginal without the triggers; after a non-trigger x_i, x_{i+1} ~ P(. | x_i), the
    corpus's bigram transition; after a trigger, x_{i+1} = x_{i-1} (back-copy). Every next-token
    prediction is scored. A one-layer model can solve it with one head that attends to the
    previous token on triggers and has nothing to do elsewhere: Guo et al. find that head
    *dormant* (an attention sink on BOS) on non-triggers and *active* on triggers.

    Token ids: 0 PAD, 1 BOS, 2 SEP, 3 EOS (the last two unused), then 4 + k for symbol k.
    A problem of size n has n tokens after BOS.

    Args:
        n_symbols: vocabulary of the chain (2..256), most frequent bytes first.
        n_triggers: the most frequent this many symbols are triggers (1..n_symbols - 1).

    Raises:
        ValueError: on sizes out of range.
    """

    name = "bigram_backcopy"

    def __init__(self, n_symbols: int = 64, n_triggers: int = 3) -> None:
        super().__init__()
        if isinstance(n_triggers, bool) or not isinstance(n_triggers, int) or not 1 <= n_triggers < n_symbols:
            raise ValueError(f"n_triggers must be an integer in 1..n_symbols - 1 = {n_symbols - 1}, got {n_triggers!r}")
        self.symbols, marginal, self.transition = help_text_bigrams(n_symbols)
        self.n_symbols, self.n_triggers = n_symbols, n_triggers
        self.kwargs = {"n_symbols": n_symbols, "n_triggers": n_triggers}
        self.d_vocab = N_SPECIAL + n_symbols
        self.trigger = torch.zeros(n_symbols, dtype=torch.bool)
        self.trigger[:n_triggers] = True
        first = marginal.masked_fill(self.trigger, 0.0)
        self.first = first / first.sum()

    @property
    def trigger_ids(self) -> list[int]:
        """Token ids of the triggers."""
        return [N_SPECIAL + k for k in range(self.n_triggers)]

    def is_trigger(self, tokens: Int[Tensor, "batch pos"]) -> Bool[Tensor, "batch pos"]:
        """Where ``tokens`` holds a trigger (after which the next token is a back-copy)."""
        return (tokens >= N_SPECIAL) & (tokens < N_SPECIAL + self.n_triggers)

    def seq_len(self, length: int) -> int:
        return length + 1

    def sample(self, n: int, min_len: int, max_len: int, seed: SeedLike) -> Batch:
        check_sizes(n, min_len, max_len, self.min_length)
        generator = as_generator(seed)
        lengths = torch.randint(min_len, max_len + 1, (n,), generator=generator)
        symbols = torch.empty(n, max_len, dtype=torch.long)
        symbols[:, 0] = torch.multinomial(self.first.expand(n, -1), 1, generator=generator)[:, 0]
        for i in range(1, max_len):  # one draw per row and step, also where a row copies, keeps the stream fixed
            current = symbols[:, i - 1]
            drawn = torch.multinomial(self.transition[current], 1, generator=generator)[:, 0]
            previous = symbols[:, i - 2] if i >= 2 else drawn  # x_1 is never a trigger
            symbols[:, i] = torch.where(self.trigger[current], previous, drawn)
        width = int(lengths.max()) + 1
        tokens = torch.full((n, width), self.pad_id, dtype=torch.long)
        tokens[:, 0] = self.bos_id
        tokens[:, 1:] = symbols[:, : width - 1] + N_SPECIAL
        real = torch.arange(width)[None, :] <= lengths[:, None]
        tokens = tokens.masked_fill(~real, self.pad_id)
        targets = torch.cat([tokens[:, 1:], torch.full((n, 1), self.pad_id)], dim=1)
        loss_mask = torch.arange(width)[None, :] < lengths[:, None]
        return Batch(tokens, loss_mask, real.long(), targets, lengths)

    def oracle_nats(self, batch: Batch) -> Float[Tensor, "batch pos"]:
        """-log p of each scored target under the process that made it (0 where not scored).

        The floor of the loss: 0 after a trigger (the back-copy is certain), the bigram surprisal
        after another symbol, the no-trigger marginal's after BOS.
        """
        tokens, targets = batch.tokens, batch.targets
        nats = torch.zeros(tokens.shape, dtype=torch.float64)
        target = (targets - N_SPECIAL).clamp(0, self.n_symbols - 1)
        current = (tokens - N_SPECIAL).clamp(0, self.n_symbols - 1)
        bigram = -torch.log(self.transition[current, target])
        nats = torch.where(self.is_trigger(tokens), nats, bigram)
        nats = torch.where(tokens == self.bos_id, -torch.log(self.first[target]), nats)
        return nats.masked_fill(~batch.loss_mask, 0.0)


TASKS: dict[str, Callable[..., Task]] = {
    "copy": CopyTask,
    "repeat": RepeatTask,
    "repeat_twice": RepeatTwiceTask,
    "replace": ReplaceTask,
    "reverse": ReverseTask,
    "previous_token": PreviousTokenTask,
    "addition": AdditionTask,
    "parity": ParityTask,
    "text": TextTask,
    "bigram_backcopy": BigramBackcopyTask,
}
"""Task name -> class; ``make_task`` builds from it."""


def make_task(name: str, **kwargs: Any) -> Task:
    """Build a task by name, e.g. ``make_task("copy", n_symbols=16)``.

    Raises:
        KeyError: on an unknown name (the message lists the known ones).
        TypeError: on keyword arguments the task does not take.
    """
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
    try:
        return TASKS[name](**kwargs)
    except TypeError as error:
        raise TypeError(f"task {name!r}: {error}") from None
