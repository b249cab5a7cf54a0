"""Text in and out of a :class:`~nopelens.models.Decoder`: ``to_tokens``, ``to_string``, ``generate``.

The signatures mirror TransformerLens' (``TransformerBridge.to_tokens``, ``to_string``,
``generate``) so TransformerLens habits carry over; the ``Decoder`` methods of the same names call
these functions. Strings need a model with a tokenizer: byte-level text models (zoo ``text-*``
models, checkpoints trained on the ``text`` task) carry a
:class:`~nopelens.models.tasks.ByteTokenizer`; any model generates from token tensors.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

if TYPE_CHECKING:
    from .decoder import Decoder

PADDING_SIDES = ("left", "right")
RETURN_TYPES = ("input", "str", "tokens")


def require_tokenizer(model: "Decoder", operation: str):
    """The model's tokenizer, or a ValueError saying why ``operation`` needs one."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            f"{operation} needs a byte-level text model, and this Decoder has no tokenizer (it "
            "was not trained on the 'text' task); load a zoo text-* model or a text checkpoint, "
            "call model.set_tokenizer(ByteTokenizer()) on a model with d_vocab >= 258, or pass "
            "token ids"
        )
    return tokenizer


def to_tokens(
    model: "Decoder",
    input: str | Sequence[str],
    prepend_bos: bool | None = None,
    padding_side: str = "right",
    move_to_device: bool = True,
    truncate: bool = False,
) -> Int[Tensor, "batch pos"]:
    """Token ids of one string or a list of strings, as ``TransformerBridge.to_tokens``.

    Args:
        model: a decoder with a tokenizer.
        input: a string or a non-empty list of strings.
        prepend_bos: put BOS at position 0; None uses ``model.cfg.default_prepend_bos`` (True).
        padding_side: where the PAD ids of shorter strings go, ``right`` or ``left``. The mask
            of real tokens is ``tokens != model.tokenizer.pad_id``.
        move_to_device: put the ids on the model's device (else CPU).
        truncate: cut each row to ``n_ctx`` tokens. Off by default (TransformerLens' default is
            on): nopelens drops no text unless asked.

    Returns:
        int64 ``[batch, pos]``.

    Raises:
        ValueError: without a tokenizer, on an unknown padding side, an empty list, or a string
            that gives no tokens at all (empty, with ``prepend_bos=False``).
        TypeError: if ``input`` is neither a str nor a list of str.
    """
    tokenizer = require_tokenizer(model, "to_tokens")
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
    texts = [input] if isinstance(input, str) else input
    if not isinstance(texts, (list, tuple)) or not texts:
        raise (ValueError if isinstance(texts, (list, tuple)) else TypeError)(
            f"to_tokens takes a str or a non-empty list of str, got {input!r:.80}"
        )
    if prepend_bos is None:
        prepend_bos = model.cfg.default_prepend_bos
    rows = [([tokenizer.bos_id] if prepend_bos else []) + tokenizer.encode(text) for text in texts]
    if truncate:
        rows = [row[: model.cfg.n_ctx] for row in rows]
    empty = [i for i, row in enumerate(rows) if not row]
    if empty:
        raise ValueError(f"string {empty[0]} gives no tokens (it is empty and prepend_bos is False)")
    width = max(len(row) for row in rows)
    pad = lambda row: [tokenizer.pad_id] * (width - len(row))  # noqa: E731
    padded = [row + pad(row) if padding_side == "right" else pad(row) + row for row in rows]
    tokens = torch.tensor(padded, dtype=torch.long)
    return tokens.to(model.device) if move_to_device else tokens


def to_string(model: "Decoder", tokens: Tensor | Sequence[int] | Sequence[Sequence[int]]) -> str | list[str]:
    """The text of token ids, as ``TransformerBridge.to_string``: BOS and PAD are skipped.

    Args:
        model: a decoder with a tokenizer.
        tokens: ``[pos]`` (or a list of ints) gives one string; ``[batch, pos]`` a list of them.

    Raises:
        ValueError: without a tokenizer, on a tensor of more than 2 dims, or on an id that is not
            a token of the tokenizer (the message names it).
        TypeError: on non-integer ids.
    """
    tokenizer = require_tokenizer(model, "to_string")
    tokens = tokens if isinstance(tokens, Tensor) else torch.as_tensor(tokens)
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise TypeError(f"to_string takes integer token ids, got dtype {tokens.dtype}")
    if tokens.ndim > 2:
        raise ValueError(f"to_string takes [pos] or [batch, pos] token ids, got shape {tuple(tokens.shape)}")
    if tokens.ndim == 2:
        return [tokenizer.decode(row) for row in tokens.tolist()]
    return tokenizer.decode(tokens.reshape(-1).tolist())


def to_str_tokens(model: "Decoder", input: str | Tensor | Sequence[int], prepend_bos: bool | None = None) -> list[str]:
    """Each token of one sequence as a string, as ``TransformerBridge.to_str_tokens``.

    Args:
        model: a decoder with a tokenizer.
        input: a string (tokenized with ``prepend_bos``) or token ids ``[pos]`` / ``[1, pos]``.

    Raises:
        ValueError: without a tokenizer, on a batch of more than one sequence, or on an id that is
            not a token of the tokenizer.
    """
    tokenizer = require_tokenizer(model, "to_str_tokens")
    tokens = to_tokens(model, input, prepend_bos) if isinstance(input, str) else torch.as_tensor(input)
    if tokens.ndim > 1 and tokens.shape[0] != 1 or tokens.ndim > 2:
        raise ValueError(f"to_str_tokens takes one sequence, got shape {tuple(tokens.shape)}")
    return [tokenizer.token_string(t) for t in tokens.reshape(-1).tolist()]


def sample_logits(
    logits: Float[Tensor, "batch d_vocab"],
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Int[Tensor, "batch"]:
    """The next token of each row: argmax, or a draw from softmax(logits / temperature).

    ``top_k`` keeps the k largest logits; ``top_p`` keeps the smallest set of tokens whose
    probability reaches p (nucleus sampling, Holtzman et al. 2020). ``temperature == 0`` is greedy,
    as in TransformerLens' ``sample_logits``.

    Raises:
        ValueError: on a negative temperature, ``top_k < 1`` or ``top_p`` outside (0, 1].
    """
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
    if not do_sample or temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _prompt(model, input, prepend_bos, attention_mask):
    """(tokens, attention mask, whether the input was text) of a generate() input."""
    if isinstance(input, str) or (isinstance(input, (list, tuple)) and input and isinstance(input[0], str)):
        if attention_mask is not None:
            raise ValueError("attention_mask is for token input; string input is masked by the tokenizer")
        tokens = to_tokens(model, input, prepend_bos=prepend_bos, padding_side="left")
        return tokens, (tokens != model.tokenizer.pad_id).long(), True
    if not isinstance(input, Tensor):
        raise TypeError(f"generate takes a str, a list of str or int64 tokens [batch, pos], got {type(input).__name__}")
    tokens = input[None] if input.ndim == 1 else input
    tokens = tokens.to(model.device)
    if attention_mask is None:
        attention_mask = torch.ones_like(tokens)
    return tokens, attention_mask.to(model.device).long(), False


@torch.no_grad()
def generate(
    model: "Decoder",
    input: str | Sequence[str] | Tensor = "",
    max_new_tokens: int = 10,
    stop_at_eos: bool = True,
    eos_token_id: int | None = None,
    do_sample: bool = True,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float = 1.0,
    use_past_kv_cache: bool = True,
    prepend_bos: bool | None = None,
    return_type: str = "input",
    attention_mask: Tensor | None = None,
    seed: int | None = None,
) -> str | list[str] | Int[Tensor, "batch pos"]:
    """Continue a prompt token by token, as ``TransformerBridge.generate``.

    With ``use_past_kv_cache`` each step runs only the new token against a
    :class:`~nopelens.models.KVCache`; without it each step reruns the whole sequence. Both give
    the same tokens (greedy) up to float round-off. A list of strings is left-padded, so every
    row continues from its own last token, with positions counted from its first real token.

    Args:
        model: the decoder.
        input: a string, a list of strings (needs a tokenizer) or int64 tokens ``[batch, pos]``
            or ``[pos]``.
        max_new_tokens: number of tokens to add, >= 0.
        stop_at_eos: stop a row once it emits ``eos_token_id``; later slots of a finished row
            hold ``eos_token_id``, and generation ends when every row has finished.
        eos_token_id: the end token; default the tokenizer's (byte-level text has none, so text
            models run the full ``max_new_tokens``).
        do_sample: sample (True, TransformerLens' default) or take the argmax (greedy).
        top_k, top_p, temperature: see :func:`sample_logits`.
        use_past_kv_cache: reuse keys and values of earlier steps.
        prepend_bos: for string input; None uses ``model.cfg.default_prepend_bos``.
        return_type: ``input`` (the input's kind: text for text, tokens for tokens), ``str`` or
            ``tokens``. Text output is the prompt plus its continuation.
        attention_mask: 0/1 ``[batch, pos]`` for padded token input.
        seed: seed of a private generator for sampling, so the same seed gives the same text
            whatever the global RNG state; None draws from torch's global RNG.

    Returns:
        The prompt and its continuation: text (one str, or a list for a list input) or int64
        tokens ``[batch, pos + max_new_tokens]`` (fewer when every row stopped at EOS).

    Raises:
        ValueError: on a bad argument, string input or text output without a tokenizer, or a
            learned-position model asked for more than ``n_ctx`` positions (checked before the
            first step). The model's own checks apply to token input (ids outside the vocabulary).
    """
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type must be one of {RETURN_TYPES}, got {return_type!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    sample_logits(torch.zeros(1, 1), do_sample, temperature, top_k, top_p)  # checks the arguments
    tokens, mask, text_input = _prompt(model, input, prepend_bos, attention_mask)
    limit = model.cfg.max_positions
    if limit is not None and int(mask.sum(-1).max()) + max_new_tokens > limit:
        raise ValueError(
            f"a prompt of {int(mask.sum(-1).max())} tokens plus max_new_tokens={max_new_tokens} is "
            f"longer than the learned position table (n_ctx={limit})"
        )
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "tokenizer", None), "eos_id", None)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(seed)
    cache = None
    if use_past_kv_cache:
        from .decoder import KVCache

        cache = KVCache.empty(model.cfg, tokens.shape[0], model.device)
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    for step in range(max_new_tokens):
        if cache is None:
            logits = model(tokens, attention_mask=mask)
        elif step == 0:
            logits = model(tokens, attention_mask=mask, past_kv=cache)
        else:
            logits = model(tokens[:, -1:], attention_mask=mask[:, -1:], past_kv=cache)
        new = sample_logits(logits[:, -1], do_sample, temperature, top_k, top_p, generator)
        if stop_at_eos and eos_token_id is not None:
            new = new.masked_fill(finished, eos_token_id)
            finished |= new == eos_token_id
        tokens = torch.cat([tokens, new[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(new)[:, None]], dim=1)
        if bool(finished.all()):
            break
    if return_type == "tokens" or (return_type == "input" and not text_input):
        return tokens
    texts = to_string(model, tokens)
    return texts[0] if isinstance(input, str) else texts
