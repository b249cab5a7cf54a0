"""DecoderConfig validation: a bad combination names its field."""

import pytest

from nopelens.models import DecoderConfig


def cfg(**kw):
    base = dict(d_vocab=16, n_ctx=32, d_model=32, n_heads=4)
    base.update(kw)
    return DecoderConfig(**base)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(d_model=30, n_heads=4), "n_heads"),
        (dict(position="absolute"), "position"),
        (dict(position="rope", rotary_fraction=0.3), "rotary_dim"),  # 0.3 * 8 = 2.4
        (dict(position="rope", d_model=20, n_heads=4), "rotary_dim"),  # d_head 5 is odd
        (dict(position="rope", rotary_fraction=1.5), "rotary_fraction"),
        (dict(pairing="diagonal"), "pairing"),
        (dict(normalization="batchnorm"), "normalization"),
        (dict(act_fn="tanh"), "act_fn"),
        (dict(d_vocab=0), "d_vocab"),
        (dict(n_layers=2, position=["nope"]), "position"),
        (dict(n_layers=2, position=["nope", "learned"]), r"position\[1\]"),
        (dict(shaw_clip=-1), "shaw_clip"),
        (dict(position="rope", rotary_base=float("inf")), "rotary_base"),
        (dict(position="rope", rotary_base=float("nan")), "rotary_base"),
        (dict(d_mlp=-4), "d_mlp"),
    ],
)
def test_bad_combinations_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        cfg(**kwargs)


def test_defaults_and_derived_fields():
    c = cfg(position="rope", rotary_fraction=0.5)
    assert (c.d_head, c.d_mlp, c.rotary_dim) == (8, 128, 4)
    assert c.layer_positions == ("rope", "rope") and c.input_position is None
    learned = cfg(position="learned")
    assert learned.layer_positions == ("nope", "nope") and learned.input_position == "learned"


def test_per_layer_hybrid_and_round_trip():
    c = cfg(n_layers=3, position=["nope", "rope", "alibi"])
    assert c.layer_positions == ("nope", "rope", "alibi")
    assert c.position_name == "nope+rope+alibi"
    assert DecoderConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown DecoderConfig fields"):
        DecoderConfig.from_dict({**c.to_dict(), "d_modle": 3})
