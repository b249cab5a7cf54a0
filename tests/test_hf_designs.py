"""Every NoPE, partial-rotation and sink design transformers 5.24 ships, labelled and measured (issue 20).

Each family of ``tests/hf_families.py``'s :data:`DESIGNS` is a tiny random-init model (windows and
chunks of 4 tokens, so they bite at 16). Per family and dtype (float32 and bfloat16):

- the labels nopelens reads from the config (per-layer method, mixer, window or chunk, sink kind,
  query scale) are the expected ones, each trap as transformers' own source has it;
- the per-layer detector's measurement equals the labels, layer by layer, and is definite;
- the audit passes, with every not-applicable step named;
- broken variants fail: a rotating layer declared NoPE (or a NoPE layer declared rotating), a
  window one token off, a learned or output-scale sink dropped.

Models are built once per (family, dtype) and shared; a broken variant changes the description or
the sink logits for one audit and restores them.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from hf_families import DESIGNS, POSITIONS, WINDOW, build_design

from nopelens.analyses.audit import audit
from nopelens.models import hf
from nopelens.models.adapters import load_hf_model
from nopelens.models.hf import LayerPosition, describe

pytestmark = pytest.mark.usefixtures("one_thread")

R, N = "rope", "nope"
BRIDGE, HOOKS = "TransformerBridge", "forward hooks"
EXPECTED = {
    # family: (per-layer methods, adapter, {layer: window or chunk}, {layer: sink kind}, extra label checks)
    "smollm3": ((R, R, R, N), BRIDGE, {}, {}),
    "llama4_text": ((R, R, R, N), BRIDGE, {0: ("chunk", WINDOW), 1: ("chunk", WINDOW), 2: ("chunk", WINDOW)}, {}),
    "cohere2": ((R, R, R, N), BRIDGE, {0: WINDOW, 1: WINDOW, 2: WINDOW}, {}),
    "cohere2_moe": ((R, N, R, N), HOOKS, {0: WINDOW, 2: WINDOW}, {}),
    "exaone4": ((R, N, R, N), BRIDGE, {0: WINDOW, 2: WINDOW}, {}),
    "exaone_moe": ((R, N, R, N), HOOKS, {0: WINDOW, 2: WINDOW}, {}),
    "kolibri1": ((R, N, R, N), HOOKS, {0: WINDOW, 2: WINDOW}, {}),
    "flint": ((N, N, R, N), HOOKS, {2: WINDOW}, dict.fromkeys(range(4), "learned")),
    "lara_mini": ((N, R, N, N), HOOKS, {1: WINDOW}, {}),
    "granite_swa": ((R, N, R, N), HOOKS, {1: WINDOW, 2: WINDOW, 3: WINDOW}, dict.fromkeys(range(4), "output_scale")),
    "granitemoe_swa": ((R, N, R, N), HOOKS, {1: WINDOW, 2: WINDOW, 3: WINDOW}, dict.fromkeys(range(4), "output_scale")),
    "beam": ((R, R, R, N), HOOKS, {0: WINDOW, 1: WINDOW, 2: WINDOW}, {}),
    "cohere_compass": ((R, R, R, N), HOOKS, {0: WINDOW, 1: WINDOW, 2: WINDOW}, {}),
    "olmo_hybrid": ((N, N, N, R), BRIDGE, {}, {}),
    "olmo_hybrid_nope": ((N, N, N, N), BRIDGE, {}, {}),
    "granitemoehybrid": ((N, N, N, N), HOOKS, {}, {}),
    "jamba": ((N, N, N, N), BRIDGE, {}, {}),
    "kimi_linear": ((N, N, N, N), HOOKS, {}, {}),
    "nemotron_h": ((N, N, N, N), HOOKS, {}, {}),
    "qwen3_next": ((N, N, N, R), BRIDGE, {}, {}),
    "qwen4_exp": ((N, N, N, R), HOOKS, {}, {}),
    "minimax_m3": ((R, R, R, R), HOOKS, {}, {}),
    "deepseek_v3": ((R, R, R, R), BRIDGE, {}, {}),
    "deepseek_v2": ((R, R, R, R), BRIDGE, {}, {}),
    "deepseek_v32": ((R, R, R, R), HOOKS, {}, {}),
    "glm4_moe_lite": ((R, R, R, R), BRIDGE, {}, {}),
    "minicpm3": ((R, R, R, R), HOOKS, {}, {}),
    "youtu": ((R, R, R, R), BRIDGE, {}, {}),
    "sarvam_mla": ((R, R, R, R), BRIDGE, {}, {}),
    "longcat_flash": ((R, R, R, R), HOOKS, {}, {}),
    "mistral4": ((R, R, R, R), HOOKS, {}, {}),
    "axk1": ((R, R, R, R), HOOKS, {}, {}),
    "axk2": ((R, R, R, R), HOOKS, {}, {}),
    "glm_moe_dsa": ((R, R, R, R), BRIDGE, {}, {}),
    "bailing_hybrid": ((N, R, N, R), HOOKS, {}, {}),
    "mistral_large4": ((R, R, R, N), HOOKS, {}, {}),
    "muse_glimmer": ((R, N, R, N), HOOKS, {0: WINDOW, 1: WINDOW, 2: WINDOW}, {}),
    "muse_spark": ((R, N, R, N), HOOKS, {0: WINDOW, 1: WINDOW, 2: WINDOW}, {}),
    "gpt_oss": ((R, R, R, R), BRIDGE, {0: WINDOW, 2: WINDOW}, dict.fromkeys(range(4), "learned")),
    "mimo_v2_flash": (
        (R, R, R, R),
        HOOKS,
        {1: WINDOW, 2: WINDOW, 3: WINDOW},
        {1: "learned", 2: "learned", 3: "learned"},
    ),
    "hy_v4": ((R, R, R, R), HOOKS, {}, dict.fromkeys(range(4), "learned")),
    "inkling2": ((N, N, N, N), HOOKS, {0: WINDOW, 2: WINDOW}, dict.fromkeys(range(4), "per_token")),
    "zamba": ((N, N, N, N), HOOKS, {}, {}),
    "zamba2": ((N, R, N, R), HOOKS, {}, {}),
    "zamba2_nope": ((N, N, N, N), HOOKS, {}, {}),
    "glm5_next": ((N, N, N, N), HOOKS, {}, {}),
}
MIXERS = {  # families with layers that are no softmax attention
    "lara_mini": ("linear_attention", "attention", "linear_attention", "attention"),
    "olmo_hybrid": ("linear_attention",) * 3 + ("attention",),
    "olmo_hybrid_nope": ("linear_attention",) * 3 + ("attention",),
    "qwen3_next": ("linear_attention",) * 3 + ("attention",),
    "qwen4_exp": ("linear_attention",) * 3 + ("attention",),
    "granitemoehybrid": ("ssm", "attention") * 2,  # Mamba blocks
    "jamba": ("ssm", "attention") * 2,  # Mamba blocks
    "kimi_linear": ("linear_attention", "attention") * 2,
    "nemotron_h": ("ssm", "attention", "none", "attention"),
    "zamba": ("ssm", "attention") * 2,  # Mamba blocks
    "bailing_hybrid": ("linear_attention", "attention") * 2,
    "zamba2": ("ssm", "attention") * 2,  # Mamba blocks
    "zamba2_nope": ("ssm", "attention") * 2,  # Mamba blocks
    "glm5_next": ("linear_attention", "attention") * 2,
}
READING = {"rope": "relative", "nope": "nope"}
DTYPES = [torch.float32, torch.bfloat16]
NOT_APPLICABLE = {  # step -> what its reason may say
    4: "no absolute position addition",
    6: "not held against|forward hooks|multi-head latent|scales RoPE",
    9: "linear-attention state",
}


def test_every_design_has_an_expectation():
    assert set(DESIGNS) == set(EXPECTED)


@pytest.fixture(scope="module")
def hooked():
    """(family, dtype) -> the model as nopelens hooks it (bridge or forward hooks), built once."""
    cache: dict = {}

    def get(family: str, dtype: torch.dtype):
        if (family, dtype) not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache[family, dtype] = load_hf_model(
                    build_design(family, dtype), reload=lambda: build_design(family, dtype)
                )
        return cache[family, dtype]

    return get


@pytest.fixture(scope="module")
def reports(hooked):
    cache: dict = {}

    def get(family: str, dtype: torch.dtype):
        if (family, dtype) not in cache:
            cache[family, dtype] = audit(hooked(family, dtype), eval_length=16)
        return cache[family, dtype]

    return get


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_labels_from_the_config(hooked, family):
    methods, adapter, windows, sinks = EXPECTED[family]
    description = describe(hooked(family, torch.float32))
    assert description.layer_methods == methods
    assert description.adapter == adapter
    got_windows = {
        l: ("chunk", layer.chunk_size) if layer.chunk_size else layer.sliding_window
        for l, layer in enumerate(description.layers)
        if layer.sliding_window or layer.chunk_size
    }
    assert got_windows == windows
    assert {l: layer.sink for l, layer in enumerate(description.layers) if layer.sink} == sinks
    assert tuple(layer.mixer for layer in description.layers) == MIXERS.get(family, ("attention",) * 4)


def test_the_traps_read_from_transformers_source(hooked):
    layers = {
        family: describe(hooked(family, torch.float32)).layers
        for family in ("beam", "granite_swa", "deepseek_v3", "qwen3_next", "kimi_linear", "llama4_text")
    }
    assert layers["beam"][3].query_scale.kind == "beam" and layers["beam"][3].query_scale.by == "position"
    assert [layer.rotary_base for layer in layers["granite_swa"]] == [10000.0, None, 10000.0, None]
    mla = layers["deepseek_v3"][0]  # [nope | rope] heads: the last qk_rope_head_dim dims rotate
    assert (mla.rotary_dim, mla.rotary_start, mla.pairing) == (4, 4, "interleaved") and mla.qk_reference
    assert layers["qwen3_next"][3].rotary_dim == 2  # partial_rotary_factor 0.25 of head_dim 8
    assert all(layer.rotary_dim is None for layer in layers["kimi_linear"])  # MLA fields, no rotation at all
    llama4 = describe(hooked("llama4_text", torch.float32))
    scale = llama4.layers[3].query_scale  # NoPE layers: temperature tuning, by token index (not position id)
    assert (scale.kind, scale.by, scale.floor_scale) == ("llama4", "index", 8192.0)
    assert all(layer.query_scale is None for layer in llama4.layers[:3])
    assert llama4.layers[3].chunk_size is None and llama4.layers[0].chunk_size == WINDOW  # RoPE layers chunked
    for family in (
        "mistral4",
        "axk1",
        "axk2",
        "glm_moe_dsa",
        "bailing_hybrid",
        "longcat_flash",
        "deepseek_v32",
        "mistral_large4",
    ):
        layer = next(l for l in describe(hooked(family, torch.float32)).layers if l.rotates)  # [nope 4 | rope 4]
        assert (layer.rotary_dim, layer.rotary_start, layer.pairing) == (4, 4, "interleaved"), family
        dsa = ("axk2", "glm_moe_dsa", "deepseek_v32", "mistral_large4")
        assert layer.index_topk == (POSITIONS if family in dsa else None), family


def test_a_multimodal_wrapper_is_hooked_at_its_language_model():
    """Muse Spark as ``...ForConditionalGeneration``, whose audio tower has as many layers as its
    tiny text model (4, at ``model.audio_tower.layers``, first by name): the description comes from
    the text config and the hooks sit on the language model's layers (beside the token embedding)."""
    model = build_design("muse_spark")
    assert len(model.model.audio_tower.layers) == 4
    layout = hf.hook_layout(model)
    assert layout.layers == tuple(f"model.language_model.layers.{l}" for l in range(4))
    assert layout.embed == "model.language_model.embed_tokens" and layout.final_norm == "model.language_model.norm"
    assert hf.describe_config(model.config).family == "muse_spark_text"


def test_rotated_dims_and_block_indexers_as_the_models_compute_them(hooked):
    """MiniMax-M3 rotates head_dim * partial_rotary_factor dims whatever its rotary_dim field says
    (2 here); Qwen4-Exp's QSA layer is labelled with its budget and block size, and its notes say
    its residual hooks hold the hyper-connection streams side by side."""
    for family in ("minimax_m3", "qwen4_exp"):
        model = hooked(family, torch.float32)
        computed = 2 * model.original_model.model.rotary_emb.inv_freq.numel()
        layers = describe(model).layers
        assert {layer.rotary_dim for layer in layers if layer.rotates} == {computed} == {4}, family
    qwen4 = describe(hooked("qwen4_exp", torch.float32))
    assert (qwen4.layers[3].index_topk, qwen4.layers[3].index_block) == (16, 4)
    assert all(layer.index_topk is None for layer in qwen4.layers[:3])
    assert any("2 hyper-connection residual streams" in note for note in qwen4.notes)
    _, cache = hooked("qwen4_exp", torch.float32).run_with_cache(torch.randint(3, 64, (1, 8)))
    assert cache["blocks.3.hook_resid_post"].shape[-1] == 2 * 32


def _tiny_text_model(config_class, model_class, **fields):
    """A 4-layer random-init model of the HF classes, for refusal tests."""
    import transformers as T
    from hf_families import _instantiate, _tiny

    return _instantiate(_tiny(getattr(T, config_class), **fields), getattr(T, model_class), 0, {})


@pytest.mark.parametrize(
    "config_class, model_class, fields, why",
    [
        (
            "Inkling2LoopTextConfig",
            "Inkling2LoopForCausalLM",
            dict(
                head_dim=8,
                swa_num_attention_heads=4,
                swa_num_key_value_heads=2,
                swa_head_dim=8,
                sliding_window_size=WINDOW,
                rel_extent=8,
                d_rel=4,
                layer_types=["hybrid_sliding", "hybrid"] * 2,
                moe_intermediate_size=32,
                n_routed_experts=2,
                num_experts_per_tok=1,
                n_layers_per_attn_res_block=1,
                unpadded_vocab_size=64,
                loop_layer_index_start=1,
                loop_layer_index_end=3,
                loop_num_passes=2,
                loop_gate_rank=4,
            ),
            "loop layers .* loop_num_passes times",
        ),
        (
            "MiniMaxM3VLTextConfig",
            "MiniMaxM3VLForCausalLM",
            dict(
                head_dim=8,
                num_local_experts=2,
                num_experts_per_tok=1,
                shared_intermediate_size=32,
                dense_intermediate_size=64,
                index_n_heads=2,
                index_head_dim=8,
                index_block_size=4,
                index_topk_blocks=2,
                layer_types=["full_attention", "minimax_m3_sparse"] * 2,
            ),
            "minimax_m3_sparse .* position id",
        ),
    ],
    ids=["inkling2_loop", "minimax_m3_sparse"],
)
def test_a_looped_or_block_sparse_model_is_refused_in_one_line(config_class, model_class, fields, why):
    """Inkling 2 Loop (one layer module, several passes) and MiniMax-M3 with a block-sparse layer
    (blocks placed by position id): both give false fails or crashes when measured (steps 3 and 7; an
    index error under re-spaced positions), so both are refused by name before any forward pass."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _tiny_text_model(config_class, model_class, **fields)
    with pytest.raises(hf.UnsupportedModelError, match=f"{model_class}: .*{why}") as error:
        load_hf_model(model)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_dots3_note_is_refused_in_one_line():
    """Dots3-Note's text config holds per-layer attention shapes (``per_layer_config``), which
    nopelens does not read: refused by name, in one line, never measured wrong."""
    import transformers as T
    from hf_families import _instantiate, _tiny

    config = _tiny(
        T.Dots3NoteTextConfig,
        q_lora_rank=16,
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        mlp_layer_types=["dense"] + ["sparse"] * 3,
        index_head_dim=8,
        index_n_heads=2,
        index_topk=64,
        sliding_window=WINDOW,
        layer_types=["indexed_attention", "sliding_attention"] * 2,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        num_key_value_heads=4,
    )
    model = _instantiate(config, T.Dots3NoteForCausalLM, 0, {})
    with pytest.raises(hf.UnsupportedModelError, match="Dots3NoteForCausalLM.*per-layer") as error:
        load_hf_model(model)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_the_detector_measures_the_labels_and_the_audit_passes(reports, family, dtype):
    report = reports(family, dtype)
    declared = [READING[m] for m in EXPECTED[family][0]]
    if family == "beam":  # its NoPE layer scales queries by position: shown, or within round-off (bfloat16)
        assert report.model["measured_layer_positions"][3] in ("query_scaled", "undetermined")
        declared[3] = report.model["measured_layer_positions"][3]
    assert report.model["measured_layer_positions"] == declared, report.summary()
    assert report.passed, report.summary()
    for step in report.steps:
        if step.status == "not_applicable" and step.number in NOT_APPLICABLE:
            assert any(text in step.reason for text in NOT_APPLICABLE[step.number].split("|")), step.reason


README_ROWS = {  # family -> the first cell of its row in README's table of designs
    "smollm3": "SmolLM3",
    "llama4_text": "Llama 4 text",
    "cohere2": "Cohere2",
    "cohere2_moe": "Cohere2-MoE",
    "exaone4": "EXAONE 4",
    "exaone_moe": "EXAONE-MoE, Kolibri1",
    "kolibri1": "EXAONE-MoE, Kolibri1",
    "flint": "Flint",
    "lara_mini": "Lara-mini",
    "granite_swa": "Granite SWA, GraniteMoe SWA",
    "granitemoe_swa": "Granite SWA, GraniteMoe SWA",
    "beam": "Beam",
    "olmo_hybrid": "OLMo-Hybrid",
    "olmo_hybrid_nope": "OLMo-Hybrid, as released",
    "granitemoehybrid": "GraniteMoeHybrid",
    "jamba": "Jamba",
    "kimi_linear": "Kimi Linear",
    "nemotron_h": "Nemotron-H",
    "qwen3_next": "Qwen3-Next",
    "qwen4_exp": "Qwen4-Exp",
    "minimax_m3": "MiniMax-M3 text",
    "deepseek_v3": "DeepSeek V3",
    "deepseek_v2": "DeepSeek V2",
    "deepseek_v32": "DeepSeek V3.2",
    "glm4_moe_lite": "GLM-4-MoE-Lite, Youtu, Sarvam-MLA",
    "youtu": "GLM-4-MoE-Lite, Youtu, Sarvam-MLA",
    "sarvam_mla": "GLM-4-MoE-Lite, Youtu, Sarvam-MLA",
    "minicpm3": "MiniCPM3",
    "longcat_flash": "LongCat-Flash",
    "mistral4": "Mistral 4, AXK1",
    "axk1": "Mistral 4, AXK1",
    "axk2": "AXK2, GLM-MoE-DSA",
    "glm_moe_dsa": "AXK2, GLM-MoE-DSA",
    "bailing_hybrid": "Bailing-Hybrid",
    "mistral_large4": "Mistral Large 4 (`...ForConditionalGeneration`)",
    "muse_glimmer": "Muse Glimmer, Muse Spark (`...ForConditionalGeneration`)",
    "muse_spark": "Muse Glimmer, Muse Spark (`...ForConditionalGeneration`)",
    "gpt_oss": "GPT-OSS",
    "mimo_v2_flash": "MiMo-V2-Flash",
    "hy_v4": "HY-V4",
    "inkling2": "Inkling 2",
    "zamba": "Zamba",
    "zamba2": "Zamba2",
    "zamba2_nope": "Zamba2, as shipped",
    "cohere_compass": "Cohere Compass",
    "glm5_next": "GLM-5.3 (`...ForConditionalGeneration`)",
}
ALWAYS_NOT_APPLICABLE = {4, 10}  # no absolute position addition; training lengths unknown


def _readme_not_applicable() -> dict[str, set[int]]:
    """Row name -> the steps its audit column lists as n/a ("pass (n/a 2, 6; ...)")."""
    text = (Path(__file__).parents[1] / "docs" / "hooking.md").read_text()
    table = text.split("| family | layers (tiny config) |")[1].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        listed = re.match(r"pass(?: \(n/a ([\d, ]+))?", cells[-1])
        assert listed, cells[-1]
        rows[cells[0]] = {int(n) for n in (listed.group(1) or "").replace(" ", "").split(",") if n}
    return rows


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_the_readme_table_lists_the_steps_the_audit_cannot_apply(reports, family):
    listed = _readme_not_applicable()[README_ROWS[family]]
    for dtype in DTYPES:
        report = reports(family, dtype)
        measured = {s.number for s in report.steps if s.status == "not_applicable"} - ALWAYS_NOT_APPLICABLE
        assert measured == listed, (family, dtype, measured)


def test_step_2_gives_the_nope_reason_only_where_every_layer_is_nope(reports):
    for family in sorted(EXPECTED):
        step2 = reports(family, torch.float32).steps[1]
        if step2.status == "not_applicable" and "NoPE" in step2.reason:
            assert set(EXPECTED[family][0]) == {"nope"}, (family, step2.reason)


def _redeclared(model, layer: int, spec: LayerPosition):
    """The description with ``layer`` replaced (the model keeps computing what it computes)."""
    right = describe(model)
    layers = list(right.layers)
    layers[layer] = spec
    return right, dataclasses.replace(right, layers=tuple(layers))


def _audit_declared(model, description):
    right = describe(model)
    hf._DESCRIPTIONS[model] = description
    try:
        return audit(model, eval_length=16)
    finally:
        hf._DESCRIPTIONS[model] = right


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_a_mislabelled_layer_fails_step_5_by_name(hooked, family, dtype):
    """A rotating layer declared NoPE; where no layer rotates, a NoPE attention layer declared RoPE."""
    model = hooked(family, dtype)
    layers = describe(model).layers
    rotating = [l for l, layer in enumerate(layers) if layer.rotates]
    if rotating:
        layer = rotating[-1]
        spec = dataclasses.replace(layers[layer], method="nope", rotary_dim=None, rotary_base=None, pairing=None)
        declared = "nope"
    else:
        layer = next(l for l, spec in enumerate(layers) if spec.mixer == "attention")
        spec = dataclasses.replace(layers[layer], method="rope", rotary_dim=8, rotary_base=10000.0, pairing="half")
        declared = "relative"
    report = _audit_declared(model, _redeclared(model, layer, spec)[1])
    names = [c.name for c in report.step(5).failed_checks]
    assert f"layer {layer} reads positions as declared ({declared})" in names, report.summary()


WINDOWED = sorted(f for f, expected in EXPECTED.items() if any(not isinstance(w, tuple) for w in expected[2].values()))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", WINDOWED)
def test_a_window_one_token_off_fails_step_3(hooked, family, dtype):
    model = hooked(family, dtype)
    layers = describe(model).layers
    layer = next(l for l, spec in enumerate(layers) if spec.sliding_window)
    spec = dataclasses.replace(layers[layer], sliding_window=layers[layer].sliding_window + 1)
    report = _audit_declared(model, _redeclared(model, layer, spec)[1])
    assert "allowed entries keep weight > 0" in [c.name for c in report.step(3).failed_checks], report.summary()


def test_a_chunk_one_token_off_fails_step_3(hooked):
    model = hooked("llama4_text", torch.float32)
    layers = describe(model).layers
    spec = dataclasses.replace(layers[0], chunk_size=WINDOW - 1)
    report = _audit_declared(model, _redeclared(model, 0, spec)[1])
    assert "blocked entries have exactly zero weight" in [c.name for c in report.step(3).failed_checks]


SINKS = sorted(f for f, expected in EXPECTED.items() if expected[3])


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", SINKS)
def test_a_dropped_sink_fails_step_7(hooked, family, dtype):
    """The model's sink logits set to -inf (the sink takes no mass) while its config still declares it:
    learned sinks (a ``sinks`` parameter) filled with -inf, per-token sinks (Inkling 2's ``sink_proj``,
    one logit per query token) made to output -inf."""
    model = hooked(family, dtype)
    sinks = [p for name, p in model.original_model.named_parameters() if name.endswith("sinks")]
    per_token = [m for name, m in model.original_model.named_modules() if name.endswith("sink_proj")]
    assert sinks or per_token
    saved = [p.detach().clone() for p in sinks]
    handles = [m.register_forward_hook(lambda m, i, out: torch.full_like(out, float("-inf"))) for m in per_token]
    try:
        with torch.no_grad():
            for p in sinks:
                p.fill_(float("-inf"))
        report = audit(model, eval_length=16)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for p, value in zip(sinks, saved):
                p.copy_(value)
    assert "declared sinks take mass" in [c.name for c in report.step(7).failed_checks], report.summary()


def test_an_undeclared_learned_sink_fails_step_7(hooked):
    model = hooked("gpt_oss", torch.float32)
    layers = describe(model).layers
    report = _audit_declared(model, _redeclared(model, 1, dataclasses.replace(layers[1], sink=None))[1])
    assert "unmasked rows sum to 1" in [c.name for c in report.step(7).failed_checks], report.summary()


# ----------------------------------------------------------------------------- the command line
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> the tiny float32 design saved as an HF directory (save_pretrained), saved once."""
    root = tmp_path_factory.mktemp("designs")
    paths: dict = {}

    def get(family: str, **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in paths:
            paths[key] = str(root / f"{family}{len(paths)}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                build_design(family, **overrides).save_pretrained(paths[key])
        return paths[key]

    return get


def _probe(path: str, out, capsys) -> "pd.DataFrame":
    """``nopelens probe hf:DIR`` at 8 tokens x 4 sequences, tables only (``--no-figures``: figures
    do not depend on the design, and drawing them was half the time): exit 0, and its sink table."""
    import pandas as pd

    from nopelens.analyses.cli import main

    code = main(
        [
            "probe",
            f"hf:{path}",
            "--input",
            "random",
            "--quick",
            "--seq-len",
            "8",
            "--n-sequences",
            "4",
            "--quiet",
            "--jobs",
            "1",
            "--sites",
            "resid",
            "--no-figures",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err
    return pd.read_csv(out / "sinks.csv")


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_every_design_runs_from_the_command_line(saved, tmp_path, capsys, family):
    """``nopelens audit --hf-dir DIR`` passes (exit 0) and ``nopelens probe hf:DIR`` measures every
    attention block's sinks: each design saved as an HF directory, read back as a user's model is."""
    from nopelens.analyses.cli import main

    path = saved(family)
    code = main(["audit", "--hf-dir", path])
    out = capsys.readouterr().out
    assert code == 0 and "no step failed" in out, f"{family}: {out}"
    sinks = _probe(path, tmp_path / "probe", capsys)
    attention = {l for l, mixer in enumerate(MIXERS.get(family, ("attention",) * 4)) if mixer == "attention"}
    assert set(sinks["block"]) == attention
    learned = sinks[sinks["learned_sink_mass"].notna()] if "learned_sink_mass" in sinks else sinks.iloc[:0]
    declared = set(EXPECTED[family][3])  # learned, per-token and output-scale sinks: each reports its mass
    assert set(learned["block"]) == declared and (learned["learned_sink_mass"] > 0).all()


@pytest.mark.slow
def test_dsa_past_index_topk_probes_with_the_reads_not_applicable(saved, tmp_path, capsys):
    """``nopelens probe`` on DeepSeek V3.2 with index_topk 4 at 8 tokens: exit 0, the position probes
    measured, no sink row (each block's kept keys are chosen by content), the reason recorded and
    printed under the summary (not "variance 0": the read never ran), and with ``--no-figures`` no
    figure drawn or linked; with index_topk 8 every block's sinks are read."""
    import json

    sinks = _probe(saved("deepseek_v32", index_topk=4), tmp_path / "sparse", capsys)
    assert sinks.empty
    printed = capsys.readouterr().out
    assert "variance 0" not in printed and "NaN" not in printed, printed
    assert (
        not list((tmp_path / "sparse").glob("*.png")) and "![" not in (tmp_path / "sparse" / "summary.md").read_text()
    )
    assert "variance read: blocks [0, 1, 2, 3]: a DSA indexer keeps only the top 4" in printed, printed
    (done,) = (tmp_path / "sparse" / "parts").glob("*/done.json")
    notes = json.loads(done.read_text())["not_applicable"]
    assert all(
        "DSA indexer keeps only the top 4" in notes[read] for read in ("sink read", "variance read", "score read")
    )
    assert set(_probe(saved("deepseek_v32", index_topk=8), tmp_path / "dense", capsys)["block"]) == {0, 1, 2, 3}


def test_labels_of_designs_without_a_tiny_model():
    """Labels from shipped-size text configs alone (Mistral Large 4, Muse Glimmer / Spark, built tiny
    above as multimodal wrappers; DeepSeek V4, which nopelens refuses), and the shipped default
    configs of built ones (Inkling 2, Zamba2): the rules still apply."""
    import transformers as T

    from nopelens.models.hf import describe_config

    def layers(config):
        return describe_config(config).layers

    large4 = layers(T.MistralLarge4TextConfig(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0]))
    assert [l.method for l in large4] == [R, R, R, N] and (large4[0].rotary_start, large4[0].rotary_dim) == (64, 64)
    for config in (T.MuseGlimmerTextConfig, T.MuseSparkTextConfig):
        assert [l.method for l in layers(config(num_hidden_layers=4, layer_rope_theta=[1e4, 0, 1e4, 0]))] == [
            R,
            N,
            R,
            N,
        ]
    inkling = layers(T.Inkling2TextConfig(num_hidden_layers=6))
    assert {l.method for l in inkling} == {N} and {l.sink for l in inkling} == {"per_token"}
    assert (inkling[0].sliding_window, inkling[0].relative_bias) == (1024, 1024) and inkling[5].relative_bias == 1024
    v4 = layers(T.DeepseekV4Config(num_hidden_layers=2))[0]
    assert v4.sink == "learned" and v4.rotary_start == 512 - v4.rotary_dim and v4.qk_reference
    zamba2 = T.Zamba2Config(num_hidden_layers=4, layers_block_type=["mamba", "hybrid"] * 2)
    assert [l.method for l in layers(zamba2)] == [N] * 4
    zamba2.use_mem_rope = True
    assert [l.method for l in layers(zamba2)] == [N, R, N, R]


# ----------------------------------------------------------------------------- DeepSeek Sparse Attention
@pytest.fixture(scope="module")
def dsa():
    """DeepSeek V3.2 with index_topk 8: its indexer bites on 16-token sequences, not on 8."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_hf_model(build_design("deepseek_v32", index_topk=8))


def _dropped_visible_keys(model, length: int, layer: int = 0) -> int:
    """Visible (causal) entries of ``layer``'s pattern with exactly zero weight on ``length`` tokens."""
    tokens = torch.randint(3, 64, (2, length), generator=torch.Generator().manual_seed(0))
    _, cache = model.run_with_cache(tokens)
    pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
    visible = torch.ones(length, length, dtype=torch.bool).tril()
    return int((pattern[..., visible] == 0).sum())


def test_dsa_past_index_topk_is_not_applicable_with_the_reason(dsa):
    assert _dropped_visible_keys(dsa, 16) > 0  # the indexer drops keys a query can see: no static mask holds
    report = audit(dsa, eval_length=16)
    assert report.passed, report.summary()
    for number in (3, 5, 7, 8):
        step = report.step(number)
        assert step.status == "not_applicable" and "DSA indexer keeps only the top 8" in step.reason, step.reason
    assert "left-padding invariance" not in [c.name for c in report.step(1).checks]
    assert "DSA indexer" in report.step(1).evidence["not_checked"]
    assert "measured_layer_positions" not in report.model


def test_dsa_within_index_topk_is_measured(dsa):
    assert _dropped_visible_keys(dsa, 8) == 0  # every query sees at most 8 keys: the indexer keeps them all
    report = audit(dsa, eval_length=8)
    assert report.passed, report.summary()
    assert all(report.step(n).status == "pass" for n in (1, 3, 5, 7, 8, 9))
    assert "left-padding invariance" in [c.name for c in report.step(1).checks]
    assert report.model["measured_layer_positions"] == ["relative"] * 4


def test_qsa_past_its_budget_is_not_applicable_with_the_reason():
    """Qwen4-Exp with indexer_budget 8 in blocks of 4: at 16 tokens its QSA layer drops visible keys
    (no static mask holds): steps 3, 5, 7 and 8 not applicable with the reason, no false fail; at 11
    tokens (under budget + block) it keeps every key and is measured."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_hf_model(build_design("qwen4_exp", indexer_budget=8))
    assert _dropped_visible_keys(model, 16, layer=3) > 0 and _dropped_visible_keys(model, 11, layer=3) == 0
    report = audit(model, eval_length=16)
    assert report.passed, report.summary()
    for number in (3, 5, 7, 8):
        step = report.step(number)
        assert step.status == "not_applicable" and "QSA indexer keeps only the top 2 blocks of 4" in step.reason
    report = audit(model, eval_length=11)
    assert report.passed and report.model["measured_layer_positions"] == ["nope"] * 3 + ["relative"], report.summary()


@pytest.mark.parametrize("off", [-1, 1])
def test_a_relative_bias_extent_one_off_fails_step_5(hooked, off):
    """Inkling 2's bias by token distance is read from hook_pos_bias: zero from rel_extent on, and
    nonzero at every distance below it, so a declared extent one token off fails either way."""
    model = hooked("inkling2", torch.float32)
    layers = describe(model).layers
    assert (layers[1].relative_bias, layers[0].relative_bias) == (
        8,
        WINDOW,
    )  # full layers rel_extent; sliding: the window
    report = audit(model, eval_length=16)
    assert {"layer 1 relative bias is zero beyond rel_extent 8", "layer 1 relative bias acts below rel_extent 8"} <= {
        c.name for c in report.step(5).checks if c.passed
    }
    spec = dataclasses.replace(layers[1], relative_bias=8 + off)
    report = _audit_declared(model, _redeclared(model, 1, spec)[1])
    failed = [c.name for c in report.step(5).failed_checks]
    check = "is zero beyond" if off < 0 else "acts below"
    assert f"layer 1 relative bias {check} rel_extent {8 + off}" in failed, report.summary()


def test_deepseek_v4_is_refused_in_one_line():
    """DeepSeek V4's compressed-attention layers append compressed entries to the key axis (no
    pattern column per key token): refused by name before any forward pass (built on the meta device)."""
    import transformers as T

    config = T.DeepseekV4Config(
        vocab_size=64,
        hidden_size=32,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        q_lora_rank=16,
        n_routed_experts=2,
        num_experts_per_tok=1,
        index_n_heads=2,
        index_head_dim=8,
        o_groups=2,
        o_lora_rank=8,
    )
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.DeepseekV4ForCausalLM(config)
    with pytest.raises(hf.UnsupportedModelError, match="DeepseekV4ForCausalLM.*compress") as error:
        load_hf_model(model)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "family, note",
    [
        (
            "llama4_text",
            "blocks 0-3: no pre-softmax scores to read (the bridge's hook_attn_scores is not the scores behind",
        ),
        ("jamba", "blocks 1,3: no pre-softmax scores to read"),  # its Mamba blocks 0 and 2 have no attention to score
        (
            "granite_swa",
            "blocks 0-3: no pre-softmax scores to read (hooked with forward hooks, not through TransformerBridge",
        ),
    ],
)
def test_a_score_read_without_scores_says_which_blocks_and_why(saved, family, note):
    """Their head-score column read n/a at every layer with no reason in not_applicable."""
    from nopelens.analyses.subjects import HFInput, resolve
    from nopelens.analyses.sweep import sweep_sites

    subject = resolve(f"hf:{saved(family)}", 4, 8, seed=0, progress=False, hf_input=HFInput(input="random"))
    assert not sweep_sites(subject).scores
    assert subject.info["not_applicable"]["score read"].startswith(note), subject.info["not_applicable"]
