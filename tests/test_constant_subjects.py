"""Issue 10 §1: constant input (one token id, no BOS) as a negative control the sweep can run."""

import pytest
import torch

from nopelens.analyses.subjects import CONSTANT_TOKEN, check_spec, resolve
from nopelens.analyses.sweep import SweepSettings, sweep


def test_constant_nope_is_one_token_without_bos():
    subject = resolve("constant-nope", n_sequences=3, seq_len=8)
    assert torch.equal(subject.tokens, torch.full((3, 8), CONSTANT_TOKEN))
    assert not subject.has_bos and subject.kind == "constant" and subject.position == "nope"


def test_constant_hybrid_repeats_the_list_over_layers():
    subject = resolve("constant-rope+rope+rope+nope", n_sequences=2, seq_len=4)
    assert subject.model.cfg.position == ("rope", "rope", "rope", "nope")
    assert resolve("constant-rope+nope", 2, 4).model.cfg.position == ("rope", "nope", "rope", "nope")


def test_unknown_constant_method_is_refused_before_any_work():
    with pytest.raises(ValueError, match="constant-bogus.*position must be one of"):
        check_spec("constant-bogus")
    with pytest.raises(ValueError, match="constant-bogus"):
        sweep(SweepSettings(models=("constant-nope", "constant-bogus")), progress=False)
