"""Which residual dimension carries what in the hand-built circuits.

Every circuit in this package shares one residual layout, so a probe or a test can read "the counter
dimension" or "the position dimension" by name instead of by a magic index. The layout follows the
constructive proofs of Kazemnejad et al. 2023 (NeurIPS), App. C: the embedding provides a constant
dimension and a BOS flag, layer 1 writes the counter 1/(i+1) into a dimension that starts at 0, and
its MLP turns the counter into the absolute index i (and i^2), which layer 2 reads to build
relative-distance scores. Seed ``004_150f630256efbd1c.txt`` describes the same progression.

====================  =====  ==========================================================
name                  index  value at position i of a sequence that starts with BOS
====================  =====  ==========================================================
``one``               0      1 for every token (written by the embedding)
``bos``               1      1 for the BOS token, 0 otherwise (embedding)
``counter``           2      0 in the embedding; 1/(i+1) after the layer-1 head
``position``          3      0 until the layer-1 MLP writes i
``position_sq``       4      0 until the layer-1 MLP writes i^2
``attended_position`` 5      0 until a layer-2 head writes sum_j A_ij j
``content``           6...   one-hot token identity of non-BOS tokens (token t -> dim 5 + t)
====================  =====  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

ONE, BOS, COUNTER, POSITION, POSITION_SQ, ATTENDED_POSITION = range(6)
CONTENT_START = 6
BOS_TOKEN = 0

DIMENSIONS = {
    "one": ONE,
    "bos": BOS,
    "counter": COUNTER,
    "position": POSITION,
    "position_sq": POSITION_SQ,
    "attended_position": ATTENDED_POSITION,
}
"""Residual-stream dimension of each named feature of the hand-set circuits (:data:`MEANINGS` says
what each holds)."""

MEANINGS = {
    "one": "1 for every token (embedding): the constant every key and query can read",
    "bos": "1 only for the BOS token (embedding): the anchor the counter divides",
    "counter": "1/(i+1) after the layer-1 uniform head, 0 before; identically 0 without BOS",
    "position": "absolute index i, written by the layer-1 MLP from the counter (exact for i < n_ctx)",
    "position_sq": "i^2, written by the same MLP hidden units (read by the previous-token head)",
    "attended_position": "sum_j A_ij j written by the layer-2 head (0 in a one-layer counter)",
    "content": "one-hot token identity of non-BOS tokens; no circuit weight reads it",
}


@dataclass(frozen=True)
class CircuitInfo:
    """What a hand-built circuit computes, and where: attached to the model as ``model.circuit``.

    Attributes:
        name: ``counter``, ``distance`` or ``previous_token``.
        n_ctx: the context length the weights were built for.
        bos_token: the token id that carries the BOS flag.
        heads: ``"layer.head"`` -> what that head does (layer numbers as in ``blocks.{l}``).
        slope: the ALiBi slope m the distance head reproduces (None otherwise).
        sharpness: the c of the previous-token score -c (i - j - 1)^2 (None otherwise).
        dims: residual dimension name -> index (see the module docstring).
        meanings: residual dimension name -> what it carries.
        content_dims: ``(start, stop)`` of the token-identity dimensions.
    """

    name: str
    n_ctx: int
    bos_token: int = BOS_TOKEN
    heads: dict[str, str] = field(default_factory=dict)
    slope: float | None = None
    sharpness: float | None = None
    dims: dict[str, int] = field(default_factory=lambda: dict(DIMENSIONS))
    meanings: dict[str, str] = field(default_factory=lambda: dict(MEANINGS))
    content_dims: tuple[int, int] = (CONTENT_START, CONTENT_START)

    @property
    def exact_positions(self) -> int:
        """Positions ``0 .. n_ctx - 1`` get the exact index from the MLP; past them it is not i."""
        return self.n_ctx

    @property
    def counter_dim(self) -> int:
        """Residual dimension holding 1/(i+1) after layer 1."""
        return self.dims["counter"]

    @property
    def position_dim(self) -> int:
        """Residual dimension holding i after layer 1."""
        return self.dims["position"]

    def describe(self) -> str:
        """A few lines for humans: the residual layout and the heads."""
        lines = [f"circuit {self.name!r} (n_ctx={self.n_ctx}, BOS token id {self.bos_token})"]
        for name, index in self.dims.items():
            lines.append(f"  dim {index:>2} {name:<17} {self.meanings[name]}")
        start, stop = self.content_dims
        lines.append(f"  dims {start}..{stop - 1} content: {self.meanings['content']}")
        for where, what in self.heads.items():
            lines.append(f"  head {where}: {what}")
        return "\n".join(lines)
