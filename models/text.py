"""The ``text`` task: a byte-level language model over real text, and the corpus it reads.

The corpus is a set of documents (CPython's bundled help texts by default; those and the docstrings
of CPython's standard library, ``corpus="python_docs"``; or the paragraphs of a UTF-8 file), split
into train and validation by a hash of each document's key; the vocabulary is UTF-8 bytes plus BOS
and PAD (:class:`ByteTokenizer`). :func:`help_text_bigrams` gives the byte
statistics the ``bigram_backcopy`` task samples from.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import sysconfig
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import torch
from torch import Tensor

from .task_base import Batch, SeedLike, Task, as_generator, check_sizes, pad_rows

VALIDATION_FRACTION = 0.1
DOCUMENT_SEPARATOR = b"\n\n"
UNSEEN_SPAN = 64
"""A validation document is *unseen* when none of its strings of this many bytes occurs in the
training text (split ``unseen``). CPython's help topics copy each other: 8 of the 11 default
validation documents have more than 90 % of their 64-byte strings in the training text."""


def default_documents() -> dict[str, str]:
    """CPython's bundled English help texts, ``pydoc_data.topics.topics`` (about 465 KB).

    Returns:
        ``{topic: text}``, one document per help topic, sorted by topic.
    """
    return dict(sorted(topics.items()))


MIN_DOCSTRING = 40
"""Docstrings shorter than this many characters ("Return self==value.") are left out of
``python_docs``."""


@functools.lru_cache(maxsize=1)
def python_docs_documents() -> dict[str, str]:
    """CPython's help texts and every docstring of its standard library (about 2.6 MB on 3.11).

    The docstrings are read from the running interpreter's standard library (``sysconfig``'s
    ``stdlib`` folder, never ``site-packages``) with :mod:`ast`, so no module is imported. Each is
    cleaned as ``inspect.cleandoc`` does; those shorter than :data:`MIN_DOCSTRING` characters,
    and copies of an earlier one (files and names in sorted order), are left out. A file Python
    cannot parse (test data written to fail) is skipped. Like the help texts, the corpus is the
    running Python's: another Python version gives other text.

    Returns:
        ``{key: text}``: the help topics keyed ``"topic:<topic>"``, then the docstrings keyed
        ``"<module>:<qualified name>"`` (``"<module>:"`` for a module's own).
    """
    documents = {f"topic:{key}": text for key, text in default_documents().items()}
    seen = set()
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if "site-packages" in relative.parts:
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, UnicodeDecodeError):
            continue
        parts = relative.with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for name, text in _docstrings(tree):
            text = inspect.cleandoc(text)
            if len(text) >= MIN_DOCSTRING and text not in seen:
                seen.add(text)
                documents[f"{module}:{name}"] = text
    return documents


def _docstrings(node: ast.AST, prefix: str = ""):
    """``(qualified name, docstring)`` of ``node`` and of the classes and functions in it, in order."""
    text = ast.get_docstring(node, clean=False)
    if text:
        yield prefix, text
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _docstrings(child, f"{prefix}.{child.name}" if prefix else child.name)


CORPORA = {
    "help": (default_documents, "CPython's help topics"),
    "python_docs": (python_docs_documents, "CPython's help topics and standard-library docstrings"),
}
"""The built-in corpora of :class:`TextTask`: name -> (documents, what to call it in a report)."""


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


def _span_hashes(data: np.ndarray) -> np.ndarray:
    """A 64-bit polynomial hash (arithmetic mod 2**64) of every :data:`UNSEEN_SPAN`-byte string of
    ``data`` (``uint8 [n]``), ``uint64 [n - UNSEEN_SPAN + 1]`` (empty when ``n`` is shorter)."""
    count = len(data) - UNSEEN_SPAN + 1
    hashes = np.zeros(max(count, 0), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for offset in range(min(UNSEEN_SPAN, len(data))):
            if count > 0:
                hashes = hashes * np.uint64(1_000_003) + data[offset : offset + count].astype(np.uint64) + np.uint64(1)
    return hashes


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
        path: a UTF-8 text file whose paragraphs are the documents; None (default) reads
            ``corpus``.
        validation_fraction: share of documents (by hashed key) held out for validation.
        corpus: the built-in corpus read when ``path`` is None (:data:`CORPORA`): ``help``
            (default, :func:`default_documents`) or ``python_docs`` (:func:`python_docs_documents`).

    Attributes:
        corpus_name: what the text is, for reports: the file, or the built-in corpus's name.

    Raises:
        FileNotFoundError / ValueError: see :func:`file_documents`; ValueError on an unknown
            ``corpus`` or a ``corpus`` given with ``path``, or if either split is empty.
    """

    name = "text"
    min_length = 1
    tokenizer = ByteTokenizer()

    def __init__(
        self, path: str | None = None, validation_fraction: float = VALIDATION_FRACTION, corpus: str = "help"
    ) -> None:
        super().__init__()
        if not 0.0 < validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must lie in (0, 1), got {validation_fraction!r}")
        if corpus not in CORPORA:
            raise ValueError(f"corpus must be one of {', '.join(map(repr, CORPORA))}, got {corpus!r}")
        if path is not None and corpus != "help":
            raise ValueError(
                f"give a text file (path) or a built-in corpus, not both (path={str(path)!r}, corpus={corpus!r})"
            )
        self.path = None if path is None else str(path)
        # the default corpus stays out of kwargs: recipes from before it existed keep their digests
        self.kwargs = {"path": self.path, "validation_fraction": validation_fraction}
        if corpus != "help":
            self.kwargs["corpus"] = corpus
        read, label = CORPORA[corpus]
        documents = read() if path is None else file_documents(path)
        self.corpus_name = self.path or label
        split = {"train": [], "validation": []}
        for key, text in documents.items():
            split["validation" if is_validation_document(key, validation_fraction) else "train"].append(text)
        for name, docs in split.items():
            if not docs:
                raise ValueError(
                    f"the {name} split of {self.corpus_name} is empty "
                    f"({len(documents)} documents, validation_fraction={validation_fraction}); "
                    "use a corpus with more documents or another fraction"
                )
        self._validation_texts = split["validation"]
        self.documents = {name: len(docs) for name, docs in split.items()}
        self.streams = {
            name: torch.frombuffer(
                bytearray(DOCUMENT_SEPARATOR.join(t.encode("utf-8") for t in docs)), dtype=torch.uint8
            ).long()
            for name, docs in split.items()
        }
        self.characters = {name: sum(len(t) for t in docs) + 2 * (len(docs) - 1) for name, docs in split.items()}
        self.d_vocab, self.bos_id, self.pad_id = self.tokenizer.d_vocab, self.tokenizer.bos_id, self.tokenizer.pad_id

    def seq_len(self, length: int) -> int:
        return length + 1

    def bytes_per_character(self, split: str = "validation") -> float:
        """UTF-8 bytes per character of a split (1.0 for pure ASCII); converts bits/byte to bits/char."""
        return len(self.streams[self._check_split(split)]) / self.characters[split]

    def stream(self, split: str) -> Tensor:
        """The byte stream of ``split`` (``train``, ``validation`` or ``unseen``, built on first use),
        ``long [n_bytes]``.

        Raises:
            ValueError: on an unknown split, or ``unseen`` when no validation document is unseen.
        """
        return self.streams[self._check_split(split)]

    def _check_split(self, split: str) -> str:
        if split == "unseen" and split not in self.streams:
            self.streams["unseen"] = self._unseen_stream()
        if split not in self.streams:
            raise ValueError(f"split must be 'train', 'validation' or 'unseen', got {split!r}")
        return split

    def _unseen_stream(self) -> Tensor:
        """The validation documents none of whose :data:`UNSEEN_SPAN`-byte strings occurs in the
        training stream (one shorter than that: not found whole in it), joined as the other splits
        are. Built on first use, from a 64-bit hash of each such string of the training text (8
        bytes per training byte)."""
        train = self.streams["train"].numpy().astype(np.uint8)
        seen, train_bytes = np.unique(_span_hashes(train)), train.tobytes()
        unseen = []
        for text in self._validation_texts:
            data = text.encode("utf-8")
            if len(data) < UNSEEN_SPAN:
                copied = data in train_bytes
            else:
                spans = _span_hashes(np.frombuffer(data, dtype=np.uint8))
                found = seen[np.minimum(np.searchsorted(seen, spans), len(seen) - 1)] == spans  # seen is sorted
                copied = bool(found.any())
            if not copied:
                unseen.append(data)
        if not unseen:
            raise ValueError(
                f"none of the {len(self._validation_texts)} validation documents is unseen: each shares a "
                f"{UNSEEN_SPAN}-byte string with the training text (or, shorter, occurs in it whole)"
            )
        self.documents["unseen"] = len(unseen)
        self.characters["unseen"] = sum(len(d.decode("utf-8")) for d in unseen) + 2 * (len(unseen) - 1)
        return torch.frombuffer(bytearray(DOCUMENT_SEPARATOR.join(unseen)), dtype=torch.uint8).long()

    def sample(self, n: int, min_len: int, max_len: int, seed: SeedLike, split: str = "train") -> Batch:
        """Windows of the ``split`` stream; see :meth:`Task.sample`. ``split`` is ``train``,
        ``validation`` or ``unseen`` (the validation documents that share no :data:`UNSEEN_SPAN`-byte
        string with the training text)."""
        check_sizes(n, min_len, max_len, self.min_length)
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
        return pad_rows(rows, self.pad_id, lengths)

    def windows(self, length: int, split: str = "validation", max_windows: int | None = None) -> Batch:
        """Consecutive non-overlapping windows of ``length`` bytes tiling the split's stream.

        The deterministic evaluation set: every byte of the stream (up to the last whole window,
        or the first ``max_windows`` windows) is predicted exactly once. ``split``: ``train``,
        ``validation`` or ``unseen`` (see :meth:`sample`).

        Raises:
            ValueError: on a length or ``max_windows`` that is not a whole number >= 1, an unknown
                split, a stream shorter than one window, or ``unseen`` when every validation
                document shares a string with the training text.
        """
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"window length must be a whole number of bytes >= 1, got {length!r}")
        if max_windows is not None and (not isinstance(max_windows, int) or max_windows < 1):
            raise ValueError(f"max_windows must be a whole number >= 1, got {max_windows!r}")
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
    documents = [
        torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        for text in default_documents().values()
    ]
    counts = torch.bincount(torch.cat(documents), minlength=256)
    if int((counts > 0).sum()) < n_symbols:
        raise ValueError(
            f"the help texts have {int((counts > 0).sum())} distinct bytes, fewer than n_symbols={n_symbols}"
        )
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
