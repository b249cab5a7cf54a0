"""The per-layer NoPE detector (issue 20, item 2): which layers read positions, measured with each
layer's input held fixed and the position ids re-spaced, then shifted."""

from __future__ import annotations

import warnings

import pytest
import torch
from hf_families import build

from nopelens.analyses.audit import Tolerance, audit
from nopelens.analyses.audit.core import make_subject
from nopelens.analyses.audit.detector import MAX_GAP, detect, respaced_ids
from nopelens.models import Decoder, DecoderConfig
from nopelens.models.adapters import bridge_hf_model
from nopelens.models.positions import position_ids_from_mask

pytestmark = pytest.mark.usefixtures("one_thread")


def _probe(length=12, n_pad=3, seed=0):
    tokens = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(tokens)
    mask[1, :n_pad] = 0
    return tokens, mask


def readings(model, dtype=torch.float32):
    subject, _ = make_subject(model, None)
    tokens, mask = _probe()
    with torch.no_grad():
        return [r.reading for r in detect(subject, tokens, mask, Tolerance.for_dtype(dtype))]


def test_respaced_ids_keep_the_origin_and_order_and_leave_padding_alone():
    tokens, mask = _probe(length=20, n_pad=5)
    ids = position_ids_from_mask(mask)
    new = respaced_ids(ids, mask, seed=3)
    real = mask.bool()
    assert new[0, 0] == 0 and new[1, 5] == 0
    for row in range(2):
        steps = new[row][real[row]].diff()
        assert bool((steps >= 1).all() and (steps <= MAX_GAP).all()) and bool((steps > 1).any())
    assert torch.equal(new[~real], ids[~real])
    assert int(respaced_ids(ids, mask, seed=3, limit=21).max()) <= 20


@pytest.mark.parametrize(
    "position, expected",
    [
        (["nope", "rope", "alibi", "shaw"], ["nope", "relative", "relative", "relative"]),
        (["rope", "nope", "t5", "nope"], ["relative", "nope", "relative", "nope"]),
        ("learned", ["nope"] * 2),  # the table acts on the input; every attention layer itself is NoPE
    ],
)
def test_the_detector_reads_decoder_hybrids_built_with_known_layers(position, expected):
    n_layers = len(expected)
    model = Decoder(
        DecoderConfig(d_vocab=64, n_ctx=64, n_layers=n_layers, d_model=32, n_heads=4, position=position, init_std=0.3),
        seed=0,
    )
    assert readings(model) == expected


def test_a_layer_with_no_scores_to_rotate_reads_flat_and_fails_nothing():
    """q.k = 0 in a RoPE layer: nothing a rotation could change, so the detector says ``flat``."""
    model = Decoder(
        DecoderConfig(d_vocab=64, n_ctx=64, n_layers=2, d_model=32, n_heads=4, position="rope", init_std=0.3), seed=0
    )
    with torch.no_grad():
        model.blocks[1].attn.W_Q.zero_()
    assert readings(model) == ["relative", "flat"]
    assert audit(model, eval_length=12).step(5).status == "pass"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("no_rope_layers", [[1, 1, 1, 0], [0, 1, 0, 1]])
def test_smollm3_no_rope_layers_1_means_rope(no_rope_layers, dtype):
    """transformers issue 43756 asks whether SmolLM3's ``no_rope_layers`` 1 means RoPE or NoPE.
    Measured: a 1 rotates (relative), a 0 does not (nope), in float32 and bfloat16; the config's
    docstring (``transformers/models/smollm3/configuration_smollm3.py``) says the same."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = bridge_hf_model(build("smollm3", no_rope_layers=no_rope_layers).to(dtype))
    assert readings(bridge, dtype) == ["relative" if flag else "nope" for flag in no_rope_layers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rotation_on_a_declared_nope_layer_fails_step_5_naming_the_layer(dtype):
    model = build("smollm3", no_rope_layers=[1, 1, 1, 1]).to(dtype)
    model.config.no_rope_layers = [1, 1, 1, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = audit(bridge_hf_model(model), eval_length=12)
    failed = [c for c in report.step(5).failed_checks if "reads positions as declared" in c.name]
    assert [c.name for c in failed] == ["layer 3 reads positions as declared (nope)"], report.summary()
    assert "measured relative" in failed[0].detail
    assert report.model["measured_layer_positions"] == ["relative"] * 4
