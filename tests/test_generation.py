"""Byte-level text in and out of a Decoder: to_tokens, to_string, generate (issue 15)."""

import pytest
import torch

from nopelens.models import Decoder, DecoderConfig
from nopelens.models.checkpoint import TrainedModel, load_checkpoint, save_checkpoint
from nopelens.models.tasks import ByteTokenizer

TEXT = "héllo, wörld ✓\n"


def text_model(position="nope", n_ctx=64):
    # init_std 0.5 makes the logits far apart, so greedy choices do not hinge on round-off
    cfg = DecoderConfig(d_vocab=258, n_ctx=n_ctx, n_layers=2, d_model=32, n_heads=4, position=position, init_std=0.5)
    model = Decoder(cfg, seed=0).eval()
    model.set_tokenizer(ByteTokenizer())
    return model


@pytest.fixture(scope="module")
def model():
    return text_model()


def test_to_string_inverts_to_tokens(model):
    tokens = model.to_tokens(TEXT)
    assert tokens.shape == (1, len(TEXT.encode()) + 1) and tokens[0, 0] == 256
    assert model.to_string(tokens[0]) == TEXT
    assert model.to_string(tokens) == [TEXT]
    bare = model.to_tokens(TEXT, prepend_bos=False)
    assert bare[0].tolist() == list(TEXT.encode()) and model.to_string(bare[0]) == TEXT
    assert model.to_single_token("a") == 97
    assert model.to_str_tokens("hé") == ["<bos>", "h", "\\xc3", "\\xa9"]
    assert model.to_str_tokens(torch.tensor([[104, 105]])) == ["h", "i"]


def test_logit_attrs_take_a_one_byte_string(model):
    tokens = model.to_tokens("ab")
    logits, cache = model.run_with_cache(tokens)
    stack = cache.decompose_resid()
    by_string = cache.logit_attrs(stack, "b")
    torch.testing.assert_close(by_string, cache.logit_attrs(stack, 98))
    offset = model.b_U + model.ln_final.b @ model.W_U
    torch.testing.assert_close(by_string.sum(0), (logits - offset)[..., 98], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not a single token"):
        cache.logit_attrs(stack, "bc")


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_list_of_strings_is_padded(model, side):
    texts = ["a", "abc"]
    tokens = model.to_tokens(texts, padding_side=side)
    assert tokens.shape == (2, 4)
    expected = [257, 257, 256, 97] if side == "left" else [256, 97, 257, 257]
    assert tokens[0].tolist() == expected
    assert model.to_string(tokens) == texts


@pytest.mark.parametrize("position", ["nope", "rope", "alibi", "learned"])
def test_greedy_generation_with_the_kv_cache_equals_generation_without(position):
    model = text_model(position)
    cached = model.generate("The ", max_new_tokens=12, do_sample=False, return_type="tokens")
    uncached = model.generate("The ", max_new_tokens=12, do_sample=False, use_past_kv_cache=False, return_type="tokens")
    assert cached.shape == (1, 5 + 12)
    assert torch.equal(cached, uncached)
    step = model.to_tokens("The ")
    for _ in range(3):  # and each token is the argmax of a plain forward pass
        step = torch.cat([step, model(step)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached[:, :8], step)


def test_generate_returns_text_for_text(model):
    out = model.generate("ab", max_new_tokens=5, do_sample=False)
    assert isinstance(out, str) and out.startswith("ab")
    assert out == model.to_string(model.generate(model.to_tokens("ab"), max_new_tokens=5, do_sample=False)[0])


def test_a_left_padded_batch_generates_what_each_prompt_generates_alone(model):
    prompts = ["a", "Hello"]
    batch = model.generate(prompts, max_new_tokens=6, do_sample=False)
    alone = [model.generate(p, max_new_tokens=6, do_sample=False) for p in prompts]
    assert batch == alone


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    first = model.generate("x", max_new_tokens=20, seed=3, return_type="tokens")
    torch.manual_seed(123)  # the global RNG does not matter with a seed
    again = model.generate("x", max_new_tokens=20, seed=3, return_type="tokens")
    uncached = model.generate("x", max_new_tokens=20, seed=3, use_past_kv_cache=False, return_type="tokens")
    other = model.generate("x", max_new_tokens=20, seed=4, return_type="tokens")
    assert torch.equal(first, again) and torch.equal(first, uncached) and not torch.equal(first, other)
    greedy = model.generate("x", max_new_tokens=8, do_sample=False, return_type="tokens")
    assert torch.equal(model.generate("x", max_new_tokens=8, top_k=1, seed=0, return_type="tokens"), greedy)
    assert torch.equal(model.generate("x", max_new_tokens=8, temperature=0.0, return_type="tokens"), greedy)


def test_generation_stops_at_eos(model):
    greedy = model.generate("x", max_new_tokens=8, do_sample=False, return_type="tokens")
    eos = int(greedy[0, 2])  # the first generated token
    stopped = model.generate("x", max_new_tokens=8, do_sample=False, eos_token_id=eos, return_type="tokens")
    assert stopped.tolist() == greedy[:, :3].tolist()
    kept = model.generate(
        "x", max_new_tokens=8, do_sample=False, eos_token_id=eos, stop_at_eos=False, return_type="tokens"
    )
    assert torch.equal(kept, greedy)


def test_bad_input_errors_clearly(model):
    plain = Decoder(DecoderConfig(d_vocab=16, n_ctx=16, n_layers=1, d_model=16, n_heads=2), seed=0)
    with pytest.raises(ValueError, match="no tokenizer"):
        plain.to_tokens("abc")
    with pytest.raises(ValueError, match="no tokenizer"):
        plain.generate("abc")
    assert plain.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape == (1, 5)
    with pytest.raises(ValueError, match="vocabulary is \\[0, 16\\)"):
        plain.set_tokenizer(ByteTokenizer())
    with pytest.raises(ValueError, match="token id 300 at index 1"):
        model.to_string([97, 300])
    with pytest.raises(ValueError, match="token id -1"):
        model.to_string(torch.tensor([-1]))
    with pytest.raises(TypeError, match="str"):
        model.to_tokens(b"bytes")
    with pytest.raises(ValueError, match="gives no tokens"):
        model.to_tokens("", prepend_bos=False)
    with pytest.raises(ValueError, match="temperature"):
        model.generate("a", temperature=-1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.generate(torch.tensor([[1, 400]]))
    learned = text_model("learned", n_ctx=8)
    with pytest.raises(ValueError, match="learned position table"):
        learned.generate("abcd", max_new_tokens=4)


def test_text_checkpoints_carry_the_byte_tokenizer(tmp_path):
    model = text_model()
    model.set_tokenizer(None)
    save_checkpoint(tmp_path / "ckpt", TrainedModel(model, {"task": {"name": "text", "kwargs": {}}}))
    loaded = load_checkpoint(tmp_path / "ckpt").model
    assert isinstance(loaded.tokenizer, ByteTokenizer)
    assert loaded.to_string(loaded.to_tokens(TEXT)[0]) == TEXT
    save_checkpoint(
        tmp_path / "copy", TrainedModel(Decoder(DecoderConfig(d_vocab=20, n_ctx=8)), {"task": {"name": "copy"}})
    )
    assert load_checkpoint(tmp_path / "copy").model.tokenizer is None


# ------------------------------------------------------------------ TransformerLens' generate arguments (issue 22)
def test_generate_takes_every_argument_of_transformerbridge_generate():
    import inspect

    from transformer_lens.model_bridge import TransformerBridge

    from nopelens.models import generation

    ours = inspect.signature(generation.generate).parameters
    theirs = [
        n
        for n, p in inspect.signature(TransformerBridge.generate).parameters.items()
        if n != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    assert [n for n in theirs if n not in ours] == []
    assert list(ours)[1 : len(theirs) + 1] == theirs  # same order, so positional calls mean the same


def test_generate_refuses_by_name_what_a_decoder_cannot_do(model):
    with pytest.raises(NotImplementedError, match="pixel_values"):
        model.generate("a", pixel_values=torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="forced_bos_token_id"):
        model.generate("a", forced_bos_token_id=1)
    with pytest.raises(TypeError, match="image_sizes"):
        model.generate("a", image_sizes=[(4, 4)])
    with pytest.raises(ValueError, match="return_cache"):
        model.generate("a", names_filter="blocks.0.hook_resid_pre")
    for bad in (
        dict(freq_penalty=-1.0),
        dict(repetition_penalty=0.0),
        dict(padding_side="middle"),
        dict(return_type="text"),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            model.generate("a", **bad)


def test_verbose_shows_a_progress_bar(model, capsys):
    model.generate("a", max_new_tokens=3, do_sample=False, verbose=False)
    assert capsys.readouterr().err == ""
    model.generate("a", max_new_tokens=3, do_sample=False, verbose=True)
    assert "generate" in capsys.readouterr().err


def test_penalties_in_sample_logits_are_transformerlens_formulas():
    from nopelens.models.generation import sample_logits

    logits = torch.tensor([[0.5, 2.0, -1.0, 0.3, 1.5], [1.0, -2.0, 0.2, 0.1, 0.0]])
    tokens = torch.tensor([[1, 1, 2, 4], [1, 3, 3, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # the pad (token 0 in row 1) is not counted
    counts = torch.tensor([[0, 2, 1, 0, 1], [0, 1, 0, 2, 0]], dtype=torch.float32)
    # repetition penalty r = 2 (greedy too): seen positive logits / r, seen negative ones * r
    penalized = torch.where(counts > 0, torch.where(logits > 0, logits / 2, logits * 2), logits)
    assert penalized[0].argmax() == 1 and penalized[0, 2] == -2.0
    greedy = sample_logits(logits, do_sample=False, repetition_penalty=2.0, tokens=tokens, token_mask=mask)
    assert greedy.tolist() == penalized.argmax(-1).tolist() == [1, 0]
    assert sample_logits(logits, do_sample=False, repetition_penalty=5.0, tokens=tokens, token_mask=mask).tolist() == [
        0,
        0,
    ]
    # frequency penalty f (sampling only): logits / T - f * count, then the draw
    manual = (logits / 0.8 - 0.7 * counts).softmax(-1)
    for seed in range(5):
        drawn = sample_logits(
            logits,
            temperature=0.8,
            freq_penalty=0.7,
            tokens=tokens,
            token_mask=mask,
            generator=torch.Generator().manual_seed(seed),
        )
        reference = torch.multinomial(manual, 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1)
        assert drawn.tolist() == reference.tolist()
    assert sample_logits(logits, do_sample=False, freq_penalty=50.0, tokens=tokens).tolist() == [
        1,
        0,
    ]  # greedy ignores it
    with pytest.raises(ValueError, match="tokens so far"):
        sample_logits(logits, freq_penalty=0.5)


def test_generate_with_penalties_equals_a_decoding_loop_written_here(model):
    prompt = model.to_tokens("ab")

    def loop(pick, steps=10):
        tokens = prompt
        for _ in range(steps):
            logits = model(tokens)[:, -1]
            counts = torch.zeros_like(logits).scatter_add_(1, tokens, torch.ones_like(tokens, dtype=logits.dtype))
            tokens = torch.cat([tokens, pick(logits, counts)[:, None]], dim=1)
        return tokens

    def repetition(logits, counts):
        return torch.where(counts > 0, torch.where(logits > 0, logits / 3.0, logits * 3.0), logits).argmax(-1)

    penalized = model.generate(prompt, max_new_tokens=10, do_sample=False, repetition_penalty=3.0)
    assert torch.equal(penalized, loop(repetition))
    assert not torch.equal(penalized, model.generate(prompt, max_new_tokens=10, do_sample=False))  # it bites
    generator = torch.Generator().manual_seed(7)

    def frequency(logits, counts):
        return torch.multinomial((logits / 0.5 - 2.0 * counts).softmax(-1), 1, generator=generator).squeeze(-1)

    sampled = model.generate(prompt, max_new_tokens=10, temperature=0.5, freq_penalty=2.0, seed=7)
    assert torch.equal(sampled, loop(frequency))


def test_padding_side_reads_the_mask_off_the_pad_token(model):
    prompts = ["a", "Hello"]
    padded = model.to_tokens(prompts, padding_side="left")
    by_text = model.generate(prompts, max_new_tokens=4, do_sample=False, padding_side="right")  # text: always left
    by_tokens = model.generate(padded, max_new_tokens=4, do_sample=False, padding_side="left")
    assert model.to_string(by_tokens) == by_text
    mask = (padded != 257).long()
    assert torch.equal(by_tokens, model.generate(padded, max_new_tokens=4, do_sample=False, attention_mask=mask))
    right = model.to_tokens(prompts, padding_side="right")
    with pytest.raises(ValueError, match="row 0 of the prompt ends in padding"):
        model.generate(right, padding_side="right")
    with pytest.raises(ValueError, match="not left-padded"):
        model.generate(torch.tensor([[97, 257, 98]]), padding_side="left")
    with pytest.raises(ValueError, match="ends in padding"):
        model.generate(right, attention_mask=(right != 257).long())


def test_output_logits_cache_and_input_tokens(model):
    prompt = model.to_tokens("ab")
    out = model.generate("ab", max_new_tokens=4, do_sample=False, output_logits=True)
    assert out.sequences.shape == (1, 7) and len(out.logits) == 4
    for step, logits in enumerate(out.logits):  # the raw last-position logits of each step
        torch.testing.assert_close(logits, model(out.sequences[:, : 3 + step])[:, -1], atol=1e-5, rtol=1e-5)
    text, cache, tokens = model.generate(
        "ab",
        max_new_tokens=4,
        do_sample=False,
        return_cache=True,
        return_input_tokens=True,
        names_filter=["blocks.1.hook_resid_post"],
    )
    assert text == model.to_string(out.sequences[0]) and torch.equal(tokens, prompt)
    assert list(cache.keys()) == ["blocks.1.hook_resid_post"]
    _, reference = model.run_with_cache(out.sequences, names_filter="blocks.1.hook_resid_post")
    torch.testing.assert_close(cache["blocks.1.hook_resid_post"], reference["blocks.1.hook_resid_post"])
    assert model.generate("ab", max_new_tokens=2, do_sample=False, return_type=None) == model.to_string(
        out.sequences[0, :5]
    )


def test_stop_strings_stopping_criteria_and_several_end_tokens(model):
    greedy = model.generate("ab", max_new_tokens=10, do_sample=False, return_type="tokens")
    texts = [model.to_string(greedy[0, : 3 + k]) for k in range(11)]
    stop = texts[4][-1]  # the last character after four new tokens
    first = next(k for k in range(1, 11) if texts[k].endswith(stop))
    stopped = model.generate("ab", max_new_tokens=10, do_sample=False, stop_strings=stop, return_type="tokens")
    assert torch.equal(stopped, greedy[:, : 3 + first])
    seen = []

    def after_two(tokens, scores):
        seen.append((tokens.clone(), scores.clone()))
        return torch.tensor([tokens.shape[1] >= 5])

    by_criterion = model.generate(
        "ab", max_new_tokens=10, do_sample=False, stopping_criteria=[after_two], return_type="tokens"
    )
    assert torch.equal(by_criterion, greedy[:, :5])
    for tokens, scores in seen:  # the scores are the logits the new token was picked from
        torch.testing.assert_close(scores, model(tokens[:, :-1])[:, -1], atol=1e-5, rtol=1e-5)
    ends = [int(greedy[0, 5]), int(greedy[0, 4])]
    by_ends = model.generate("ab", max_new_tokens=10, do_sample=False, eos_token_id=ends, return_type="tokens")
    assert torch.equal(by_ends, greedy[:, :5])
