"""Text in and out of a :class:`~nopelens.models.Decoder`: ``to_tokens``, ``to_string``, ``generate``.

The signatures mirror TransformerLens' (``TransformerBridge.to_tokens``, ``to_string``,
``generate``; TransformerLens 4.3 has no ``HookedTransformer``) so TransformerLens habits carry
over; the ``Decoder`` methods of the same names call
these functions, whose ``model`` is that ``Decoder`` (not imported here: the decoder imports this
module). Strings need a model with a tokenizer: byte-level text models (zoo ``text-*``
models, checkpoints trained on the ``text`` task) carry a
:class:`~nopelens.models.tasks.ByteTokenizer`; any model generates from token tensors.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .kv_cache import KVCache
from .progress import progress_bar

PADDING_SIDES = ("left", "right")
RETURN_TYPES = ("input", "str", "tokens")


def require_tokenizer(model, operation: str):
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
    model,
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


def to_string(model, tokens: Tensor | Sequence[int] | Sequence[Sequence[int]]) -> str | list[str]:
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


def to_str_tokens(model, input: str | Tensor | Sequence[int], prepend_bos: bool | None = None) -> list[str]:
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


def token_counts(tokens: Int[Tensor, "batch pos"], mask: Tensor | None, d_vocab: int) -> Float[Tensor, "batch d_vocab"]:
    """How often each token id occurs in each row of ``tokens``, counting real tokens only.

    Example:
        >>> token_counts(torch.tensor([[1, 1, 2]]), torch.tensor([[0, 1, 1]]), 4).tolist()
        [[0.0, 1.0, 1.0, 0.0]]
    """
    weights = torch.ones_like(tokens, dtype=torch.float32) if mask is None else mask.to(torch.float32)
    return torch.zeros(tokens.shape[0], d_vocab, device=tokens.device).scatter_add_(1, tokens, weights)


def sample_logits(
    logits: Float[Tensor, "batch d_vocab"],
    do_sample: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    freq_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    tokens: Int[Tensor, "batch pos"] | None = None,
    token_mask: Int[Tensor, "batch pos"] | None = None,
) -> Int[Tensor, " batch"]:
    """The next token of each row: argmax, or a draw from softmax(logits / temperature).

    In TransformerLens' order (``transformer_lens.utilities.sample_logits``): the repetition
    penalty (HF's: a logit l of a token already in ``tokens`` becomes l / r if l > 0, else l r;
    Keskar et al. 2019) applies to greedy and sampled steps; then, when sampling, logits are divided
    by the temperature, lowered by ``freq_penalty`` times the token's count in ``tokens``, and
    filtered: ``top_k`` keeps the k largest, ``top_p`` the smallest set whose probability reaches p
    (nucleus sampling, Holtzman et al. 2020). TransformerLens applies ``top_p`` only without
    ``top_k``; here both apply, in that order, as in HF. ``temperature == 0`` is greedy.

    Args:
        tokens, token_mask: the sequences so far and their real-token mask (padding is not
            counted); needed for the penalties.

    Raises:
        ValueError: on a negative or non-finite temperature or ``freq_penalty``, a
            ``repetition_penalty`` that is not a finite number > 0, ``top_k < 1``, ``top_p``
            outside (0, 1], or a penalty without ``tokens``.
    """
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
    if not math.isfinite(freq_penalty) or freq_penalty < 0:
        raise ValueError(f"freq_penalty must be a finite number >= 0, got {freq_penalty!r}")
    if not math.isfinite(repetition_penalty) or repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be a finite number > 0, got {repetition_penalty!r}")
    greedy = not do_sample or temperature == 0
    penalized = repetition_penalty != 1.0 or (freq_penalty > 0 and not greedy)
    if penalized and tokens is None:
        raise ValueError("freq_penalty and repetition_penalty need the tokens so far (tokens=...)")
    counts = token_counts(tokens, token_mask, logits.shape[-1]) if penalized else None
    logits = logits.float()
    if repetition_penalty != 1.0:
        factor = torch.where(logits > 0, 1.0 / repetition_penalty, repetition_penalty)
        logits = torch.where(counts > 0, logits * factor, logits)
    if greedy:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if freq_penalty > 0:
        logits = logits - freq_penalty * counts
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


def _is_text(input) -> bool:
    return isinstance(input, str) or (isinstance(input, (list, tuple)) and bool(input) and isinstance(input[0], str))


def _prompt(model, input, prepend_bos, padding_side, attention_mask):
    """(tokens, attention mask) of a generate() input; every row must end in a real token."""
    if padding_side not in (None, *PADDING_SIDES):
        raise ValueError(f"padding_side must be None or one of {PADDING_SIDES}, got {padding_side!r}")
    if _is_text(input):
        if attention_mask is not None:
            raise ValueError("attention_mask is for token input; string input is masked by the tokenizer")
        # left padding, whatever padding_side says (as TransformerBridge): each row then continues
        # from its own last token
        tokens = to_tokens(model, input, prepend_bos=prepend_bos, padding_side="left")
        return tokens, (tokens != model.tokenizer.pad_id).long()
    if not isinstance(input, Tensor):
        raise TypeError(f"generate takes a str, a list of str or int64 tokens [batch, pos], got {type(input).__name__}")
    tokens = (input[None] if input.ndim == 1 else input).to(model.device)
    if attention_mask is None and padding_side is not None:
        attention_mask = (tokens != require_tokenizer(model, "generate(padding_side=...)").pad_id).long()
        _check_padding_side(attention_mask, padding_side)
    if attention_mask is None:
        return tokens, torch.ones_like(tokens)
    mask = attention_mask.to(model.device).long()
    if mask.shape == tokens.shape and not bool(mask[:, -1].all()):
        row = int((mask[:, -1] == 0).nonzero()[0])
        raise ValueError(
            f"row {row} of the prompt ends in padding; generate continues each row after its last "
            "column, so pad prompts on the left (padding_side='left')"
        )
    return tokens, mask


def _check_padding_side(mask: Tensor, side: str) -> None:
    """Raise if the padding of ``mask`` is not all on ``side``."""
    real_first = mask.flip(-1) if side == "right" else mask  # padding must come first along this
    if bool((real_first.cummax(-1).values != real_first).any()):
        row = int((real_first.cummax(-1).values != real_first).any(-1).nonzero()[0])
        raise ValueError(f"row {row} of the tokens is not {side}-padded (padding_side={side!r})")


class _Stopper:
    """Which rows have finished: an end token, a stop string at the end of the text, or a
    stopping criterion (HF's contract: ``criterion(tokens, scores)`` -> bool ``[batch]`` or a bool)."""

    def __init__(self, model, batch: int, stop_at_eos, eos_token_id, stop_strings, stopping_criteria):
        if eos_token_id is None:
            eos_token_id = getattr(getattr(model, "tokenizer", None), "eos_id", None)
        ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.stop_tokens = ids if stop_at_eos else []
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        if stop_strings:
            require_tokenizer(model, "generate(stop_strings=...)")
        self.stop_strings = list(stop_strings or [])
        if stopping_criteria is not None and callable(stopping_criteria):
            stopping_criteria = [stopping_criteria]
        self.criteria = list(stopping_criteria or [])
        self.model = model
        fill = self.stop_tokens[0] if self.stop_tokens else getattr(getattr(model, "tokenizer", None), "pad_id", None)
        if fill is None and batch > 1 and (self.stop_strings or self.criteria):
            raise ValueError(
                "batched generation with stop_strings or stopping_criteria needs a token to fill "
                "finished rows with: pass eos_token_id, or use a model with a tokenizer"
            )
        self.fill = fill

    @property
    def active(self) -> bool:
        return bool(self.stop_tokens or self.stop_strings or self.criteria)

    def finished(self, tokens: Tensor, new: Tensor, scores: Tensor) -> Tensor:
        """Rows that stop with this step's token ``new`` (``tokens`` already ends with it)."""
        done = torch.isin(new, torch.tensor(self.stop_tokens, dtype=new.dtype, device=new.device))
        for row, text in enumerate(to_string(self.model, tokens) if self.stop_strings else []):
            done[row] |= any(text.endswith(stop) for stop in self.stop_strings)
        for criterion in self.criteria:
            verdict = torch.as_tensor(criterion(tokens, scores), device=new.device).to(torch.bool)
            if verdict.ndim > 1 or verdict.numel() not in (1, len(new)):
                raise ValueError(
                    f"a stopping criterion returned shape {tuple(verdict.shape)}; it must "
                    f"give one bool per row ({len(new)}) or a single bool"
                )
            done |= verdict
        return done


REFUSED = {
    "pixel_values": (NotImplementedError, "pixel_values: a Decoder is a text-only model"),
    "forced_bos_token_id": (ValueError, "forced_bos_token_id is only meaningful for encoder-decoder models"),
}
"""TransformerBridge.generate arguments that a Decoder refuses, by name, when they are set."""


@torch.no_grad()
def generate(
    model,
    input: str | Sequence[str] | Tensor = "",
    max_new_tokens: int = 10,
    stop_at_eos: bool = True,
    eos_token_id: int | Sequence[int] | None = None,
    do_sample: bool = True,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float = 1.0,
    freq_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    use_past_kv_cache: bool = True,
    prepend_bos: bool | None = None,
    padding_side: str | None = None,
    return_type: str | None = "input",
    verbose: bool = False,
    output_logits: bool = False,
    return_cache: bool = False,
    return_input_tokens: bool = False,
    names_filter=None,
    device=None,
    pixel_values: Tensor | None = None,
    stop_strings: str | Sequence[str] | None = None,
    stopping_criteria=None,
    attention_mask: Tensor | None = None,
    forced_bos_token_id: int | None = None,
    seed: int | None = None,
    **unsupported,
):
    """Continue a prompt token by token, with TransformerLens' ``TransformerBridge.generate``
    arguments (TransformerLens 4.3; ``HookedTransformer.generate`` is gone).

    With ``use_past_kv_cache`` each step runs only the new token against a
    :class:`~nopelens.models.KVCache`; without it each step reruns the whole sequence. Both give
    the same tokens (greedy) up to float round-off. A list of strings is left-padded, so every
    row continues from its own last token, with positions counted from its first real token.

    Args:
        model: the decoder.
        input: a string, a list of strings (needs a tokenizer) or int64 tokens ``[batch, pos]``
            or ``[pos]``.
        max_new_tokens: number of tokens to add, >= 0.
        stop_at_eos: stop a row once it emits an end token; later slots of a finished row hold
            the (first) end token, and generation ends when every row has finished.
        eos_token_id: the end token, or a list of them; default the tokenizer's (byte-level text
            has none, so text models run the full ``max_new_tokens``).
        do_sample: sample (True, TransformerLens' default) or take the argmax (greedy).
        top_k, top_p, temperature, freq_penalty, repetition_penalty: see :func:`sample_logits`;
            the penalties count the prompt's and the generated real tokens.
        use_past_kv_cache: reuse keys and values of earlier steps.
        prepend_bos: for string input; None uses ``model.cfg.default_prepend_bos``.
        padding_side: for token input without ``attention_mask``: read the mask off the
            tokenizer's PAD id, padding on this side (only ``left`` can be continued). String
            lists are always left-padded, as TransformerBridge does.
        return_type: ``input`` (or None: the input's kind, text for text, tokens for tokens),
            ``str`` or ``tokens``. Text output is the prompt plus its continuation; a list input
            gives a list (TransformerBridge gives a str for a list of one).
        verbose: show a progress bar over the steps (TransformerLens' default is on; here off).
        output_logits: return a ``transformers`` ``GenerateDecoderOnlyOutput`` with ``sequences``
            and ``logits``, one ``[batch, d_vocab]`` tensor of raw last-position logits per step.
        return_cache: also return ``model.run_with_cache`` of the output (with its attention
            mask), restricted by ``names_filter`` and stored on ``device``.
        return_input_tokens: also return the prompt's tokens as the model read them.
        stop_strings: a row stops once its text ends with one of these (needs a tokenizer).
        stopping_criteria: a callable or a list of them (HF ``StoppingCriteria``),
            ``criterion(tokens, scores)`` -> bool per row or one bool; a row stops when any says so.
        attention_mask: 0/1 ``[batch, pos]`` for left-padded token input.
        seed: seed of a private generator for sampling, so the same seed gives the same text
            whatever the global RNG state; None draws from torch's global RNG.
        pixel_values, forced_bos_token_id, **unsupported: refused by name when given
            (multimodal and encoder-decoder arguments of TransformerBridge).

    Returns:
        The prompt and its continuation: text (one str, or a list for a list input) or int64
        tokens ``[batch, pos + max_new_tokens]`` (fewer when every row stopped); or the
        ``output_logits`` object; followed, as asked, by the cache and the input tokens:
        ``(output, cache, input_tokens)``, ``(output, cache)`` or ``(output, input_tokens)``.

    Raises:
        ValueError: on a bad argument, string input or text output without a tokenizer, a
            prompt row that ends in padding, ``names_filter``/``device`` without
            ``return_cache``, or a learned-position model asked for more than ``n_ctx``
            positions (checked before the first step). The model's own checks apply to token
            input (ids outside the vocabulary).
        TypeError: on an argument TransformerBridge.generate does not have either.
        NotImplementedError: on ``pixel_values``.
    """
    if unsupported:
        raise TypeError(
            f"generate() got unexpected keyword arguments {sorted(unsupported)}; a Decoder is a "
            "text-only decoder (TransformerBridge passes these to multimodal models)"
        )
    for name, value in (("pixel_values", pixel_values), ("forced_bos_token_id", forced_bos_token_id)):
        if value is not None:
            error, message = REFUSED[name]
            raise error(message)
    return_type = "input" if return_type is None else return_type
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type must be one of {RETURN_TYPES} or None, got {return_type!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not return_cache and (names_filter is not None or device is not None):
        raise ValueError("names_filter and device choose what return_cache=True caches; pass return_cache=True")
    checked = dict(
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        freq_penalty=freq_penalty,
        repetition_penalty=repetition_penalty,
    )
    sample_logits(torch.zeros(1, 1), tokens=torch.zeros(1, 1, dtype=torch.long), **checked)  # checks them
    prompt, mask = _prompt(model, input, prepend_bos, padding_side, attention_mask)
    limit = model.cfg.max_positions
    if limit is not None and int(mask.sum(-1).max()) + max_new_tokens > limit:
        raise ValueError(
            f"a prompt of {int(mask.sum(-1).max())} tokens plus max_new_tokens={max_new_tokens} is "
            f"longer than the learned position table (n_ctx={limit})"
        )
    stopper = _Stopper(model, prompt.shape[0], stop_at_eos, eos_token_id, stop_strings, stopping_criteria)
    generator = torch.Generator(device=model.device).manual_seed(seed) if seed is not None else None
    tokens, step_logits = _generate_tokens(
        model, prompt, mask, max_new_tokens, stopper, use_past_kv_cache, generator, verbose, checked
    )
    mask = torch.cat([mask, torch.ones_like(tokens[:, prompt.shape[1] :])], dim=1)

    if output_logits:
        from transformers.generation.utils import GenerateDecoderOnlyOutput  # lazy: slow to import; logits only

        result = GenerateDecoderOnlyOutput(sequences=tokens, logits=tuple(step_logits))
    elif return_type == "tokens" or (return_type == "input" and not _is_text(input)):
        result = tokens
    else:
        texts = to_string(model, tokens)
        result = texts[0] if isinstance(input, str) else texts
    extras = []
    if return_cache:
        extras.append(model.run_with_cache(tokens, attention_mask=mask, names_filter=names_filter, device=device)[1])
    if return_input_tokens:
        extras.append(prompt)
    return (result, *extras) if extras else result


def _generate_tokens(model, tokens, mask, max_new_tokens, stopper, use_past_kv_cache, generator, verbose, sampling):
    """The decoding loop of :func:`generate`: tokens ``[batch, pos + new]`` and each step's logits."""
    cache = KVCache.empty(model.cfg, tokens.shape[0], model.device) if use_past_kv_cache else None
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    step_logits = []
    bar = progress_bar(total=max_new_tokens, desc="generate", disable=not verbose, leave=False)
    try:
        for step in range(max_new_tokens):
            if cache is None:
                logits = model(tokens, attention_mask=mask)
            elif step == 0:
                logits = model(tokens, attention_mask=mask, past_kv=cache)
            else:
                logits = model(tokens[:, -1:], attention_mask=mask[:, -1:], past_kv=cache)
            scores = logits[:, -1]
            step_logits.append(scores)
            new = sample_logits(scores, generator=generator, tokens=tokens, token_mask=mask, **sampling)
            if stopper.active and stopper.fill is not None:
                new = new.masked_fill(finished, stopper.fill)
            tokens = torch.cat([tokens, new[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(new)[:, None]], dim=1)
            bar.update(1)
            if stopper.active:
                finished |= stopper.finished(tokens, new, scores)
                if bool(finished.all()):
                    break
    finally:
        bar.close()
    return tokens, step_logits
