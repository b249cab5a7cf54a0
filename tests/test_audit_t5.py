"""The audit on T5 models (issue 11): a correct T5 decoder passes every applicable step, whatever
its buckets; a decoder that computes its buckets from an off-by-one distance fails steps 2 and 5.
The audit's expectations come from the T5 method object, not from its name."""

import numpy as np
import pytest
import torch

from nopelens.analyses.audit import audit
from nopelens.models import Decoder, DecoderConfig
from nopelens.models.methods.t5 import T5
from nopelens.probes import collect, probe_absolute_index

EVAL_LENGTH = 12
APPLICABLE = {1, 2, 3, 5, 6, 7, 8, 9}


def t5_decoder(position="t5", **overrides) -> Decoder:
    config = dict(
        d_vocab=64, n_ctx=32, n_layers=2, d_model=32, n_heads=4, position=position, t5_num_buckets=6, t5_max_distance=5
    )  # exact below 3, log-spaced to 5, one bucket beyond
    config.update(overrides)
    model = Decoder(DecoderConfig(**config), seed=0)
    with torch.no_grad():  # a bias large enough that a wrong bucket changes the output
        for block in model.blocks:
            if hasattr(block.attn, "W_rel_bias"):
                block.attn.W_rel_bias.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    return model


@pytest.mark.parametrize("position", ["t5", ["nope", "t5"]])
def test_t5_passes_every_applicable_step(position):
    report = audit(t5_decoder(position), eval_length=EVAL_LENGTH)
    got = {s.number: s.status for s in report.steps}
    assert report.passed, report.summary()
    assert {n for n, s in got.items() if s == "pass"} == APPLICABLE, report.summary()
    layer = 1
    names = [c.name for c in report.step(5).checks]
    assert f"layer {layer} T5 b_h lookup" in names
    assert report.step(5).evidence[f"layer{layer}_t5_buckets_used"] == [0, 1, 2, 3, 4, 5]  # distances 0..11
    assert f"layer {layer} T5 offset sign" in [c.name for c in report.step(2).checks]
    assert report.model["t5"] == {"num_buckets": 6, "max_distance": 5, "bidirectional": False, "shared": False}
    effects = {c.name: c.value > c.tolerance for c in report.step(8).checks}
    assert effects["positions shifted by 3"] is False  # relative
    assert effects["zeroed positions"] and effects["swap: tokens from the first swapped one on"]
    assert "T5 depend only on offsets" in report.step(8).evidence["expectations"]["positions shifted by 3"]
    assert report.step(3).evidence["drop_bias_score_change"][-1] > 0


class OffByOneT5(T5):
    """Buckets of the distance i - j + 1: the query counts itself, a shape-preserving bug."""

    def relative_ids(self, cfg, query_positions, key_positions):
        return super().relative_ids(cfg, query_positions + 1, key_positions)


def test_buckets_off_by_one_fail_steps_2_and_5():
    model = t5_decoder()
    for block in model.blocks:  # the config still declares t5; the attention computes other buckets
        block.attn.position_method = OffByOneT5()
    report = audit(model, eval_length=EVAL_LENGTH)
    assert report.failed_steps == [2, 5], report.summary()
    failed5 = [c.name for c in report.step(5).failed_checks]
    assert failed5 == ["layer 0 T5 b_h lookup", "layer 1 T5 b_h lookup"]
    assert [c.name for c in report.step(2).failed_checks] == ["layer 0 T5 offset sign", "layer 1 T5 offset sign"]


def test_probes_read_a_t5_decoder():
    """Probes run on T5 activations like on any method (a random model: only shapes and columns)."""
    model = t5_decoder().eval()
    tokens = torch.randint(0, 64, (12, 10), generator=torch.Generator().manual_seed(0))
    acts = collect(model, tokens, sites=[0, 1, "blocks.0.attn.hook_pos_bias"])
    assert acts.position.tolist() == np.tile(np.arange(10), 12).tolist()
    assert acts.patterns["blocks.0.attn.hook_pos_bias"][0].shape == (4, 10, 10)
    resid = [s for s in acts.acts if "resid" in s]
    frame = probe_absolute_index(acts, sites=resid, tasks=("regression",), n_splits=3, controls=False, n_boot=10)
    assert set(frame["site"]) == set(resid) and frame["value"].notna().all()
