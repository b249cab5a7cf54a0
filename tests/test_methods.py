"""Position methods as units (issue 11): the registry, the declarations every method makes, a new
method added with one module and one registry line, and no method-name branch outside the units."""

import re
from pathlib import Path

import pytest
import torch

from nopelens.models import POSITION_METHODS, Decoder, DecoderConfig
from nopelens.models.methods import METHODS, PLACES, QK_ROTATION, SCORE_BIAS, PositionMethod, get_method
from nopelens.models.methods.base import LookupBias

ROOT = Path(__file__).resolve().parents[1]


def test_registry_and_declarations():
    assert tuple(METHODS) == POSITION_METHODS
    for name, cls in METHODS.items():
        method = get_method(name)
        assert cls.name == name and isinstance(method, PositionMethod) and cls.label
        assert method.acts_on <= set(PLACES) and cls.convention
        assert (method.bias_kind is not None) == method.acts(SCORE_BIAS), name
        if method.bias_kind == "lookup":
            assert isinstance(method, LookupBias)
    assert [n for n in METHODS if get_method(n).absolute] == ["learned", "sinusoidal"]
    assert [n for n in METHODS if not get_method(n).reads_positions] == ["nope"]
    with pytest.raises(ValueError, match="unknown position method 'xpos'"):
        get_method("xpos")


def test_config_and_decoder_hold_method_objects():
    cfg = DecoderConfig(d_vocab=11, n_ctx=8, n_layers=3, d_model=16, n_heads=2, position=["nope", "rope", "t5"])
    assert cfg.layer_methods == (get_method("nope"), get_method("rope"), get_method("t5"))
    assert cfg.input_method is None and cfg.max_positions is None and cfg.reads_positions
    model = Decoder(cfg, seed=0)
    assert [b.attn.position_method for b in model.blocks] == list(cfg.layer_methods)
    assert DecoderConfig(d_vocab=11, n_ctx=8, position="learned").max_positions == 8
    assert not DecoderConfig(d_vocab=11, n_ctx=8, position="nope").reads_positions


class Recency(PositionMethod):
    """A toy score bias -(i - j) / 4 per head, the kind of module a new method is."""

    name, label = "recency", "recency"
    acts_on = frozenset({SCORE_BIAS})
    bias_kind = "linear"
    convention = "bias -(i - j) / 4"

    def add_parameters(self, attn, cfg):
        attn.register_buffer("recency_rate", torch.full((cfg.n_heads,), 0.25), persistent=False)

    def score_bias(self, attn, q, query_positions, key_positions):
        distance = query_positions[:, :, None] - key_positions[:, None, :]
        return -attn.recency_rate[None, :, None, None] * distance[:, None].to(q.dtype)


def test_a_new_method_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(METHODS, "recency", Recency)  # the registry line
    model = Decoder(DecoderConfig(d_vocab=11, n_ctx=8, n_layers=2, d_model=16, n_heads=2, position="recency"), seed=0)
    tokens = torch.randint(0, 11, (2, 6))
    logits, cache = model.run_with_cache(tokens)
    bias = cache["blocks.0.attn.hook_pos_bias"]
    assert torch.equal(bias[0, 0, 5, :6], -0.25 * torch.arange(5, -1, -1).float())
    assert "blocks.0.attn.hook_rot_q" not in model.hook_dict  # it declares no rotation
    assert torch.allclose(model(tokens), logits, atol=1e-6)  # fused path with its bias


def test_rope_declares_a_rotation_and_no_bias():
    rope = get_method("rope")
    assert rope.acts(QK_ROTATION) and rope.bias_kind is None and not rope.absolute


def test_no_method_name_branch_outside_the_method_units():
    """The issue's grep: no ``== "rope"`` or ``in ("alibi", ...)`` outside models/methods/."""
    pattern = re.compile(r'(==|!=) "(nope|rope|alibi|shaw|learned|sinusoidal|t5)"|in \("(alibi|rope|shaw|nope|t5)"')
    hits = []
    for folder in ("models", "circuits", "probes", "analyses"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.parent.name == "methods" and path.parent.parent.name == "models":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert hits == []
