"""Training tasks: synthetic sequence tasks and a byte-level language model over real text.

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

import abc
import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any, Callable

import torch
from jaxtyping import Bool, Float, Int
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
    lengths: Int[Tensor, "batch"] = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(t.to(device) for t in (self.tokens, self.loss_mask, self.attention_mask, self.targets, self.lengths)))


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


def _check_sizes(n: int, min_len: int, max_len: int, smallest: int = 1) -> None:
    for name, value in (("n", n), ("min_len", min_len), ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if n < 1:
        raise ValueError(f"n (number of sequences) must be >= 1, got {n}")
    if min_len < smallest:
        raise ValueError(f"min_len must be >= {smallest}, got {min_len}")
    if max_len < min_len:
        raise ValueError(f"max_len={max_len} is smaller than min_len={min_len}")


def _pad_rows(rows: list[tuple[list[int], list[int], list[bool]]], pad_id: int, lengths: Tensor) -> Batch:
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
    tokenizer: "ByteTokenizer | None" = None
    """Maps text to the task's token ids; None for the synthetic tasks (they have no text)."""

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

        Every subclass that uses :meth:`sample` as is defines it.
        """
        raise NotImplementedError(f"{type(self).__name__} defines no _example")

    def sample(self, n: int, min_len: int, max_len: int, seed: SeedLike) -> Batch:
        _check_sizes(n, min_len, max_len, self.min_length)
        generator = as_generator(seed)
        lengths = torch.randint(min_len, max_len + 1, (n,), generator=generator)
        rows = []
        for length in lengths.tolist():
            prompt, answer = self._example(length, generator)
            tokens = [self.bos_id] + prompt + answer
            targets = tokens[1:] + [self.pad_id]
            scored = [False] * len(prompt) + [True] * len(answer) + [False]
            rows.append((tokens, targets, scored))
        return _pad_rows(rows, self.pad_id, lengths)


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

    def sample(self, n: int, min_len: int, max_len: int, seed: SeedLike) -> Batch:
        _check_sizes(n, min_len, max_len, self.min_length)
        generator = as_generator(seed)
        lengths = torch.randint(min_len, max_len + 1, (n,), generator=generator)
        rows = []
        for length in lengths.tolist():
            tokens = [self.bos_id] + self._symbols(length, generator)
            targets = [self.pad_id] + tokens[:-1]
            rows.append((tokens, targets, [False] + [True] * length))
        return _pad_rows(rows, self.pad_id, lengths)


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
            a, b = (int("".join(map(str, torch.randint(0, 10, (length,), generator=generator).tolist()))) for _ in range(2))
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


# --------------------------------------------------------------------------------------- text
VALIDATION_FRACTION = 0.1
DOCUMENT_SEPARATOR = b"\n\n"


def default_documents() -> dict[str, str]:
    """CPython's bundled English help texts, ``pydoc_data.topics.topics`` (about 465 KB).

    Returns:
        ``{topic: text}``, one document per help topic, sorted by topic.
    """
    return dict(sorted(topics.items()))


def file_documents(path: str | Path) -> dict[str, str]:
    """The paragraphs (separated by blank lines) of a UTF-8 text file, keyed ``"<index>"``.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if it is not valid UTF-8 or holds fewer than two paragraphs.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text corpus {str(path)!r} does not exist or is not a file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"text corpus {str(path)!r} is not UTF-8: {error}") from None
    paragraphs = [p.strip("\n") for p in text.replace("\r\n", "\n").split("\n\n")]
    paragraphs = [p for p in paragraphs if p.strip()]
    if len(paragraphs) < 2:
        raise ValueError(
            f"text corpus {str(path)!r} has {len(paragraphs)} paragraph(s); the train/validation "
            "split is by document (paragraphs separated by a blank line), so it needs at least 2"
        )
    return {str(i): p for i, p in enumerate(paragraphs)}


def is_validation_document(key: str, fraction: float = VALIDATION_FRACTION) -> bool:
    """Deterministic split: a document is in validation when sha256(key) falls in ``fraction``.

    The choice depends on the document's own key only, so adding a document never moves another.

    Example:
        >>> [is_validation_document(k) for k in ("assert", "break", "class", "if")]
        [False, True, True, False]
    """
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


class ByteTokenizer:
    """The ``text`` task's vocabulary: UTF-8 bytes are ids 0-255, then BOS and PAD.

    Decoding skips BOS and PAD (as HF's ``skip_special_tokens``) and turns a byte sequence that is
    not valid UTF-8 (e.g. a character cut in half by ``max_new_tokens``) into U+FFFD, as
    byte-level tokenizers do. Byte-level text has no end-of-sequence token: ``eos_id`` is None.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hé")
        [104, 195, 169]
        >>> tok.decode([256, 104, 195, 169, 257])
        'hé'
    """

    bos_id, pad_id, eos_id, d_vocab = 256, 257, None, 258

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as token ids (no BOS).

        Raises:
            TypeError: if ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"a byte-level model reads str input, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """The text of token ids; BOS and PAD are skipped.

        Raises:
            ValueError: on an id outside ``[0, 258)``, naming it and its index.
        """
        for index, token in enumerate(ids):
            if not 0 <= token < self.d_vocab:
                raise ValueError(
                    f"token id {token} at index {index} is not a byte-level token: ids 0-255 are "
                    f"bytes, {self.bos_id} is BOS, {self.pad_id} is PAD"
                )
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def token_string(self, token: int) -> str:
        """One token as text: its character for ASCII, ``\\xNN`` for other bytes, ``<bos>``/``<pad>``.

        Example:
            >>> [ByteTokenizer().token_string(t) for t in (256, 104, 195)]
            ['<bos>', 'h', '\\\\xc3']
        """
        special = {self.bos_id: "<bos>", self.pad_id: "<pad>"}
        if token in special:
            return special[token]
        self.decode([token])  # checks the id
        return bytes([token]).decode("utf-8", errors="backslashreplace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class TextTask(Task):
    """``text``: a byte-level language model over a UTF-8 corpus, split by document.

    Layout ``BOS byte_1 .. byte_n``; every next-byte prediction is scored. Token ids 0-255 are
    bytes, 256 is BOS and 257 is PAD (never scored). Each split is its documents joined by a blank
    line into one byte stream; a sample is a window of n bytes starting uniformly in its stream.

    Args:
        path: a UTF-8 text file whose paragraphs are the documents; None (default) uses CPython's
            bundled help texts (:func:`default_documents`).
        validation_fraction: share of documents (by hashed key) held out for validation.

    Raises:
        FileNotFoundError / ValueError: see :func:`file_documents`; ValueError if either split is
            empty.
    """

    name = "text"
    min_length = 1
    tokenizer = ByteTokenizer()

    def __init__(self, path: str | None = None, validation_fraction: float = VALIDATION_FRACTION) -> None:
        super().__init__()
        if not 0.0 < validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must lie in (0, 1), got {validation_fraction!r}")
        self.path = None if path is None else str(path)
        self.kwargs = {"path": self.path, "validation_fraction": validation_fraction}
        documents = default_documents() if path is None else file_documents(path)
        split = {"train": [], "validation": []}
        for key, text in documents.items():
            split["validation" if is_validation_document(key, validation_fraction) else "train"].append(text)
        for name, docs in split.items():
            if not docs:
                raise ValueError(
                    f"the {name} split of {self.path or 'pydoc_data.topics'} is empty "
                    f"({len(documents)} documents, validation_fraction={validation_fraction}); "
                    "use a corpus with more documents or another fraction"
                )
        self.documents = {name: len(docs) for name, docs in split.items()}
        self.streams = {
            name: torch.frombuffer(bytearray(DOCUMENT_SEPARATOR.join(t.encode("utf-8") for t in docs)), dtype=torch.uint8).long()
            for name, docs in split.items()
        }
        self.characters = {name: sum(len(t) for t in docs) + 2 * (len(docs) - 1) for name, docs in split.items()}
        self.d_vocab, self.bos_id, self.pad_id = self.tokenizer.d_vocab, self.tokenizer.bos_id, self.tokenizer.pad_id

    def seq_len(self, length: int) -> int:
        return length + 1

    def bytes_per_character(self, split: str = "validation") -> float:
        """UTF-8 bytes per character of a split (1.0 for pure ASCII); converts bits/byte to bits/char."""
        return len(self.streams[self._check_split(split)]) / self.characters[split]

    def _check_split(self, split: str) -> str:
        if split not in self.streams:
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        return split

    def sample(self, n: int, min_len: int, max_len: int, seed: SeedLike, split: str = "train") -> Batch:
        """Windows of the ``split`` stream; see :meth:`Task.sample`. ``split`` is ``train`` or ``validation``."""
        _check_sizes(n, min_len, max_len, self.min_length)
        stream = self.streams[self._check_split(split)]
        if max_len > len(stream):
            raise ValueError(f"max_len={max_len} is longer than the {split} stream ({len(stream)} bytes)")
        generator = as_generator(seed)
        lengths = torch.randint(min_len, max_len + 1, (n,), generator=generator)
        starts = (torch.rand(n, generator=generator) * (len(stream) - lengths + 1)).long()
        rows = []
        for start, length in zip(starts.tolist(), lengths.tolist()):
            tokens = [self.bos_id] + stream[start : start + length].tolist()
            rows.append((tokens, tokens[1:] + [self.pad_id], [True] * length + [False]))
        return _pad_rows(rows, self.pad_id, lengths)

    def windows(self, length: int, split: str = "validation", max_windows: int | None = None) -> Batch:
        """Consecutive non-overlapping windows of ``length`` bytes tiling the split's stream.

        The deterministic evaluation set: every byte of the stream (up to the last whole window,
        or the first ``max_windows`` windows) is predicted exactly once.
        """
        stream = self.streams[self._check_split(split)]
        count = len(stream) // length
        if max_windows is not None:
            count = min(count, max_windows)
        if count < 1:
            raise ValueError(f"the {split} stream ({len(stream)} bytes) is shorter than one window of {length}")
        body = stream[: count * length].view(count, length)
        tokens = torch.cat([torch.full((count, 1), self.bos_id), body], dim=1)
        targets = torch.cat([body, torch.full((count, 1), self.pad_id)], dim=1)
        loss_mask = torch.ones_like(tokens, dtype=torch.bool)
        loss_mask[:, -1] = False
        return Batch(tokens, loss_mask, torch.ones_like(tokens), targets, torch.full((count,), length))


# --------------------------------------------------------------------------- bigram-backcopy


@functools.lru_cache(maxsize=8)
def help_text_bigrams(n_symbols: int) -> tuple[bytes, Tensor, Tensor]:
    """Byte statistics of CPython's help texts (:func:`default_documents`, every document).

    Args:
        n_symbols: how many of the most frequent bytes to keep (ties broken by byte value).

    Returns:
        ``(symbols, marginal, transition)``: the kept bytes, most frequent first; float64
        ``[n_symbols]`` unigram frequencies among them; float64 ``[n_symbols, n_symbols]`` bigram
        transition P(next | current), counted over adjacent byte pairs inside a document with both
        bytes kept. A row with no count (never seen before a kept byte) is uniform.

    Raises:
        ValueError: if ``n_symbols`` is not in 2..256 or the corpus has fewer distinct bytes.
    """
    if isinstance(n_symbols, bool) or not isinstance(n_symbols, int) or not 2 <= n_symbols <= 256:
        raise ValueError(f"n_symbols must be an integer in 2..256, got {n_symbols!r}")
    documents = [torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
                 for text in default_documents().values()]
    counts = torch.bincount(torch.cat(documents), minlength=256)
    if int((counts > 0).sum()) < n_symbols:
        raise ValueError(f"the help texts have {int((counts > 0).sum())} distinct bytes, fewer than n_symbols={n_symbols}")
    order = sorted(range(256), key=lambda b: (-int(counts[b]), b))[:n_symbols]
    index = torch.full((256,), -1, dtype=torch.long)
    index[torch.tensor(order)] = torch.arange(n_symbols)
    pairs = torch.zeros(n_symbols, n_symbols, dtype=torch.float64)
    for doc in documents:
        a, b = index[doc[:-1]], index[doc[1:]]
        kept = (a >= 0) & (b >= 0)
        pairs.index_put_((a[kept], b[kept]), torch.ones(int(kept.sum()), dtype=torch.float64), accumulate=True)
    totals = pairs.sum(1, keepdim=True)
    transition = torch.where(totals > 0, pairs / totals.clamp_min(1), torch.full_like(pairs, 1.0 / n_symbols))
    marginal = counts[torch.tensor(order)].double()
    return bytes(order), marginal / marginal.sum(), transition


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
        _check_sizes(n, min_len, max_len, self.min_length)
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
