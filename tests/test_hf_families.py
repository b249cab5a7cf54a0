"""Every common HF decoder family, measured right or refused (issue 12).

Each family is a tiny random-init model built offline from its config (``tests/hf_families.py``),
bridged once per module. Per family the test fixes what nopelens must say: the per-layer position
methods it reads from the config, whether ``collect`` reads every probe site with left padding
giving the unpadded activations, and the audit's verdict (``pass``, with the steps it cannot
verify named as ``not_applicable`` and why), or the one-line refusal.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from hf_families import FAMILIES, VOCAB, build

from nopelens.models.adapters import bridge_hf_model
from nopelens.models.hf import UnsupportedModelError, describe
from nopelens.probes import collect, resid_sites

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
    rope = [layer for layer in description.layers if layer.rotates]
    assert {layer.pairing for layer in rope} == ({pairing} if rope else set())
    assert description.fires("blocks.0.attn.hook_pattern")


def probe_sites(bridge) -> list[str]:
    """The sites ``nopelens probe`` reads (see analyses.sweep.analyse_subject), as it chooses them."""
    from nopelens.analyses.subjects import Subject, qk_sites

    d = describe(bridge)
    subject = Subject("x", bridge, d.n_layers, "", "external", torch.zeros(1, 1), torch.zeros(1, 1), False, hf=d)
    inner = [f"blocks.{l}.hook_{part}_out" for l in range(d.n_layers) for part in ("attn", "mlp")]
    qk = [site for l in range(d.n_layers) for site in qk_sites(subject, l) or ()]
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


# ----------------------------------------------------------------------------- the audit's verdicts
NO_TABLE = {4: "no absolute position addition"}
AUDIT_NOT_APPLICABLE = {
    # family: {step: what its not_applicable reason says}; every other step except 10 passes. Step 5's
    # per-layer detector measures every model that takes position ids (GPT-2's layers: nope).
    "gpt2": {},
    "gpt_neo": {},
    "gpt_bigcode": {},
    "opt": {2: "no position method with an origin"},  # OPT's table takes the mask, not ids
    "xglm": {2: "no position method with an origin", 4: "hook_pos_embed never fires"},
    "mpt": {**NO_TABLE, 5: "not measured (the model takes no position ids)", 8: "takes no position ids"},
}
FALCON_BIAS_TWICE = {2: "ALiBi sign and slopes", 6: "ALiBi position contribution"}
"""transformers 5.24's eager FalconModel folds alibi / sqrt(d_head) into the causal mask and hands alibi
to every attention too (position_input ``alibi_tensor``): the bias counts twice. From 5.25 it is in the
mask only (``alibi_mask``): counted once, as Falcon-RW's formula says."""
AUDITED = [f for f in BRIDGED if f not in UNREADABLE]


def statuses(report) -> dict[int, str]:
    return {step.number: step.status for step in report.steps}


@pytest.mark.parametrize("family", AUDITED)
def test_audit_verdict(bridges, family):
    from nopelens.analyses.audit import audit

    report = audit(bridges(family), eval_length=8)
    twice = family == "falcon_alibi" and describe(bridges(family)).position_input == "alibi_tensor"
    not_applicable, fails = AUDIT_NOT_APPLICABLE.get(family, NO_TABLE), FALCON_BIAS_TWICE if twice else {}
    expected = {n: "not_applicable" if n in not_applicable else "fail" if n in fails else "pass" for n in range(1, 10)}
    assert {n: s for n, s in statuses(report).items() if n < 10} == expected, report.summary()
    for number, reason in not_applicable.items():
        assert reason in report.step(number).reason
    for number, check in fails.items():
        assert any(check in c.name for c in report.step(number).failed_checks), report.summary()
    if twice:  # the detail says what is wrong
        assert "with slopes 2x the declared m_h" in report.step(2).failed_checks[0].detail
    assert report.model["layer_positions"] == list(EXPECTED[family][1])  # e.g. SmolLM3: rope, rope, rope, nope


@pytest.mark.parametrize("broken", [False, True])
def test_falcon_alibi_in_bfloat16(broken):
    """transformers 5.25 folds m_h p_j / sqrt(d_head) into a bfloat16 mask, rounded there (d_head 8):
    the audit reads p_j through that round-off, and still fails slopes twice the declared ones."""
    from nopelens.analyses.audit import audit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = bridge_hf_model(build("falcon_alibi").to(torch.bfloat16))
    if broken:
        _scale_alibi(bridge)
    failed = set(audit(bridge, eval_length=8).failed_steps)
    assert (failed & {2, 6}) if broken else not failed, failed


@pytest.mark.parametrize("family", sorted(UNREADABLE))
def test_audit_refuses_an_unreadable_model(bridges, family):
    from nopelens.analyses.audit import audit

    with pytest.raises(UnsupportedModelError, match=UNREADABLE[family]):
        audit(bridges(family), eval_length=8)


# ----------------------------------------------------------------------------- broken variants fail
def _declare(config, **changes):
    """Change what the config declares after the model was built from it (the model keeps its own)."""
    for key, value in changes.items():
        setattr(config, key, value)


def _wrong_base(config):
    params = dict(config.rope_parameters)
    if "rope_theta" in params:
        params["rope_theta"] = 3.0 * params["rope_theta"]
    else:  # Gemma 3: one set per layer type
        params = {kind: {**p, "rope_theta": 3.0 * p["rope_theta"]} for kind, p in params.items()}
    config.rope_parameters = params


def _scale_alibi(bridge):
    """Every attention gets twice its ALiBi bias: the slopes are not the declared ones."""
    in_mask = describe(bridge).position_input == "alibi_mask"

    def pre(module, args, kwargs):
        if in_mask:  # the bias folded into the mask; blocked entries (below -1) stay blocked
            mask = kwargs["attention_mask"]
            return args, {**kwargs, "attention_mask": torch.where(mask < -1, mask, 2 * mask)}
        return (args, {**kwargs, "alibi": 2 * kwargs["alibi"]}) if kwargs.get("alibi") is not None else None

    for block in bridge.blocks:
        block.attn.register_forward_pre_hook(pre, with_kwargs=True)


def _ignore_padding(bridge):
    """Position ids counted from column 0 whatever the mask says (left padding not subtracted)."""

    def pre(module, args, kwargs):
        tokens = args[0] if args else kwargs["input_ids"]
        ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return args, {**kwargs, "position_ids": ids}

    bridge.original_model.register_forward_pre_hook(pre, with_kwargs=True)


HYBRIDS = ("smollm3", "llama4")
BROKEN = {
    # family: (what is broken, how, the steps that must fail (any of them))
    **{f: ("a rotation on the declared NoPE layer", "rope_everywhere", {2, 5, 6}) for f in HYBRIDS},
    "cohere2": ("a rotation on the declared NoPE layer", "cohere2_rope_everywhere", {2, 5, 6}),
    "gptj": ("a wrong rotary_dim", "gptj_rotary_dim", {5}),
    "bloom": ("ALiBi slopes twice the declared ones", "alibi", {2, 6}),
    "falcon_alibi": ("ALiBi slopes twice the declared ones", "alibi", {2, 6}),
    "mpt": ("a wrong alibi_bias_max", "mpt_bias_max", {2, 6}),
    **{
        f: ("left padding not subtracted from the position ids", "padding", {1})
        for f in ("gpt2", "gpt_neo", "opt", "gpt_bigcode", "xglm")
    },
}
for _family, (_input, _methods, _pairing) in EXPECTED.items():
    if _family not in BROKEN and _family not in UNREADABLE and R in _methods:
        BROKEN[_family] = ("a wrong RoPE base", "base", {5})


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(BROKEN))
def test_a_broken_variant_fails(family):
    from nopelens.analyses.audit import audit

    what, how, steps = BROKEN[family]
    if how == "rope_everywhere":
        model = build(family, no_rope_layers=[1, 1, 1, 1])
        _declare(model.config, no_rope_layers=[1, 1, 1, 0])
    elif how == "cohere2_rope_everywhere":
        model = build(family, layer_types=["sliding_attention"] * 4)
        _declare(model.config, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    elif how == "gptj_rotary_dim":
        model = build(family)
        _declare(model.config, rotary_dim=2)
    elif how == "mpt_bias_max":
        model = build(family)
        model.config.attn_config.alibi_bias_max = 4
    else:
        model = build(family)
        if how == "base":
            _wrong_base(model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = bridge_hf_model(model)
    if how == "alibi":
        _scale_alibi(bridge)
    elif how == "padding":
        _ignore_padding(bridge)
    report = audit(bridge, eval_length=8)
    assert set(report.failed_steps) & steps, f"{family} with {what}: {report.summary()}"


# ----------------------------------------------------------------------------- the CLI on HF directories
def _save(tmp_path, family, **overrides):
    path = tmp_path / family
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build(family, **overrides).save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_probe_cli_reads_a_family_whose_hooks_misled_it(tmp_path, capsys):
    """GPT-NeoX lists hook_rot_q/k that never fire; ``nopelens probe`` used to exit 2 on it (and on
    Granite, whose hook_attn_out fires only through TransformerLens' hook API: covered, for every
    family, by the collect test above, which reads the same sites)."""
    from nopelens.analyses.cli import main

    family = "gpt_neox"
    code = main(
        [
            "probe",
            f"hf:{_save(tmp_path, family)}",
            "--input",
            "random",
            "--quick",
            "--seq-len",
            "8",
            "--n-sequences",
            "6",
            "--quiet",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    import pandas as pd

    probes = pd.read_csv(tmp_path / "run" / "probes.csv")
    assert {f"blocks.{l}.hook_attn_out" for l in range(2)} <= set(probes.site)
    # hook_q/k hold q and k before RoPE there: no content q.k read of them, and the run says why
    assert not probes.site.str.contains(r"hook_(?:rot_)?[qk]$").any()
    (done,) = (tmp_path / "run" / "parts").glob("*/done.json")
    note = json.loads(done.read_text())["not_applicable"]["content q·k read"]
    assert note.startswith("blocks 0-1: no rotated q and k to read (hook_rot_q/k never fire")


@pytest.mark.slow
def test_intervene_cli_reads_a_family_whose_hooks_misled_it(tmp_path, capsys):
    """GPT-NeoX's unfired hook_rot_q/k: the sink ablation's re-probes read the plain q and k, as ``probe`` does
    (``nopelens intervene`` exited 2 on GPT-NeoX, GPT-J, Falcon and Phi-3)."""
    from nopelens.analyses.cli import main

    code = main(
        [
            "intervene",
            f"hf:{_save(tmp_path, 'gpt_neox')}",
            "--quick",
            "--quiet",
            "--n-sequences",
            "8",
            "--seq-len",
            "8",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    import pandas as pd

    probes = pd.read_csv(tmp_path / "run" / "sink_probes.csv")
    assert probes["target"].eq("absolute_index").any()
    assert not probes["site"].str.contains(r"hook_(?:rot_)?[qk]$").any()  # q and k before RoPE: no q.k read


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "pad_token_id",
            VOCAB,
            f"transformers cannot build this model from it (pad_token_id {VOCAB} is outside the vocabulary",
        ),
        ("bos_token_id", VOCAB + 5, f"bos_token_id {VOCAB + 5} is outside the vocabulary (0..{VOCAB - 1})"),
    ],
)
def test_audit_refuses_a_special_token_outside_the_vocabulary_in_one_line(tmp_path, field, value, message, capsys):
    """A pad id torch's Embedding refuses was an internal error; a BOS id outside the vocabulary was
    silently replaced by a random token (sinks and intervene refused it already)."""
    from nopelens.analyses.cli import main

    path = tmp_path / "llama"
    build("llama").save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, field: value}))
    capsys.readouterr()
    code, err = main(["audit", "--hf-dir", str(path)]), capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "family, args, message",
    [
        ("openai_gpt", ["sinks"], "causal mask is dropped"),
        ("gpt2", ["probe", "--input", "random", "--seq-len", "80"], "longer than the learned position table"),
    ],
)
def test_cli_refuses_in_one_line_with_exit_2(tmp_path, family, args, message, capsys, monkeypatch):
    from nopelens.analyses.cli import main

    monkeypatch.chdir(tmp_path)  # the default run folder runs/... goes there, not into the checkout

    path = _save(tmp_path, family)
    capsys.readouterr()
    code = main([args[0], f"hf:{path}", *args[1:], "--quiet", "--n-sequences", "6"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in err, err


def test_a_model_the_bridge_refuses_is_read_through_forward_hooks_from_the_command_line(tmp_path, capsys):
    """CodeGen's bridge builds but cannot run (and has rebuilt the model in place): ``hf:DIR``
    loads a fresh copy and hooks it, so probe and audit run, and the audit says why q and k are
    not read."""
    from nopelens.analyses.cli import main

    path = _save(tmp_path, "codegen")
    code = main(["audit", "--hf-dir", path, "--eval-length", "8"])
    out = capsys.readouterr().out
    assert code == 0 and "via forward hooks" in out and "TransformerLens cannot b" in out, out


def test_cli_refuses_a_bos_outside_the_vocabulary(tmp_path, capsys):
    from nopelens.analyses.cli import main

    path = _save(tmp_path, "llama", bos_token_id=500)
    capsys.readouterr()
    code = main(["sinks", f"hf:{path}", "--input", "random", "--quiet", "--n-sequences", "6", "--seq-len", "8"])
    err = capsys.readouterr().err
    assert code == 2 and "bos_token_id 500 is outside the vocabulary" in err, err


def test_scaled_rope_is_measured_but_not_held_against_the_reference():
    """Scaled RoPE (``rope_type`` linear): its q/k steps are not applicable, but the detector still
    measures every layer relative and step 8's interventions run (scaled RoPE is still relative)."""
    from nopelens.analyses.audit import audit

    model = build("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = audit(bridge_hf_model(model), eval_length=8)
    got = statuses(report)
    assert [n for n in range(1, 10) if got[n] == "not_applicable"] == [2, 4, 6], report.summary()
    assert "scales RoPE frequencies" in report.step(6).reason and report.passed
    assert report.model["measured_layer_positions"] == ["relative", "relative"] and got[8] == "pass"


def test_audit_and_collect_restore_every_submodule_flag(bridges):
    from nopelens.analyses.audit import audit

    bridge = bridges("smollm3")
    bridge.train()
    bridge.blocks[1].eval()
    before = [m.training for m in bridge.modules()]
    audit(bridge, eval_length=6)
    collect(bridge, torch.randint(3, 64, (1, 5)), resid_sites(1))
    assert [m.training for m in bridge.modules()] == before
    bridge.eval()


def test_an_unhooked_qk_norm_makes_the_score_steps_not_applicable_not_failed():
    from nopelens.analyses.audit import audit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = audit(bridge_hf_model(build("stablelm", qk_layernorm=True)), eval_length=8)
    assert report.passed and "cannot be read" in report.step(5).reason, report.summary()
