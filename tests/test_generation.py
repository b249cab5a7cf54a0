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
    kept = model.generate("x", max_new_tokens=8, do_sample=False, eos_token_id=eos, stop_at_eos=False, return_type="tokens")
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
    save_checkpoint(tmp_path / "copy", TrainedModel(Decoder(DecoderConfig(d_vocab=20, n_ctx=8)), {"task": {"name": "copy"}}))
    assert load_checkpoint(tmp_path / "copy").model.tokenizer is None
