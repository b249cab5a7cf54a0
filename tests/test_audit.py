"""Tests of seed 002's ten-step position audit (issue 7): correct models pass every applicable step,
and a model broken in one of four shape-preserving ways fails the step that should catch it."""

import json

import pytest
import torch
import transformers
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from nopelens.analyses.audit import STATUSES, audit
from nopelens.analyses.cli import audit as audit_cmd
from nopelens.analyses.cli import main
from nopelens.models import Decoder, DecoderConfig
from nopelens.models.adapters import bridge_hf_model
from nopelens.models.positions import position_ids_from_mask

transformers.logging.set_verbosity_error()
EVAL_LENGTH = 8


def decoder(position, **overrides) -> Decoder:
    config = dict(d_vocab=64, n_ctx=32, n_layers=2, d_model=32, n_heads=4, position=position)
    config.update(overrides)
    return Decoder(DecoderConfig(**config), seed=0)


def statuses(report) -> dict[int, str]:
    return {s.number: s.status for s in report.steps}


def failed_check_names(report, step: int) -> list[str]:
    return [c.name for c in report.step(step).failed_checks]


# ----------------------------------------------------------------------------- correct models
DECODERS = {
    "nope": dict(position="nope"),
    "learned": dict(position="learned"),
    "sinusoidal": dict(position="sinusoidal"),
    "rope-partial-interleaved": dict(position="rope", rotary_fraction=0.5, pairing="interleaved"),
    "alibi": dict(position="alibi"),
    "shaw-clipped-values": dict(position="shaw", shaw_clip=4, shaw_values=True),
    "hybrid-nope-rope": dict(position=["nope", "rope"]),
    "hybrid-alibi-shaw": dict(position=["alibi", "shaw"]),
}
# Which steps have something to check, per method family (step 5's per-layer detector measures
# every model that takes position ids).
APPLICABLE = {
    "nope": {1, 3, 5, 6, 7, 8, 9},
    "learned": {1, 2, 3, 4, 5, 6, 7, 8, 9},
    "sinusoidal": {1, 2, 3, 4, 5, 6, 7, 8, 9},
    "rope-partial-interleaved": {1, 2, 3, 5, 6, 7, 8, 9},
    "alibi": {1, 2, 3, 5, 6, 7, 8, 9},
    "shaw-clipped-values": {1, 2, 3, 5, 6, 7, 8, 9},
    "hybrid-nope-rope": {1, 2, 3, 5, 6, 7, 8, 9},
    "hybrid-alibi-shaw": {1, 2, 3, 5, 6, 7, 8, 9},
}


def shift_check(report):
    return next(c for c in report.step(8).checks if c.name.startswith("positions shifted by"))


@pytest.mark.parametrize("name", list(DECODERS))
def test_correct_decoder_passes_every_applicable_step(name):
    model = decoder(**DECODERS[name])
    report = audit(model, eval_length=EVAL_LENGTH)
    got = statuses(report)
    assert report.passed, report.summary()
    assert {n for n, s in got.items() if s == "pass"} == APPLICABLE[name], report.summary()
    assert got[10] == "not_applicable"  # no metadata: training lengths unknown
    assert model.training  # the training flag is restored
    assert not model.blocks[0]._forward_pre_hooks  # and no hook is left behind
    assert not any(point._forward_hooks for point in model.hook_dict.values())
    # Step 8's expected effects, measured: a constant shift changes only absolute methods' logits,
    # zeroing or swapping positions changes every method but NoPE, and never the causal prefix.
    absolute = name in ("learned", "sinusoidal")
    shifted = shift_check(report)
    assert (shifted.value > shifted.tolerance) is absolute
    effects = {c.name: c.value > c.tolerance for c in report.step(8).checks}
    assert effects["zeroed positions"] is (name != "nope")
    assert effects["swap: tokens before the first swapped one"] is False
    assert effects["swap: tokens from the first swapped one on"] is (name != "nope")


# ----------------------------------------------------------------------------- broken models
def test_step5_catches_rope_pairing_swapped():
    """The config declares half pairing; the attention rotates interleaved pairs."""
    model = decoder("rope")
    for block in model.blocks:
        block.attn.cfg = model.cfg.replace(pairing="interleaved")
    report = audit(model, eval_length=EVAL_LENGTH)
    assert report.step(5).status == "fail"
    assert "layer 0 hook_rot_q = R(p) hook_q" in failed_check_names(report, 5)
    detail = next(c.detail for c in report.step(5).checks if c.name == "layer 0 hook_rot_q = R(p) hook_q")
    assert "matches the interleaved pairing instead of the declared half" in detail
    assert report.failed_steps == [5]  # the sign check of step 2 tries both pairings


def test_step2_catches_rope_rotating_the_wrong_way(monkeypatch):
    """R(-p theta) instead of R(+p theta): dot products depend on m - n, every shape unchanged."""
    from nopelens.analyses import audit as audit_module
    from nopelens.models.methods import rope as rope_module

    def backwards(x, ids, rotary_dim, base=10000.0, pairing="half"):
        return audit_module._rotate(x, ids, rotary_dim, base, pairing, direction=-1)

    monkeypatch.setattr(rope_module, "apply_rope", backwards)
    report = audit(decoder("rope"), eval_length=EVAL_LENGTH)
    assert report.step(2).status == "fail"
    assert failed_check_names(report, 2) == ["layer 0 RoPE rotation direction", "layer 1 RoPE rotation direction"]
    assert "the sign is flipped" in report.step(2).failed_checks[0].detail


def test_step2_catches_alibi_sign_flipped():
    model = decoder("alibi")
    for block in model.blocks:
        block.attn.alibi_slopes = -block.attn.alibi_slopes
    report = audit(model, eval_length=EVAL_LENGTH)
    assert report.step(2).status == "fail"
    assert failed_check_names(report, 2) == ["layer 0 ALiBi sign and slopes", "layer 1 ALiBi sign and slopes"]
    assert "sign flipped" in report.step(2).checks[1].detail
    assert report.step(2).evidence["layer0_alibi_fitted_slopes"][0] == pytest.approx(-0.25, abs=1e-5)
    assert report.step(6).status == "fail"  # the contribution is not the reference -m_h (i - j)
    assert report.step(3).status == "pass"  # still a finite bias, not a mask


class UnshiftedDecoder(Decoder):
    """Position ids count every slot, padding included: left padding is not subtracted."""

    def forward(self, tokens, attention_mask=None, position_ids=None, stop_at_layer=None, past_kv=None):
        if position_ids is None:
            start = 0 if past_kv is None else past_kv.length
            position_ids = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens) + start
        return super().forward(tokens, attention_mask, position_ids, stop_at_layer, past_kv)


def test_step1_catches_position_ids_not_shifted_under_left_padding():
    model = UnshiftedDecoder(DecoderConfig(d_vocab=64, n_ctx=32, d_model=32, n_heads=4, position="learned"), seed=0)
    report = audit(model, eval_length=EVAL_LENGTH)
    assert report.step(1).status == "fail"
    assert failed_check_names(report, 1) == ["position ids derived from the mask", "left-padding invariance"]
    assert report.step(2).status == "fail"  # the first real token of the padded row is not at 0
    assert report.step(2).evidence["first_real_token_position"] == [0, EVAL_LENGTH // 4]


class CacheOffsetLostDecoder(Decoder):
    """Each incremental step counts positions from 0 again, ignoring the KV cache's length."""

    def forward(self, tokens, attention_mask=None, position_ids=None, stop_at_layer=None, past_kv=None):
        if past_kv is not None and position_ids is None:
            mask = torch.ones_like(tokens) if attention_mask is None else attention_mask
            position_ids = position_ids_from_mask(mask)
        return super().forward(tokens, attention_mask, position_ids, stop_at_layer, past_kv)


def test_step9_catches_a_lost_cache_offset():
    model = CacheOffsetLostDecoder(DecoderConfig(d_vocab=64, n_ctx=32, d_model=32, n_heads=4, position="rope"), seed=0)
    report = audit(model, eval_length=EVAL_LENGTH)
    assert report.failed_steps == [9]  # the full forward is right; only decoding is wrong
    assert failed_check_names(report, 9) == [
        "cached position assignments",
        "KV cache position ids",
        "cached logits = full forward",
    ]


class OffByOneTableDecoder(Decoder):
    """Looks up the learned table one row late (an OPT-style offset the config does not declare)."""

    def _embed(self, tokens, position_ids):
        return super()._embed(tokens, position_ids + 1)


@pytest.mark.parametrize("layer_clip", [2, 6])
def test_step5_checks_shaw_lookups_against_the_declared_clip(layer_clip):
    """The config declares shaw_clip 4; block 0 clips at another k (its table kept, or too small
    for the declaration): the reference comes from the declaration, as RoPE's base does."""
    model = decoder("shaw", shaw_clip=4)
    model.blocks[0].attn.cfg = model.cfg.replace(shaw_clip=layer_clip)
    if layer_clip > 4:  # a layer built for a wider clip: its table has 2 k + 1 rows
        model.blocks[0].attn.W_rel_K = torch.nn.Parameter(torch.randn(2 * layer_clip + 1, model.cfg.d_head))
    report = audit(model, eval_length=16)
    assert report.step(5).status == "fail"
    assert failed_check_names(report, 5) == ["layer 0 Shaw a^K lookup"]
    assert "clip(j - i, -4, 4)" in next(c.detail for c in report.step(5).checks if not c.passed)
    assert 5 in report.failed_steps and 1 not in report.failed_steps
    unchanged = audit(decoder("shaw", shaw_clip=4), eval_length=16)
    assert unchanged.step(5).status == "pass"


def test_step4_catches_a_table_lookup_off_by_one():
    model = OffByOneTableDecoder(DecoderConfig(d_vocab=64, n_ctx=32, d_model=32, n_heads=4, position="learned"), seed=0)
    report = audit(model, eval_length=EVAL_LENGTH)
    assert report.failed_steps == [4]
    assert failed_check_names(report, 4) == ["hook_pos_embed equals the table"]


# ----------------------------------------------------------------------------- HF models
def hf_model(kind: str, **extra):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, bos_token_id=1, eos_token_id=2, **extra
        )  # GPT-2's own BOS (50256) is outside this vocabulary
        model = GPT2LMHeadModel
    elif kind == "neox":
        config = GPTNeoXConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            vocab_size=64,
            max_position_embeddings=64,
            **extra,
        )
        model = GPTNeoXForCausalLM
    elif kind == "llama":
        config = LlamaConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=64,
            vocab_size=64,
            max_position_embeddings=64,
            **extra,
        )
        model = LlamaForCausalLM
    else:
        config = BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=64, **extra)
        model = BloomForCausalLM
    config._attn_implementation = "eager"
    return model(config)


HF_APPLICABLE = {
    "gpt2": {1, 2, 3, 4, 5, 6, 7, 8, 9},
    "neox": {1, 2, 3, 5, 6, 7, 8, 9},
    "llama": {1, 2, 3, 5, 6, 7, 8, 9},
    "bloom": {1, 2, 3, 5, 6, 7, 8, 9},
}


@pytest.mark.parametrize("kind", list(HF_APPLICABLE))
def test_bridged_hf_model_passes_every_applicable_step(kind):
    extra = {"rotary_pct": 0.5} if kind == "neox" else {}  # 2 rotated pairs: the pairings differ
    model = hf_model(kind, **extra)
    subject = model if kind == "bloom" else bridge_hf_model(model)  # an HF model is bridged by audit()
    report = audit(subject, eval_length=EVAL_LENGTH, train_lengths=[3, 6])
    got = statuses(report)
    assert report.passed, report.summary()
    assert {n for n, s in got.items() if s == "pass"} - {10} == HF_APPLICABLE[kind], report.summary()
    assert report.step(1).evidence["recorded_position_ids"][1] == list(range(EVAL_LENGTH - EVAL_LENGTH // 4))
    if kind == "bloom":  # Bloom's ALiBi is dropped through its alibi tensor
        assert "dropping the bias keeps the blocked set" in [c.name for c in report.step(3).checks]
        assert report.step(2).evidence["layer0_alibi_fitted_slopes"][0] == pytest.approx(0.25, abs=1e-4)
    if kind == "neox":
        assert report.model["rope"]["rotary_dim"] == 4
    shifted = shift_check(report)  # GPT-2's learned table is absolute; RoPE and ALiBi are not
    assert (shifted.value > shifted.tolerance) is (kind == "gpt2")
    assert report.step(10).warnings and "[3, 6]" in report.step(10).summary


def test_step9_catches_the_bridge_ignoring_hf_cache():
    """Without the adapter's fix, TransformerLens 4.3 drops transformers 5's ``cache=`` kwarg."""
    bridge = bridge_hf_model(hf_model("llama"))
    for block in bridge.blocks:
        block.attn._forward_pre_hooks.clear()
    report = audit(bridge, eval_length=EVAL_LENGTH)
    assert report.failed_steps == [9]
    assert "cached logits = full forward" in failed_check_names(report, 9)


# ----------------------------------------------------------------------------- step 10 and reports
def test_step10_warns_past_training_lengths():
    model = decoder("nope", n_layers=1)
    report = audit(model, eval_length=EVAL_LENGTH, metadata={"train_lengths": [3, 6]})
    step = report.step(10)
    assert step.status == "pass" and step.evidence["train_lengths"] == [3, 6]
    assert step.evidence["eval_lengths"] == [EVAL_LENGTH - EVAL_LENGTH // 4, EVAL_LENGTH]
    assert len(step.warnings) == 1 and "not demonstrated length generalization" in step.warnings[0]
    within = audit(model, eval_length=EVAL_LENGTH, train_lengths=[4, 16]).step(10)
    assert within.status == "pass" and within.warnings == []


def test_report_json_markdown_summary_and_atomic_write(tmp_path):
    report = audit(decoder("alibi"), eval_length=8)
    data = json.loads(report.to_json())
    assert [s["number"] for s in data["steps"]] == list(range(1, 11))
    assert all(s["status"] in STATUSES for s in data["steps"])
    assert data["passed"] is True and data["failed_steps"] == []
    markdown = report.to_markdown()
    assert all(f"## Step {n}." in markdown for n in range(1, 11))
    summary = report.summary().splitlines()
    assert len(summary) <= 24 and summary[-1].startswith(" no step failed")
    md, js = report.write(tmp_path / "out")
    assert json.loads(js.read_text()) == data
    assert md.read_text().startswith("# Position audit")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["audit.json", "report.md"]


def test_user_tokens_make_the_probe_batch():
    report = audit(decoder("nope", n_layers=1), tokens=torch.arange(8) + 3)
    assert report.probe["tokens"] == [list(range(3, 11)), [0, 0] + list(range(3, 9))]
    assert report.probe["attention_mask"][1] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert report.step(1).evidence["recorded_position_ids"] == [list(range(8)), list(range(6))]


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="eval_length"):
        audit(decoder("rope"), eval_length=3)
    with pytest.raises(ValueError, match="learned position table"):
        audit(decoder("learned"), eval_length=40)
    with pytest.raises(TypeError, match="Decoder"):
        audit(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="token ids must lie in"):
        audit(decoder("nope", n_layers=1), tokens=torch.tensor([1, 2, 3, 64]))


# ----------------------------------------------------------------------------- CLI
def test_cli_position_demo_writes_reports(tmp_path, capsys):
    assert main(["audit", "--position", "nope,rope", "--eval-length", "6", "--out", str(tmp_path)]) == 0
    assert "no step failed" in capsys.readouterr().out
    assert json.loads((tmp_path / "audit.json").read_text())["model"]["layer_positions"] == ["nope", "rope"]


def test_cli_checkpoint_reads_train_lengths(tmp_path, capsys):
    from nopelens.models.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "ckpt", decoder("rope"), metadata={"train_lengths": [2, 4]})
    assert main(["audit", "--checkpoint", str(tmp_path / "ckpt"), "--eval-length", "6"]) == 0
    out = capsys.readouterr().out
    assert "warning (step 10)" in out and "trained on [2, 4], evaluated at [5, 6] (BEYOND training)" in out


def test_cli_hf_dir(tmp_path, capsys):
    hf_model("gpt2").save_pretrained(tmp_path / "gpt2")
    capsys.readouterr()
    assert main(["audit", "--hf-dir", str(tmp_path / "gpt2"), "--eval-length", "6"]) == 0
    captured = capsys.readouterr()
    assert "HF causal LM via TransformerBridge; input positions: learned" in captured.out
    assert "Warning" not in captured.err


def test_cli_zoo_model_uses_its_metadata(capsys, monkeypatch):
    from nopelens.models import zoo
    from nopelens.models.checkpoint import TrainedModel

    monkeypatch.setattr(zoo, "load", lambda name, progress: TrainedModel(decoder("alibi"), {"train_lengths": [3, 5]}))
    assert main(["audit", "--model", "copy-alibi-3l", "--eval-length", "6"]) == 0
    out = capsys.readouterr().out
    assert "zoo model copy-alibi-3l" in out and "trained on [3, 5]" in out


def test_cli_exit_codes(tmp_path, capsys, monkeypatch):
    assert main(["audit", "--checkpoint", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint directory" in err[0] and "copy-nope-3l" in err[0]
    broken = CacheOffsetLostDecoder(DecoderConfig(d_vocab=64, n_ctx=32, d_model=32, n_heads=4, position="rope"), seed=0)
    monkeypatch.setattr(audit_cmd, "_fresh_decoder", lambda *args: broken)
    assert main(["audit", "--position", "rope", "--eval-length", "6"]) == 1
    assert "FAILED steps: [9]" in capsys.readouterr().out


def test_an_eval_length_whose_layer_attention_cannot_fit_is_refused_before_the_forward_pass(monkeypatch):
    """The audit holds one layer's scores and pattern at a time, of at most 6 rows (the detector's three
    copies of the two-row probe): 6 x 2 x [heads, T, T], whatever the number of layers."""
    from nopelens.probes import stream

    model = decoder("rope", n_layers=4)
    monkeypatch.setattr(stream, "available_memory", lambda device=None: 6 * 2 * 4 * 16**2 * 4 - 1)
    with pytest.raises(
        ValueError,
        match=r"eval_length 16 needs at least 0.0 MiB for one layer's .* \(6 rows x "
        r"\[4, 16, 16\], twice\), more than",
    ):
        audit(model, eval_length=16)
    monkeypatch.setattr(stream, "available_memory", lambda device=None: 6 * 2 * 4 * 16**2 * 4)
    assert audit(model, eval_length=16).passed


def test_cli_out_that_is_a_file_is_refused_before_the_audit(tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    assert main(["audit", "--position", "rope", "--out", str(tmp_path / "afile")]) == 2
    assert "afile or a folder above it is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "mine"


def test_logits_that_are_not_finite_are_refused_not_failed():
    """NaN logits leave every comparison NaN: the audit refuses the model (a failed step would blame its positions)."""
    model = decoder("rope")
    with torch.no_grad():
        model.unembed.W_U[0, 5] = float("nan")
    with pytest.raises(
        ValueError,
        match=r"logits are not finite on the probe's unpadded row \(NaN or inf; every "
        r"attention hook the audit caches is finite",
    ):
        audit(model, eval_length=8)
