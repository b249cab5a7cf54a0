"""Every common HF decoder family, measured right or refused (issue 12).

Each family is a tiny random-init model built offline from its config (``tests/hf_families.py``),
bridged once per module. Per family the test fixes what nopelens must say: the per-layer position
methods it reads from the config, whether ``collect`` reads every probe site with left padding
giving the unpadded activations, and the audit's verdict (``pass``, with the steps it cannot
verify named as ``not_applicable`` and why), or the one-line refusal.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from nopelens.models.adapters import bridge_hf_model
from nopelens.models.hf import UnsupportedModelError, describe
from nopelens.probes import collect, resid_sites

from hf_families import FAMILIES, build

pytestmark = pytest.mark.usefixtures("one_thread")

R, N, A = "rope", "nope", "alibi"
EXPECTED = {
    # family: (input positions, per-layer methods, pairing)
    "gpt2": ("learned", (N, N), None),
    "gpt_neox": (None, (R, R), "half"),
    "gpt_neox_rotary_pct_0.25": (None, (R, R), "half"),
    "llama": (None, (R, R), "half"),
    "mistral": (None, (R, R), "half"),
    "mixtral": (None, (R, R), "half"),
    "qwen2": (None, (R, R), "half"),
    "qwen3": (None, (R, R), "half"),
    "phi": (None, (R, R), "half"),
    "phi3": (None, (R, R), "half"),
    "gptj": (None, (R, R), "interleaved"),
    "gpt_neo": ("learned", (N, N), None),
    "opt": ("learned", (N, N), None),
    "falcon_alibi": (None, (A, A), None),
    "falcon_rotary": (None, (R, R), "half"),
    "bloom": (None, (A, A), None),
    "gemma": (None, (R, R), "half"),
    "gemma2": (None, (R, R), "half"),
    "gemma3": (None, (R, R), "half"),
    "stablelm": (None, (R, R), "half"),
    "olmo": (None, (R, R), "half"),
    "olmo2": (None, (R, R), "half"),
    "mpt": (None, (A, A), None),
    "gpt_bigcode": ("learned", (N, N), None),
    "cohere": (None, (R, R), "interleaved"),
    "cohere2": (None, (R, R, R, N), "interleaved"),
    "glm": (None, (R, R), "interleaved"),
    "granite": (None, (R, R), "half"),
    "smollm3": (None, (R, R, R, N), "half"),
    "xglm": ("sinusoidal", (N, N), None),
    "openai_gpt": ("learned", (N, N), None),
    "starcoder2": (None, (R, R), "half"),
    "nemotron": (None, (R, R), "half"),
    "llama4": (None, (R, R, R, N), "interleaved"),
}
REFUSED = {
    # family: what the one-line refusal says
    "codegen": "forward pass fails",
    "falcon_new_architecture": "cannot bridge FalconForCausalLM",
}
UNREADABLE = {"openai_gpt": "causal mask is dropped"}  # bridges, but collect/probe/sinks/audit refuse it
BRIDGED = [f for f in FAMILIES if f not in REFUSED]


def test_every_family_has_an_expectation():
    assert set(FAMILIES) == set(EXPECTED) | set(REFUSED)


@pytest.fixture(scope="module")
def bridges():
    """family -> bridge, built lazily and shared by every test of this module."""
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache[family] = bridge_hf_model(build(family))
        return cache[family]

    return get


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refused_in_one_line(family):
    with pytest.raises(UnsupportedModelError, match=REFUSED[family]) as info:
        bridge_hf_model(build(family))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("family", BRIDGED)
def test_description_per_layer(bridges, family):
    description = describe(bridges(family))
    input_position, methods, pairing = EXPECTED[family]
    assert description.input_position == input_position
    assert description.layer_methods == methods
    rope = [layer for layer in description.layers if layer.method == "rope"]
    assert {layer.pairing for layer in rope} == ({pairing} if rope else set())
    assert description.fires("blocks.0.attn.hook_pattern")


def probe_sites(bridge) -> list[str]:
    """The sites ``nopelens probe`` reads (see analyses.sweep.analyse_subject), as it chooses them."""
    from nopelens.analyses.subjects import Subject
    from nopelens.analyses.sweep import _qk_sites

    d = describe(bridge)
    subject = Subject("x", bridge, d.n_layers, "", "external", torch.zeros(1, 1), torch.zeros(1, 1), False, hf=d)
    inner = [f"blocks.{l}.hook_{part}_out" for l in range(d.n_layers) for part in ("attn", "mlp")]
    qk = [site for l in range(d.n_layers) for site in _qk_sites(subject, l)]
    patterns = [f"blocks.{l}.attn.hook_pattern" for l in range(d.n_layers)]
    return resid_sites(d.n_layers) + [s for s in inner if subject.usable(s)] + qk + patterns


@pytest.mark.parametrize("family", BRIDGED)
def test_collect_reads_every_probe_site_and_left_padding_changes_nothing(bridges, family):
    bridge = bridges(family)
    tokens = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.zeros(2, 2, dtype=torch.long), tokens], 1)
    mask = torch.ones_like(padded)
    mask[:, :2] = 0
    sites = probe_sites(bridge)
    if family in UNREADABLE:
        with pytest.raises(ValueError, match="ignores the causal mask"):
            collect(bridge, tokens, [s for s in sites if "pattern" in s], attention_mask=torch.ones_like(tokens))
        return
    alone = collect(bridge, tokens, sites)
    left = collect(bridge, padded, sites, attention_mask=mask)
    assert left.position.tolist() == list(range(6)) * 2
    for site in resid_sites(describe(bridge).n_layers):
        np.testing.assert_allclose(left.acts[site], alone.acts[site], atol=2e-4, err_msg=site)
