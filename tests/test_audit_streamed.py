"""The audit reduces each layer's attention as the forward pass reaches the next layer (issue 38,
item 6): it holds one layer's ``[head, T, T]`` scores and patterns at a time, not every layer's,
and its reductions equal the all-layers computation it replaced."""

import gc

import pytest
import torch
import transformers
from transformers import BloomConfig, BloomForCausalLM, LlamaConfig, LlamaForCausalLM

from nopelens.analyses.audit import Tolerance, audit, detector
from nopelens.analyses.audit.core import LAYER_REDUCERS, ROWS_HELD, STEPS, make_subject
from nopelens.analyses.audit.numerics import max_err
from nopelens.analyses.audit.probe import Run, layer_of, make_probe, stream
from nopelens.analyses.subjects import load_hf_dir
from nopelens.models import Decoder, DecoderConfig
from nopelens.models.hooks import act_name
from nopelens.models.methods import SCORE_BIAS
from nopelens.models.positions import position_ids_from_mask

transformers.logging.set_verbosity_error()
HEADS = 4


def llama(n_layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=n_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def bloom() -> BloomForCausalLM:
    torch.manual_seed(0)
    config = BloomConfig(hidden_size=32, n_layer=3, n_head=HEADS, vocab_size=64)
    config._attn_implementation = "eager"
    return BloomForCausalLM(config)


SUBJECTS = {
    "llama": lambda: llama(3),
    "bloom": bloom,  # ALiBi handed as a tensor: the bias is dropped through it (step 3)
    "decoder-alibi-shaw-t5": lambda: Decoder(
        DecoderConfig(d_vocab=64, n_ctx=32, n_layers=3, d_model=32, n_heads=HEADS, position=["alibi", "shaw", "t5"]),
        seed=0,
    ),
}


def all_layers_run(subject, probe, tol) -> Run:
    """The audit's former run: every layer's hooks cached at once, each step's per-layer part read
    from that cache."""
    with subject.capture_position_ids() as seen:
        logits, cache = subject.model.run_with_cache(
            probe.tokens, attention_mask=probe.mask, names_filter=lambda n: n in set(_audited(subject))
        )
    run = Run(subject, probe, logits, dict(cache.items()), seen[0] if seen else None, tol)
    run.records = {r: {layer: r(run, layer) for layer in range(subject.n_layers)} for r in LAYER_REDUCERS}
    return run


def _audited(subject):
    from nopelens.analyses.audit.subjects import audited_hook

    return [name for name in subject.model.hook_dict if audited_hook(name)]


def separate_runs_detector(subject, tokens, mask, tol) -> list:
    """The detector as three forward passes (original ids; re-spaced and shifted ids with every
    block's input held at the original pass's), every layer's site kept."""
    ids = position_ids_from_mask(mask)
    quantity = "scores" if subject.scores_trusted else "pattern"
    sites = [act_name({"scores": "attn_scores", "pattern": "pattern"}[quantity], l) for l in range(subject.n_layers)]
    inputs = [act_name("resid_pre", l) for l in range(subject.n_layers)]

    def run(position_ids, patch=None):
        kept = {}

        def keep(name):
            def hook(x, hook):
                kept[name] = x.detach().clone()
                return None if patch is None or name not in patch else patch[name]

            return hook

        subject.forward(tokens, mask, position_ids, [(n, keep(n)) for n in sites + inputs])
        return kept

    base = run(ids)
    held = {n: base[n] for n in inputs}
    changed = run(detector.respaced_ids(ids, mask, 0, subject.max_positions), held)
    shifted = run(ids + detector.SHIFT, held)
    return [
        detector._reading(
            subject,
            l,
            detector.declared_reading(subject, l),
            quantity,
            mask,
            tol,
            base[sites[l]],
            changed[sites[l]],
            shifted[sites[l]],
        )
        for l in range(subject.n_layers)
    ]


@pytest.mark.parametrize("name", list(SUBJECTS))
def test_streamed_reductions_equal_the_all_layers_computation(name):
    subject, _ = make_subject(SUBJECTS[name](), None)
    subject.position_limit = 64
    tol = Tolerance.for_dtype(subject.compute_dtype)
    subject.model.eval()
    with torch.no_grad():
        probe = make_probe(subject, 12, 0, None)
        streamed, cached = stream(subject, probe, tol, LAYER_REDUCERS), all_layers_run(subject, probe, tol)
        assert torch.equal(streamed.logits, cached.logits)
        assert list(streamed.cache) == [n for n in cached.cache if not n.startswith("blocks.") or ".attn." not in n]
        per_layer = {}  # the [.., T, T] bytes of each layer's hooks: the streamed pass holds one layer's at most
        for name, x in cached.cache.items():
            if layer_of(name) is not None and tuple(x.shape[-2:]) == (12, 12):
                per_layer[layer_of(name)] = per_layer.get(layer_of(name), 0) + x.numel() * x.element_size()
        assert streamed.peak_attention_bytes == max(per_layer.values()) < sum(per_layer.values())
        for reducer in LAYER_REDUCERS:  # each step's per-layer statistics, exactly
            assert streamed.layer_records(reducer) == cached.layer_records(reducer), reducer.__name__
        assert [r.to_dict() for r in streamed.readings] == [
            r.to_dict() for r in separate_runs_detector(subject, probe.tokens, probe.mask, tol)
        ]
        cached._readings = streamed.readings
        for number, step in enumerate(STEPS[:7], 1):  # every step read from the streamed records, as from the cache
            assert step(streamed, 3, {}) == step(cached, 3, {}), number
        if subject.layers_acting(SCORE_BIAS):  # the bias dropped in a second copy of the batch, as in a second pass
            kept = {}
            names = [act_name(n, l) for l in subject.layers_acting(SCORE_BIAS) for n in ("attn_scores", "pattern")]
            assert subject.forward_without_bias(
                probe.tokens, probe.mask, [(n, lambda x, hook, n=n: kept.__setitem__(n, x.clone())) for n in names]
            )
            change = [
                max_err(cached.cache[act_name("attn_scores", l)], kept[act_name("attn_scores", l)], cached.allowed(l))
                for l in subject.layers_acting(SCORE_BIAS)
            ]
            assert STEPS[2](streamed, 3, {}).evidence["drop_bias_score_change"] == change


def live_attention_bytes(length: int) -> int:
    """Bytes of the distinct storages of live tensors whose last two axes are [length, length]."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and tuple(obj.shape[-2:]) == (length, length):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def peak_held(directory, length: int) -> tuple[int, object]:
    """The most [.., T, T] bytes alive as any full-length pass enters its last layer, over one audit."""
    model = load_hf_dir(directory)
    last = model.cfg.n_layers - 1
    peak = [0]

    def count(x, hook):
        if x.shape[1] == length:  # the audit's full-length passes (not its one-token decoding steps)
            peak[0] = max(peak[0], live_attention_bytes(length))

    model.hook_dict[act_name("q", last)].add_hook(count, is_permanent=True)
    report = audit(model, eval_length=length)
    model.reset_hooks(including_permanent=True)
    return peak[0], report


def test_an_hf_audit_holds_one_layers_attention_at_a_time_at_4x_the_length(tmp_path):
    """A tiny Llama saved with save_pretrained: the attention its audit holds is the same with 4 layers
    as with 2 (one layer's at a time), at most ROWS_HELD rows of scores and patterns (the model's own
    masks included), at T and at 4T. Caching every layer, it held 2 x 2 x layers rows (and the
    detector 3 x 2 x layers), which both assertions refuse."""
    peaks = {}
    for n_layers, length in ((2, 16), (4, 16), (4, 64)):
        if not (tmp_path / str(n_layers)).exists():
            llama(n_layers).save_pretrained(tmp_path / str(n_layers))
        peaks[n_layers, length], report = peak_held(tmp_path / str(n_layers), length)
        assert report.passed, report.summary()
    assert peaks[4, 16] == peaks[2, 16] > 0
    one_layer = ROWS_HELD * 2 * HEADS * 4  # bytes per T^2: 6 rows of scores and patterns, float32
    assert peaks[4, 16] <= one_layer * 16**2 and peaks[4, 64] <= one_layer * 64**2
