"""TransformerLens' own tools on a Decoder, against manual computations (issue 22, sections 1 and 2).

- ``transformer_lens.patching``: every ``get_act_patch_*`` that applies to a Decoder gives exactly 1
  and 0 where theory fixes the answer (a hand-set model) and equals a patching loop written here;
- ``head_detector.detect_head`` scores hand-set previous-token and current-token heads (NoPE circuit,
  RoPE, ALiBi) with the score computed here from the head's score formula;
- ``model.cfg`` carries device, dtype, n_key_value_heads and use_attn_result, which follow the model
  and never enter its serialized config;
- ``run_with_cache``: ``remove_batch_dim``, ``pos_slice`` on ``[batch, pos, head_index, d_head]`` hooks,
  ``incl_bwd`` (against autograd); gated hook points refuse hooks; ``return_type`` and the loss.
"""

import copy
import dataclasses
import itertools
import math
import pickle
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformer_lens.utilities as tl_utils
from transformer_lens import head_detector, patching

from nopelens.circuits import previous_token
from nopelens.models import Decoder, DecoderConfig
from nopelens.models.tasks import ByteTokenizer
from nopelens.models.tl_compat import PER_HEAD_HOOKS, DecoderCache, closed_hook_reason
from nopelens.models.zoo import recipe

METHODS = ["nope", "rope", "alibi"]
ATOL = 1e-12  # float64: the fused and explicit norm/attention kernels agree to ~1e-16


def make(position="nope", n_layers=2, d_mlp=8, normalization="layernorm", d_vocab=11, **kw):
    cfg = DecoderConfig(
        d_vocab=d_vocab,
        n_ctx=16,
        n_layers=n_layers,
        d_model=16,
        n_heads=2,
        d_mlp=d_mlp,
        normalization=normalization,
        position=position,
        init_std=0.5,
        **kw,
    )
    return Decoder(cfg, seed=0, dtype=torch.float64).eval()


def close(a, b, atol=ATOL):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=atol, rtol=0
    )


def close_store(patched, expected):
    """TransformerLens' patching stores its results in a float32 tensor (``torch.zeros(...,
    device=cfg.device)``), so a float64 metric comes back rounded to float32."""
    assert patched.dtype == torch.float32
    torch.testing.assert_close(patched.double(), expected.float().double(), atol=1e-7, rtol=1e-6)


def quiet(fn, *args, **kwargs):
    """TransformerLens' patching draws a tqdm bar per sweep; keep the test log readable."""
    import tqdm.auto

    original = tqdm.auto.tqdm.__init__

    def silent(self, *a, **k):
        k["disable"] = True
        original(self, *a, **k)

    tqdm.auto.tqdm.__init__ = silent
    try:
        return fn(*args, **kwargs)
    finally:
        tqdm.auto.tqdm.__init__ = original


# --------------------------------------------------------------------------------- model.cfg runtime state
def test_runtime_state_follows_the_model_and_stays_out_of_the_serialized_config():
    cfg = DecoderConfig(d_vocab=11, n_ctx=16, n_layers=2, d_model=16, n_heads=2, position="rope")
    assert (cfg.device, cfg.dtype, cfg.use_attn_result, cfg.n_key_value_heads) == (None, None, False, None)
    model = Decoder(cfg, seed=0)
    twin = Decoder(cfg, seed=1)  # the same config object: each model owns a copy
    assert model.cfg == cfg and model.cfg is not cfg and hash(model.cfg) == hash(cfg)
    assert (model.cfg.device, model.cfg.dtype) == (torch.device("cpu"), torch.float32)
    model.to(torch.float64)
    assert model.cfg.dtype == torch.float64 == model.W_E.dtype and twin.cfg.dtype == torch.float32
    model.half()
    assert model.cfg.dtype == torch.float16
    model.set_use_attn_result(True)
    assert model.cfg.use_attn_result and not twin.cfg.use_attn_result and not cfg.use_attn_result
    model.to("meta")  # a device move without a GPU
    assert model.cfg.device == torch.device("meta")
    copied = copy.deepcopy(twin).to(torch.float64)
    assert copied.cfg.dtype == torch.float64 and twin.cfg.dtype == torch.float32
    assert pickle.loads(pickle.dumps(copied)).cfg.dtype == torch.float64
    assert Decoder(model.cfg).cfg.use_attn_result is False  # a new model starts with the flag off
    for bound in (model.cfg, copied.cfg):  # nothing runtime is serialized
        assert bound.to_dict() == cfg.to_dict() and bound.to_json() == cfg.to_json()
        assert set(bound.to_dict()) == {f.name for f in dataclasses.fields(DecoderConfig)} - {
            "t5_num_buckets",
            "t5_max_distance",
            "t5_shared",
            "score_scale",
        }
        assert dataclasses.replace(bound).device is None
    spec = recipe("copy-rope-3l")
    bound_spec = dataclasses.replace(spec, config=Decoder(spec.config).to(torch.float64).cfg)
    assert bound_spec.digest == spec.digest  # zoo cache folders keep their names
    with pytest.raises(AttributeError, match="not runtime state"):
        cfg._set_runtime(n_layers=3)


def test_utilities_that_write_model_cfg_refuse_by_field_name():
    model = make()
    with pytest.raises(dataclasses.FrozenInstanceError, match="device"):
        tl_utils.move_to_and_update_config(model, "cpu", print_details=False)
    assert model.cfg.device == torch.device("cpu")


# --------------------------------------------------------------------------------- patching: known answers
def known_answer_model(position):
    """One block whose head 0 reads positions only (W_K = b_K = 0, so its pattern is the same for
    every input) and whose head 1 and MLP write nothing (W_O[1] = 0, W_out = 0)."""
    model = make(position, n_layers=1)
    model.set_fused_attention(False)
    with torch.no_grad():
        attn = model.blocks[0].attn
        attn.W_K[0] = 0.0
        attn.b_K[0] = 0.0
        attn.W_O[1] = 0.0
        model.blocks[0].mlp.W_out.zero_()
    return model


def recovered(model, clean, corrupted):
    """Metric: the share of the clean-minus-corrupted final-position logits that a run recovers
    (exactly 1 for the clean logits, exactly 0 for the corrupted ones)."""
    with torch.no_grad():
        clean_logits, corrupt_logits = model(clean)[:, -1], model(corrupted)[:, -1]
    delta = clean_logits - corrupt_logits
    return lambda logits: ((logits[:, -1] - corrupt_logits) * delta).sum() / (delta * delta).sum()


CLEAN = torch.tensor([[3, 1, 4, 1, 5], [2, 6, 5, 3, 8]])
P = 2  # the position where the corrupted prompt differs
CORRUPTED = CLEAN.clone()
CORRUPTED[:, P] = 7


def one_hot(*shape, at):
    out = torch.zeros(shape, dtype=torch.float64)
    out[at] = 1.0
    return out


@pytest.mark.parametrize("position", METHODS)
def test_patching_gives_one_where_theory_says_and_zero_elsewhere(position):
    """Only position P differs. The head's pattern is input-independent, so at the last position T-1
    only head 0's value at P carries the difference: restoring resid_pre at P, attn_out, resid_mid or
    head 0's z at T-1, or head 0's v at P restores the clean output (1); q, k, the pattern, the dead
    head 1 and the zero MLP change nothing (0)."""
    model = known_answer_model(position)
    _, cache = model.run_with_cache(CLEAN)
    metric = recovered(model, CLEAN, CORRUPTED)
    T, last = CLEAN.shape[1], CLEAN.shape[1] - 1
    run = lambda fn: quiet(fn, model, CORRUPTED, cache, metric)  # noqa: E731
    close(run(patching.get_act_patch_resid_pre), one_hot(1, T, at=(0, P)))
    for fn in (patching.get_act_patch_resid_mid, patching.get_act_patch_attn_out):
        close(run(fn), one_hot(1, T, at=(0, last)))
    close(run(patching.get_act_patch_mlp_out), torch.zeros(1, T))
    close(run(patching.get_act_patch_attn_head_out_by_pos), one_hot(1, T, 2, at=(0, last, 0)))
    close(run(patching.get_act_patch_attn_head_v_by_pos), one_hot(1, T, 2, at=(0, P, 0)))
    for fn in (patching.get_act_patch_attn_head_q_by_pos, patching.get_act_patch_attn_head_k_by_pos):
        close(run(fn), torch.zeros(1, T, 2))
    close(run(patching.get_act_patch_attn_head_pattern_by_pos), torch.zeros(1, 2, T))
    close(run(patching.get_act_patch_attn_head_pattern_dest_src_pos), torch.zeros(1, 2, T, T))
    head0 = one_hot(1, 2, at=(0, 0))
    close(
        run(patching.get_act_patch_attn_head_all_pos_every),
        torch.stack([head0, 0 * head0, 0 * head0, head0, 0 * head0]),
    )
    close(
        run(patching.get_act_patch_block_every),
        torch.stack([one_hot(1, T, at=(0, P)), one_hot(1, T, at=(0, last)), torch.zeros(1, T)]),
    )
    by_pos = run(patching.get_act_patch_attn_head_by_pos_every)
    assert by_pos.shape == (5, 1, T, 2)
    close(by_pos[0], one_hot(1, T, 2, at=(0, last, 0)))
    close(by_pos[3], one_hot(1, T, 2, at=(0, P, 0)))
    close(by_pos[[1, 2, 4]], torch.zeros(3, 1, T, 2))
    result = quiet(patching.get_act_patch_resid_pre, model, CORRUPTED, cache, metric, baseline=True)
    close(result.baseline, 0.0)  # the unpatched corrupted run recovers nothing


# --------------------------------------------------------------------------------- patching: a loop written here
def set_pos(act, clean, pos):
    act[:, pos] = clean[:, pos]


def set_pos_head(act, clean, pos, head):
    act[:, pos, head] = clean[:, pos, head]


def set_head(act, clean, head):
    act[:, :, head] = clean[:, :, head]


def set_pattern(act, clean, *index):  # [batch, head_index, dest_pos, src_pos]
    act[(slice(None), *index)] = clean[(slice(None), *index)]


def manual_patch(model, cache, metric, hook, axes, setter):
    """Patch one cell at a time with a hook written here; axes are (layer, ...) sizes."""
    out = torch.zeros(axes, dtype=torch.float64)
    for cell in itertools.product(*(range(n) for n in axes)):
        name = f"blocks.{cell[0]}.{hook}"

        def patch(act, hook, cell=cell, name=name):
            act = act.clone()
            setter(act, cache[name], *cell[1:])
            return act

        with torch.no_grad():
            out[cell] = metric(model.run_with_hooks(CORRUPTED, fwd_hooks=[(name, patch)]))
    return out


@pytest.mark.parametrize("position", ["nope", *(pytest.param(m, marks=pytest.mark.slow) for m in METHODS[1:])])
def test_every_patching_function_equals_a_patching_loop_written_here(position):
    model = make(position)  # random weights, two blocks
    _, cache = model.run_with_cache(CLEAN)
    metric = recovered(model, CLEAN, CORRUPTED)
    L, T, H = 2, CLEAN.shape[1], 2
    by_pos, all_pos, pattern = (L, T, H), (L, H), "attn.hook_pattern"
    expected = {
        "resid_pre": manual_patch(model, cache, metric, "hook_resid_pre", (L, T), set_pos),
        "resid_mid": manual_patch(model, cache, metric, "hook_resid_mid", (L, T), set_pos),
        "attn_out": manual_patch(model, cache, metric, "hook_attn_out", (L, T), set_pos),
        "mlp_out": manual_patch(model, cache, metric, "hook_mlp_out", (L, T), set_pos),
        "attn_head_pattern_all_pos": manual_patch(model, cache, metric, pattern, all_pos, set_pattern),
        "attn_head_pattern_by_pos": manual_patch(model, cache, metric, pattern, (L, H, T), set_pattern),
        "attn_head_pattern_dest_src_pos": manual_patch(model, cache, metric, pattern, (L, H, T, T), set_pattern),
    }
    for kind, hook in (("out", "z"), ("q", "q"), ("k", "k"), ("v", "v")):
        expected[f"attn_head_{kind}_by_pos"] = manual_patch(
            model, cache, metric, f"attn.hook_{hook}", by_pos, set_pos_head
        )
        expected[f"attn_head_{kind}_all_pos"] = manual_patch(
            model, cache, metric, f"attn.hook_{hook}", all_pos, set_head
        )
    for name, value in expected.items():
        close_store(quiet(getattr(patching, f"get_act_patch_{name}"), model, CORRUPTED, cache, metric), value)
    stack = lambda names: torch.stack([expected[n] for n in names])  # noqa: E731
    heads = [f"attn_head_{k}" for k in ("out", "q", "k", "v", "pattern")]
    close_store(
        quiet(patching.get_act_patch_block_every, model, CORRUPTED, cache, metric),
        stack(["resid_pre", "attn_out", "mlp_out"]),
    )
    close_store(
        quiet(patching.get_act_patch_attn_head_all_pos_every, model, CORRUPTED, cache, metric),
        stack([h + "_all_pos" for h in heads]),
    )
    every = torch.stack(
        [expected[h + "_by_pos"] if "pattern" not in h else expected[h + "_by_pos"].transpose(1, 2) for h in heads]
    )
    close_store(quiet(patching.get_act_patch_attn_head_by_pos_every, model, CORRUPTED, cache, metric), every)


def test_patching_hook_result_needs_use_attn_result_and_then_equals_patching_z():
    model = make("rope")
    metric = recovered(model, CLEAN, CORRUPTED)
    model.set_use_attn_result(True)
    _, cache = model.run_with_cache(CLEAN)  # holds hook_result

    def patch_result():
        return quiet(
            patching.generic_activation_patch,
            model,
            CORRUPTED,
            cache,
            metric,
            patching.layer_pos_head_vector_patch_setter,
            "result",
            ("layer", "pos", "head"),
        )

    by_result = patch_result()  # each head's output z_h W_O[h]: the same patch as its z
    close(by_result, quiet(patching.get_act_patch_attn_head_out_by_pos, model, CORRUPTED, cache, metric), atol=1e-6)
    assert by_result.abs().max() > 0.01
    model.set_use_attn_result(False)
    with pytest.raises(ValueError, match="use_attn_result is False"):
        patch_result()  # a hook that never fires would report "no effect" everywhere


def test_patching_refuses_what_a_decoder_does_not_have():
    attn_only = make(d_mlp=0)
    _, cache = attn_only.run_with_cache(CLEAN)
    metric = recovered(attn_only, CLEAN, CORRUPTED)
    with pytest.raises(KeyError, match="attention-only"):
        quiet(patching.get_act_patch_mlp_out, attn_only, CORRUPTED, cache, metric)
    _, full = make().run_with_cache(CLEAN)
    with pytest.raises(ValueError, match="attention-only"):  # even given a cache that has it
        quiet(patching.get_act_patch_mlp_out, attn_only, CORRUPTED, full, metric)
    model = make()
    _, clean_cache = model.run_with_cache(CLEAN)
    _, corrupt_cache = model.run_with_cache(CORRUPTED)
    with pytest.raises(NotImplementedError, match="use_split_qkv_input"):
        patching.get_act_patch_direct_path(model, CORRUPTED, clean_cache, corrupt_cache, metric, 0, 0, verbose=False)
    with pytest.raises(ValueError, match="evaluation mode"):
        quiet(patching.get_act_patch_resid_pre, model.train(), CORRUPTED, clean_cache, metric)


# --------------------------------------------------------------------------------- head detector
class DigitTokenizer:
    """'1'..'6' are ids 1..6 and BOS is 0, the circuits' BOS token; 7 pads."""

    bos_id, pad_id, eos_id, d_vocab = 0, 7, None, 8

    def encode(self, text):
        return [int(c) for c in text]


def softmax_rows(score):
    """Causal softmax of a [query, key] score table."""
    i, j = torch.meshgrid(torch.arange(score.shape[0]), torch.arange(score.shape[1]), indexing="ij")
    return score.masked_fill(j > i, float("-inf")).softmax(-1)


def mul_score(pattern, detection):
    """detect_head's "mul" score: the share of the head's attention inside the detection pattern."""
    return float((pattern * detection).sum() / pattern.sum())


def previous_token_pattern(T):
    return torch.diag(torch.ones(T - 1, dtype=torch.float64), -1)


def rope_heads(beta=20.0):
    """RoPE, queries and keys from biases only: in the first rotated pair (theta_0 = 1 rad per
    position) k_j = R(j) e_0 and q_i = beta R(i) R(-1) e_0 (head 0) or beta R(i) e_0 (head 1), so
    q_i . k_j = beta cos(j - i + 1) peaks at j = i - 1 (previous token) or beta cos(j - i) at j = i
    (for |j - i| < 5: cos comes back up at 2 pi)."""
    model = make("rope", n_layers=1, d_vocab=258)
    model.set_tokenizer(ByteTokenizer())
    with torch.no_grad():
        attn = model.blocks[0].attn
        for weight in (attn.W_Q, attn.W_K, attn.b_Q, attn.b_K):
            weight.zero_()
        half = model.cfg.d_head // 2
        attn.b_K[:, 0] = 1.0
        attn.b_Q[0, 0], attn.b_Q[0, half] = beta * math.cos(1.0), -beta * math.sin(1.0)
        attn.b_Q[1, 0] = beta
    offsets = lambda T: (torch.arange(T)[None, :] - torch.arange(T)[:, None]).double()  # noqa: E731  j - i
    scale = beta / math.sqrt(model.cfg.d_head)

    def expected(T):
        return [
            softmax_rows(scale * torch.cos(offsets(T) + 1.0)),
            softmax_rows(scale * torch.cos(offsets(T))),
        ]

    return model, expected


def alibi_heads():
    """ALiBi with W_Q = W_K = 0: head h scores -m_h (i - j), m_h = 2^-(h+1) for 8 heads."""
    model = Decoder(
        DecoderConfig(d_vocab=258, n_ctx=16, n_layers=1, d_model=32, n_heads=8, position="alibi"),
        seed=0,
        dtype=torch.float64,
    ).eval()
    model.set_tokenizer(ByteTokenizer())
    with torch.no_grad():
        attn = model.blocks[0].attn
        for weight in (attn.W_Q, attn.W_K):
            weight.zero_()
    distance = lambda T: (torch.arange(T)[:, None] - torch.arange(T)[None, :]).double()  # noqa: E731
    expected = lambda T: [softmax_rows(-(2.0 ** -(h + 1)) * distance(T)) for h in range(8)]  # noqa: E731
    return model, expected


@pytest.mark.parametrize("heads", [rope_heads, alibi_heads])
def test_detect_head_scores_hand_set_heads_as_their_score_formula_says(heads):
    model, expected = heads()
    text = "abcde"
    T = len(text) + 1  # BOS
    patterns = expected(T)
    prev = head_detector.detect_head(model, text, "previous_token_head")
    current = head_detector.detect_head(model, text, torch.eye(T))
    assert prev.shape == current.shape == (1, model.cfg.n_heads) and prev.dtype == model.cfg.dtype
    close(prev[0], [mul_score(p, previous_token_pattern(T)) for p in patterns])
    close(current[0], [mul_score(p, torch.eye(T)) for p in patterns])
    no_bos = head_detector.detect_head(model, text, "previous_token_head", exclude_bos=True)
    without_bos = [p.clone().index_fill_(1, torch.tensor([0]), 0.0) for p in patterns]
    close(no_bos[0], [mul_score(p, previous_token_pattern(T)) for p in without_bos])
    if heads is rope_heads:  # the hand-set previous-token head and current-token head are found
        assert int(prev[0].argmax()) == 0 and int(current[0].argmax()) == 1
        assert prev[0, 0] > 0.8 * (T - 1) / T  # row 0 has no previous token
    else:  # the steepest ALiBi slope is the most current-token head, and the order follows m
        assert current[0].tolist() == sorted(current[0].tolist(), reverse=True)


def test_detect_head_finds_the_nope_previous_token_circuit():
    """NoPE: the Kazemnejad-style circuit's layer-1 head scores c (2 (i - 1) j - j^2) (+ a row
    constant), from the position the layer-0 counter writes; layer 0's head is uniform, 1 / (i + 1)."""
    sharpness = 4.0
    model = previous_token(n_ctx=16, sharpness=sharpness, dtype=torch.float64).eval()
    model.set_tokenizer(DigitTokenizer())
    text = "314152"
    T = len(text) + 1
    i, j = torch.meshgrid(torch.arange(T).double(), torch.arange(T).double(), indexing="ij")
    uniform = softmax_rows(torch.zeros(T, T, dtype=torch.float64))
    circuit = softmax_rows(sharpness * (2 * (i - 1) * j - j * j))
    scores = head_detector.detect_head(model, text, "previous_token_head")
    close(
        scores[:, 0],
        [mul_score(uniform, previous_token_pattern(T)), mul_score(circuit, previous_token_pattern(T))],
        atol=1e-9,
    )
    assert scores[1, 0] > 0.9 * (T - 1) / T and scores[1, 0] > 2 * scores[0, 0]
    abs_score = head_detector.detect_head(model, text, "previous_token_head", error_measure="abs")
    expected_abs = 1 - round(float((circuit - previous_token_pattern(T)).abs().mean() * T), 3)
    assert abs_score[1, 0] == pytest.approx(expected_abs, abs=1e-12)


def test_test_prompt_prints_the_ranks_of_the_answer_tokens():
    model = make("alibi", n_layers=1, d_vocab=258)
    model.set_tokenizer(ByteTokenizer())
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        tl_utils.test_prompt("The cat", "sat", model, prepend_space_to_answer=False, print_details=False)
    tokens = model.to_tokens("The catsat")
    with torch.no_grad():
        probs = model(tokens)[0].softmax(-1)
    ranks = [(c, int((probs[i - 1] > probs[i - 1, tokens[0, i]]).sum())) for i, c in zip(range(8, 11), "sat")]
    assert f"Ranks of the answer tokens: {ranks}" in printed.getvalue().replace("\n", " ")


# --------------------------------------------------------------------------------- run_with_cache
def test_remove_batch_dim_gives_a_cache_that_knows_it():
    model = make("rope")
    tokens = CLEAN[:1]
    _, batched = model.run_with_cache(tokens)
    logits, single = model.run_with_cache(tokens, remove_batch_dim=True)
    assert isinstance(single, DecoderCache) and batched.has_batch_dim and not single.has_batch_dim
    for name, value in batched.items():
        close(single[name], value[0])
    assert single.remove_batch_dim() is single and single["hook_embed"].shape == (5, 16)  # a no-op, as in TL
    batched.remove_batch_dim()  # TL's own removal agrees
    assert not batched.has_batch_dim and batched["blocks.0.attn.hook_pattern"].shape == (2, 5, 5)
    stack, labels = single.accumulated_resid(return_labels=True)
    assert stack.shape == (3, 5, 16) and labels == ["0_pre", "1_pre", "final_post"]
    lens = single.logit_lens(positions=None)
    assert not lens.has_batch_dim and lens.values.shape == (3, 5, 11)
    close(lens.values[-1], logits[0])  # the last entry is the model's own output
    table = lens.to_dataframe(top_k=1)
    assert "batch" not in table.columns and sorted(table["pos"].unique()) == list(range(5))
    assert single["pattern", 0, "attn"].shape == (2, 5, 5)  # detect_head reads [head_index, q, k]
    # TransformerLens' run_with_cache documents an AssertionError for a batch above 1
    with pytest.raises(AssertionError, match="batch size 2"):
        model.run_with_cache(CLEAN, remove_batch_dim=True)
    with pytest.raises(AssertionError, match="batch size 2"):
        model.run_with_cache(tokens=CLEAN, remove_batch_dim=True)


@pytest.mark.parametrize("remove_batch_dim", [False, True])
def test_pos_slice_cuts_the_position_axis_of_every_per_head_hook(remove_batch_dim):
    model = make(("rope", "alibi"))
    tokens = CLEAN[:1]
    _, full = model.run_with_cache(tokens, remove_batch_dim=remove_batch_dim)
    # TransformerLens' run_with_cache keeps the axis of an int pos_slice (Slice.unwrap: -1 -> [-1])
    for pos_slice, index in ((-1, [-1]), ((1, 4), slice(1, 4)), ([0, 2], [0, 2])):
        _, cut = model.run_with_cache(tokens, pos_slice=pos_slice, remove_batch_dim=remove_batch_dim)
        assert set(cut.keys()) == set(full.keys())
        for name, value in full.items():
            leaf = name.rpartition(".")[2]
            axis = -3 if leaf in PER_HEAD_HOOKS else -2  # [.., pos, head, d] / [.., pos, d], [.., q, k]
            expected = value.movedim(axis, 0)[index].movedim(0, axis)
            assert cut[name].shape == expected.shape, name
            close(cut[name], expected)
    _, cut = model.run_with_cache(tokens, pos_slice=-1, remove_batch_dim=remove_batch_dim)
    rot_q = cut["blocks.0.attn.hook_rot_q"]
    assert rot_q.shape[-3:] == (1, 2, 8)  # the last position, both heads
    stacked = cut.stack_activation("rot_q", layer=1)
    assert stacked.shape == (1, *rot_q.shape)


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_incl_bwd_caches_the_gradients_autograd_gives(position):
    model = make(position)
    tokens = CLEAN
    loss, cache = model.run_with_cache(tokens, return_type="loss", incl_bwd=True)
    model.zero_grad()
    names = [
        "hook_embed",
        "blocks.0.hook_resid_pre",
        "blocks.0.attn.hook_q",
        "blocks.0.attn.hook_pattern",
        "blocks.1.attn.hook_z",
        "blocks.1.hook_mlp_out",
        "blocks.1.ln2.hook_scale",
        "ln_final.hook_normalized",
    ]
    if position == "rope":
        names.append("blocks.1.attn.hook_rot_k")
    kept = {}
    keep = lambda act, hook: kept.__setitem__(hook.name, act)  # noqa: E731
    reference = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[(n, keep) for n in names])
    close(loss, reference.detach())
    grads = torch.autograd.grad(reference, [kept[n] for n in names])
    for name, grad in zip(names, grads):
        close(cache[f"{name}_grad"], grad, atol=1e-10)
    if position == "alibi":  # the ALiBi bias needs no gradient, so its hook gets none
        assert (
            "blocks.0.attn.hook_pos_bias" in cache.cache_dict
            and "blocks.0.attn.hook_pos_bias_grad" not in cache.cache_dict
        )
    for return_type in ("logits", "both"):
        with pytest.raises(ValueError, match="return_type='loss'"):
            model.run_with_cache(tokens, return_type=return_type, incl_bwd=True)


# --------------------------------------------------------------------------------- gated hook points
def test_hook_result_refuses_hooks_while_use_attn_result_is_off():
    model = make()
    name = "blocks.1.attn.hook_result"
    calls = []
    hook = lambda act, hook: calls.append(hook.name)  # noqa: E731
    message = re.escape(
        f"Cannot add hook {name} because use_attn_result is False. Call set_use_attn_result(True) first."
    )
    with pytest.raises(ValueError, match=message):
        model.add_hook(name, hook)
    with pytest.raises(ValueError, match=message):
        model.run_with_hooks(CLEAN, fwd_hooks=[(name, hook)])
    with pytest.raises(ValueError, match=message):
        model.run_with_hooks(CLEAN, bwd_hooks=[(name, hook)])
    with pytest.raises(ValueError, match=message):
        with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", hook), (name, hook)]):
            pass
    for names_filter in ([name], name, ["blocks.0.hook_resid_pre", name]):
        with pytest.raises(ValueError, match=message):
            model.run_with_cache(CLEAN, names_filter=names_filter)
    with pytest.raises(ValueError, match=message):
        model.add_caching_hooks(names_filter=[name])
    assert not any(hp.fwd_hooks or hp.bwd_hooks for hp in model.hook_points())  # nothing left behind
    with pytest.warns(UserWarning, match="never fire"):
        _, cache = model.run_with_cache(CLEAN, names_filter=lambda n: n.endswith("hook_result"))
    assert len(cache) == 0
    with pytest.warns(UserWarning, match="never fire"):
        model.add_hook(lambda n: n.endswith("attn.hook_result"), hook)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default cache skips them without a word
        _, cache = model.run_with_cache(CLEAN)
    assert "blocks.0.attn.hook_result" not in cache.cache_dict and "blocks.0.attn.hook_z" in cache.cache_dict
    model.set_use_attn_result(True)
    model.run_with_hooks(CLEAN, fwd_hooks=[(name, hook)])
    assert calls == [name]
    _, cache = model.run_with_cache(CLEAN, names_filter=[name])
    assert cache[name].shape == (2, 5, 2, 16)


def test_every_hook_point_that_cannot_fire_refuses_and_every_other_fires():
    for model in (make(d_mlp=0), make(normalization="none"), make("alibi"), make("learned")):
        fired = set()
        reasons = {name: closed_hook_reason(model.cfg, name) for name in model.hook_dict}
        for name, reason in reasons.items():
            if reason is None:
                model.add_hook(name, lambda act, hook: fired.add(hook.name))
            else:
                with pytest.raises(ValueError, match=re.escape(reason)):
                    model.add_hook(name, lambda act, hook: None)
        model(CLEAN)
        model.reset_hooks()
        assert fired == {name for name, reason in reasons.items() if reason is None}
    assert closed_hook_reason(make(d_mlp=0).cfg, "blocks.1.hook_mlp_out").startswith("this model is attention-only")
    assert closed_hook_reason(make(normalization="none").cfg, "ln_final.hook_scale").startswith(
        "normalization is 'none'"
    )


def test_a_name_that_is_no_hook_point_raises():
    model = make("nope")
    for call in (
        lambda: model.run_with_cache(CLEAN, names_filter=["blocks.0.attn.hook_rot_q"]),
        lambda: model.run_with_hooks(CLEAN, fwd_hooks=[("blocks.0.attn.hook_rot_q", print)]),
        lambda: model.add_hook("blocks.0.attn.hook_rot_q", print),
    ):
        with pytest.raises(KeyError, match="not a hook point of this model"):
            call()


# --------------------------------------------------------------------------------- return_type
@pytest.mark.parametrize("position", ["nope", "rope"])
def test_loss_is_the_next_token_cross_entropy(position):
    model = make(position)
    logits = model(CLEAN)
    manual = F.cross_entropy(logits[:, :-1].flatten(0, 1), CLEAN[:, 1:].flatten(), reduction="none").view(2, 4)
    close(model(CLEAN, return_type="loss"), manual.mean())
    close(model(CLEAN, return_type="loss", loss_per_token=True), manual)
    both_logits, both_loss = model(CLEAN, return_type="both")
    close(both_logits, logits)
    close(both_loss, manual.mean())
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding: row 0 has 2 real pairs
    padded = model(CLEAN, attention_mask=mask)
    log_probs = padded.log_softmax(-1)
    pairs = [(b, i) for b in range(2) for i in range(4) if mask[b, i] and mask[b, i + 1]]
    per_pair = torch.stack([-log_probs[b, i, CLEAN[b, i + 1]] for b, i in pairs])
    close(model(CLEAN, attention_mask=mask, return_type="loss"), per_pair.mean())
    per_token = model(CLEAN, attention_mask=mask, return_type="loss", loss_per_token=True)
    assert per_token.shape == (2, 4) and per_token[0, :2].eq(0).all()
    close(per_token[mask[:, :-1].bool() & mask[:, 1:].bool()], per_pair)
    calls = []
    assert (
        model.run_with_hooks(
            CLEAN, return_type=None, fwd_hooks=[("blocks.1.hook_resid_post", lambda a, hook: calls.append(1))]
        )
        is None
    )
    assert calls == [1]


def test_bad_return_types_raise_before_the_forward_pass():
    model = make()
    with pytest.raises(ValueError, match="return_type must be one of"):
        model(CLEAN, return_type="probs")
    with pytest.raises(ValueError, match="no two consecutive real tokens"):
        model(CLEAN[:, :1], return_type="loss")
    with pytest.raises(ValueError, match="stop_at_layer"):
        model(CLEAN, return_type="loss", stop_at_layer=1)
    with pytest.raises(ValueError, match="loss_per_token"):
        model(CLEAN, loss_per_token=True)
    with pytest.raises(ValueError, match="no two consecutive real tokens"):
        model(CLEAN, attention_mask=torch.tensor([[1, 0, 1, 0, 1], [0, 1, 0, 1, 0]]), return_type="loss")
