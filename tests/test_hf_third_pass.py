"""Families third pass (issue 40): per-layer rope dicts with a NoPE type, hybrid SSM models whose
attention is NoPE, MLA without a rope slice, and learned sinks named where attention cannot be read.

Each family is a tiny random-init model (``tests/hf_families.py``'s :data:`DESIGNS`, or DeepSeek V4
built here), saved with ``save_pretrained`` and read back through the command line as a user's
model is; the labels, the Python API path and every refusal are checked, and each family's
config with one field removed or set to None gives a correct run or one clear line and exit 2.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings

import pandas as pd
import pytest
import torch
import transformers
from hf_families import POSITIONS, WINDOW, _instantiate, _tiny, build_design
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nopelens.analyses.cli import main
from nopelens.models import hf
from nopelens.models.adapters import load_hf_model
from nopelens.models.hf import describe
from nopelens.models.hf.config import rope_types

pytestmark = pytest.mark.usefixtures("one_thread")

INTERNAL = re.compile(r"\b(TypeError|KeyError|AttributeError|IndexError|NameError)\b|internal error")


def _deepseek_v4(seed: int = 0):
    """A 2-layer DeepSeek V4 with sink logits that differ by block and head (its init zeroes them)."""
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
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = T.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            block.self_attn.sinks.copy_(torch.arange(4, dtype=torch.float32) / 4 - layer)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a saved HF directory of its tiny model (DeepSeek V4 as ``deepseek_v4``), saved once."""
    root = tmp_path_factory.mktemp("third")
    paths: dict = {}

    def get(family: str) -> str:
        if family not in paths:
            paths[family] = str(root / family)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = _deepseek_v4() if family == "deepseek_v4" else build_design(family)
                model.save_pretrained(paths[family])
        return paths[family]

    return get


# ----------------------------------------------------------------------------- labels and the Python API
def test_a_rope_dict_with_none_for_a_layer_type_makes_that_type_nope():
    """Cohere Compass: ``rope_parameters = {"sliding_attention": {...}, "full_attention": None}``: its
    model passes ``position_embeddings=None`` to the full layer, which is NoPE (measured so by the
    audit in test_hf_designs); a dict keyed by layer type with no entry for a layer's type is named."""
    layers = hf.describe_config(build_design("cohere_compass").config).layers
    assert [(l.method, l.rotary_base, l.pairing) for l in layers] == [("rope", 10000.0, "half")] * 3 + [
        ("nope", None, None)
    ]
    config = build_design("cohere_compass").config
    config.rope_parameters = {"sliding_attention": config.rope_parameters["sliding_attention"]}
    with pytest.raises(hf.ConfigError, match="rope_parameters has entries per layer type .* none for 'full_attention'"):
        hf.describe_config(config)


def test_a_rope_dict_without_a_layer_types_entry_is_named_from_the_command_line(saved, tmp_path, capsys):
    path = _edited(saved("cohere_compass"), tmp_path / "model", "rope_parameters.full_attention", MISSING)
    capsys.readouterr()
    assert main(["audit", "--hf-dir", path]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "config.json: rope_parameters has entries per layer type (sliding_attention) but none for 'full_attention' "
            "(layer 3); give it one, or None for a NoPE layer type"
        )
    )


@pytest.mark.parametrize("family", ["nemotron_h", "zamba2", "zamba2_nope"])
def test_hybrid_ssm_attention_is_hooked_directly_from_the_python_api(family):
    """``load_hf_model(model)`` with no way to reload it (the Python API's ``audit(model)``): their
    bridges fire no hook_pattern, so they go to forward hooks first; the attention blocks' patterns
    are read, the Mamba and MLP blocks have none."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_hf_model(build_design(family))
    description = describe(model)
    assert description.adapter == "forward hooks" and "bridge" in description.notes[0]
    _, cache = model.run_with_cache(torch.randint(3, 64, (1, 8)))
    attention = {l for l, layer in enumerate(description.layers) if layer.mixer == "attention"}
    assert attention == {1, 3}
    assert {l for l in range(4) if f"blocks.{l}.attn.hook_pattern" in cache} == attention


def test_mla_without_a_rope_slice_is_nope_with_the_models_own_sizes():
    """GLM-5.3 (``Glm5NextTextConfig``): qk_rope_head_dim 0 and, by its convention, head_dim 0; its
    attention's heads are qk_nope_head_dim + qk_rope_head_dim = 8 wide, scaled by 8 ** -0.5, NoPE;
    its DSA indexer keeps pools of index_kpool keys."""
    model = build_design("glm5_next")
    text = model.config.get_text_config()
    assert (text.head_dim, text.qk_rope_head_dim, text.qk_nope_head_dim) == (0, 0, 8)
    description = hf.describe_config(model.config)
    assert description.d_head == 8 == model.model.language_model.layers[1].self_attn.qk_head_dim
    attention = description.layers[1]
    assert (attention.method, attention.rotary_dim, attention.score_scale) == ("nope", None, 8**-0.5)
    assert (attention.index_topk, attention.index_block, attention.index_kind) == (POSITIONS, WINDOW, "DSA k-pool")
    assert attention.sparse_reason(POSITIONS) is None
    assert "DSA k-pool indexer keeps only the top 16 blocks of 4 keys" in attention.sparse_reason(POSITIONS + WINDOW)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(qk_rope_head_dim=None), "qk_rope_head_dim is None"),
        (dict(qk_nope_head_dim=-1), "qk_nope_head_dim is -1"),
        (dict(qk_nope_head_dim=0, qk_rope_head_dim=0), "both 0"),
    ],
)
def test_mla_head_sizes_that_cannot_be_read_are_named(fields, message):
    config = build_design("glm5_next").config.get_text_config()
    config.__dict__.update(fields)  # past the strict config's own type check, as a hand-made config would be
    with pytest.raises(hf.ConfigError, match=message):
        hf.check_config(config)


# ----------------------------------------------------------------------------- learned sinks
def test_learned_sinks_are_read_from_the_weights_where_attention_cannot_be(saved, tmp_path, capsys):
    """DeepSeek V4 (refused: compressed attention has no column per key): ``nopelens sinks`` names its
    ``sinks`` parameters and prints their logits per block and head (exit 0, with the reason no mass
    is read); ``nopelens audit`` names them above its one-line refusal (exit 2)."""
    path = saved("deepseek_v4")
    assert main(["sinks", f"hf:{path}", "--input", "random", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "learned sink logits, from the weights (model.layers.{l}.self_attn.sinks, 2 blocks x 4 heads)" in out
    assert "no sink mass read: nopelens cannot read DeepseekV4ForCausalLM: DeepSeek V4's compressed-attention" in out
    table = pd.read_csv(tmp_path / "learned_sinks.csv")
    expected = [h / 4 - layer for layer in range(2) for h in range(4)]
    assert table["sink_logit"].tolist() == pytest.approx(expected)
    assert set(table["parameter"]) == {"model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"}
    assert main(["audit", "--hf-dir", path]) == 2
    captured = capsys.readouterr()
    assert "learned sink logits" in captured.out and "range -1 to 0.75" in captured.out
    assert len(captured.err.strip().splitlines()) == 1 and "compressed-attention" in captured.err


def test_the_audit_names_and_summarises_learned_sinks_per_head(saved, tmp_path, capsys):
    """GPT-OSS: the audit's model record holds each block's per-head sink logits, equal to the weights."""
    path = saved("gpt_oss")
    assert main(["audit", "--hf-dir", path, "--out", str(tmp_path)]) == 0
    assert (
        "learned sink logits, from the weights (model.layers.{l}.self_attn.sinks, 4 blocks x 4 heads)"
        in capsys.readouterr().out
    )
    record = json.loads((tmp_path / "audit.json").read_text())["model"]["learned_sinks"]
    weights = build_design("gpt_oss").model.layers
    for block in range(4):
        assert record["logits_per_block"][str(block)] == pytest.approx(weights[block].self_attn.sinks.tolist())


def test_a_directory_without_a_tokenizer_gives_the_advice_first(saved, capsys):
    assert main(["sinks", f"hf:{saved('gpt_oss')}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert (
        err.split(": error: ", 1)[1]
        .split(" holds no tokenizer: ", 1)[1]
        .startswith("save one there (tokenizer.json and tokenizer_config.json) or use --input random")
    )


# ----------------------------------------------------------------------------- one field off
class _Missing:
    """The field removed from config.json (a fixed repr: test ids must match across xdist workers)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()
FIELDS = {  # family -> config.json fields (dotted: nested) removed (MISSING) or set to None
    "cohere_compass": [
        "rope_parameters",
        "rope_parameters.full_attention",
        "rope_parameters.sliding_attention",
        "layer_types",
        "sliding_window",
        "head_dim",
        "num_key_value_heads",
    ],
    "zamba2_nope": ["use_mem_rope", "layers_block_type", "attention_head_dim", "num_mem_blocks", "hybrid_layer_ids"],
    "nemotron_h": ["layers_block_type", "head_dim", "num_key_value_heads"],
    "glm5_next": [
        "text_config.qk_rope_head_dim",
        "text_config.qk_nope_head_dim",
        "text_config.head_dim",
        "text_config.index_kpool",
        "text_config.index_topk",
        "text_config.layer_types",
        "text_config.indexer_types",
        "text_config.index_kpool_always_select_tail",
    ],
    "deepseek_v4": ["layer_types", "compress_rates", "head_dim", "qk_rope_head_dim"],
}
CASES = [(family, field, value) for family, fields in FIELDS.items() for field in fields for value in (MISSING, None)]


def _edited(source: str, target, field: str, value) -> str:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    *parents, name = field.split(".")
    holder = config
    for parent in parents:
        holder = holder.get(parent) if isinstance(holder, dict) else None
    if isinstance(holder, dict):
        if value is MISSING:
            holder.pop(name, None)
        else:
            holder[name] = value
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


@pytest.mark.parametrize(
    "family, field, value", CASES, ids=[f"{f}-{n}-{'removed' if v is MISSING else 'None'}" for f, n, v in CASES]
)
def test_one_field_off_gives_a_correct_run_or_one_clear_line(saved, tmp_path, capsys, family, field, value):
    path = _edited(saved(family), tmp_path / "model", field, value)
    capsys.readouterr()  # saving the model writes progress bars
    command = (
        ["sinks", f"hf:{path}", "--input", "random", "--quick", "--seq-len", "8", "--n-sequences", "2"]
        if family == "deepseek_v4"
        else ["audit", "--hf-dir", path]
    )
    code = main(command)
    captured = capsys.readouterr()
    if code == 0:
        assert "FAIL" not in captured.out, captured.out
        return
    assert code == 2, (code, captured.out[-2000:], captured.err)
    line = captured.err.strip()
    assert len(line.splitlines()) == 1 and len(line) > 40, line
    assert not INTERNAL.search(line), line


def test_the_probe_screen_is_at_most_100_columns_wide(saved, tmp_path, capsys):
    """``nopelens probe`` on GPT-OSS at the quick defaults: its summary and per-layer tables, and the
    reads it leaves out with their long reasons (a sliding window blocks the pairs further apart),
    fit 100 columns; only the run folder's own path may be longer."""
    out = tmp_path / "probe"
    assert (
        main(
            [
                "probe",
                f"hf:{saved('gpt_oss')}",
                "--input",
                "random",
                "--quick",
                "--jobs",
                "1",
                "--quiet",
                "--no-figures",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "Not applicable:" in printed and "score read: blocks [0, 2]: sliding window 4" in " ".join(printed.split())
    widths = {line: len(line) for line in printed.splitlines() if line != str(out)}
    assert max(widths.values()) <= 100, max(widths, key=widths.get)


def _mamba_only_zamba2(target) -> str:
    config = _tiny(
        transformers.Zamba2Config,
        layers_block_type=["mamba"] * 4,
        mamba_d_state=8,
        mamba_headdim=8,
        n_mamba_heads=8,
        mamba_ngroups=1,
        attention_head_dim=8,
        num_mem_blocks=1,
        use_mem_rope=False,
        chunk_size=8,
        adapter_rank=4,
        time_step_min=1e-9,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _instantiate(config, transformers.Zamba2ForCausalLM, 0, {}).save_pretrained(target)
    return str(target)


@pytest.mark.parametrize(
    "case, message", [("rope entry a string", "is not a valid config"), ("mamba blocks only", "has no attention layer")]
)
def test_a_wrong_typed_field_or_no_attention_layer_is_one_clear_line(saved, tmp_path, capsys, case, message):
    """Found by trying to break the families: a rope entry that is neither a dict nor None made transformers
    raise an AttributeError (exit 3, an internal error), and a model of state-space blocks only failed
    inside step 3 (``max() arg is an empty sequence``)."""
    path = (
        _edited(saved("cohere_compass"), tmp_path / "model", "rope_parameters.full_attention", "nope")
        if case == "rope entry a string"
        else _mamba_only_zamba2(tmp_path / "model")
    )
    capsys.readouterr()
    assert main(["audit", "--hf-dir", path]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and message in line and not INTERNAL.search(line), line


BAD_VALUES = [  # family, config.json field (dotted: nested), a wrong value, what the one line must say
    (
        "zamba2_nope",
        "hybrid_layer_ids",
        [0, 99],
        "hybrid_layer_ids is [0, 99]: it must list the layers whose layers_block_type is 'hybrid' ([1, 3])",
    ),
    ("cohere_compass", "head_dim", "64", "head_dim is '64' (a str): config.json's sizes must be whole numbers"),
    ("zamba2_nope", "attention_head_dim", "64", "attention_head_dim is '64' (a str)"),
    ("zamba2_nope", "head_dim", "64", "head_dim is '64' (a str)"),
    ("nemotron_h", "mamba_num_heads", 4.0, "mamba_num_heads is 4.0 (a float)"),
    ("glm5_next", "text_config.num_hidden_layers", "4", "text_config.num_hidden_layers is '4' (a str)"),
    (
        "glm5_next",
        "architectures",
        MISSING,
        "architectures is missing, and transformers' AutoModelForCausalLM has no "
        "class for model_type 'glm5_next': set architectures to "
        '["Glm5NextForConditionalGeneration"]',
    ),
    ("glm5_next", "architectures", ["Glm5NextModelX"], "architectures is ['Glm5NextModelX'], which names no causal LM"),
    # break-it findings 4-6, 8 (issue 40): raw Python messages, a ZeroDivisionError (exit 3) and a hang before
    (
        "zamba2_nope",
        "hybrid_layer_ids",
        None,
        "hybrid_layer_ids is None: it must list the layers whose layers_block_type is 'hybrid' ([1, 3])",
    ),
    (
        "cohere_compass",
        "rope_parameters.sliding_attention",
        5,
        "rope_parameters.sliding_attention is 5: give a dict of RoPE parameters, or None for a NoPE layer type",
    ),
    (
        "cohere_compass",
        "rope_parameters.sliding_attention.rope_theta",
        "big",
        "rope_parameters.sliding_attention.rope_theta is 'big': the RoPE base of a rotating layer must be a positive",
    ),
    ("gpt_oss", "rope_parameters.rope_theta", None, "rope_parameters.rope_theta is None: the RoPE base"),
    (
        "gpt_oss",
        "rope_parameters.rope_type",
        "nonsense",
        "rope_parameters.rope_type is 'nonsense', which transformers does not know: use one of ",
    ),
    (
        "gpt_oss",
        "rope_parameters.partial_rotary_factor",
        1.5,
        "rope_parameters.partial_rotary_factor is 1.5: the rotated fraction of each head must be above 0 and at most 1",
    ),
    ("gpt_oss", "num_hidden_layers", 10**9, "num_hidden_layers is 1000000000: nopelens describes at most 10000"),
    ("jamba", "attn_layer_period", 0, "attn_layer_period is 0: it must be at least 1"),
    ("jamba", "expert_layer_period", 0, "expert_layer_period is 0: it must be at least 1"),
    ("jamba", "attn_layer_offset", -1, "attn_layer_offset is -1: it must be a whole number, at least 0"),
]


@pytest.mark.parametrize(
    "family, field, value, message", BAD_VALUES, ids=[f"{f}-{n}-{v!r}" for f, n, v, _ in BAD_VALUES]
)
def test_a_bad_value_is_one_short_line_naming_the_field(saved, tmp_path, capsys, family, field, value, message):
    """Found by trying to break the families: a Zamba2 ``hybrid_layer_ids`` naming other layers failed
    in the forward pass (KeyError: 1), a string size gave transformers' "'>' not supported between
    instances of 'str' and 'int'", and GLM-5.3 without a causal-LM ``architectures`` gave transformers'
    3.5 KB list of config classes."""
    path = _edited(saved(family), tmp_path / "model", field, value)
    capsys.readouterr()
    assert main(["audit", "--hf-dir", path]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and len(line) < 400 and not INTERNAL.search(line), line
    assert f"{path}/config.json" in line and message in line, line


def test_the_rope_types_named_are_those_transformers_computes():
    """The valid rope_type values are read from transformers, not listed here: its ``ROPE_INIT_FUNCTIONS``,
    ``default``, and those the config class validates itself."""
    known = rope_types(build_design("gpt_oss").config)
    assert {"default", *ROPE_INIT_FUNCTIONS} <= set(known) and "nonsense" not in known


def test_a_model_without_attention_is_named_by_sinks_and_probe(tmp_path, capsys):
    """A Zamba2 of Mamba blocks only: ``nopelens sinks`` says it has no attention block (it said "sites
    is empty"), and ``nopelens probe`` measures no sink from nothing: no sinks.csv row, each block's
    sink ablation and the sink and variance reads not applicable, as an ssm block."""
    path = _mamba_only_zamba2(tmp_path / "model")
    capsys.readouterr()
    assert main(["sinks", f"hf:{path}", "--input", "random", "--quick"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.endswith(
        "Zamba2ForCausalLM has no attention block (blocks 0-3: ssm (no attention)): no attention "
        "pattern to read, so no attention sink to measure"
    ), line
    out = tmp_path / "probe"
    assert (
        main(
            [
                "probe",
                f"hf:{path}",
                "--input",
                "random",
                "--quick",
                "--jobs",
                "1",
                "--quiet",
                "--no-figures",
                "--seq-len",
                "16",
                "--n-sequences",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = " ".join(capsys.readouterr().out.split())
    assert "sink read: blocks [0, 1, 2, 3]: ssm (no attention)" in printed
    assert "variance read: blocks [0, 1, 2, 3]: ssm (no attention)" in printed
    assert pd.read_csv(out / "sinks.csv").empty
    ablation = pd.read_csv(out / "sink_ablation.csv")
    assert ablation["status"].eq("not_applicable").all() and ablation["note"].eq("ssm (no attention)").all()


def test_mamba_blocks_are_labelled_ssm_not_linear_attention():
    layers = hf.describe_config(build_design("nemotron_h").config).layers
    assert [layer.mixer for layer in layers] == ["ssm", "attention", "none", "attention"]
    assert [layer.label() for layer in layers] == ["ssm (no attention)", "nope", "MLP only (no attention)", "nope"]
    assert hf.describe_config(build_design("qwen3_next").config).layers[0].label() == "linear attention"


@pytest.mark.parametrize(
    "config, rotary_dim",
    [
        # LlamaRotaryEmbedding.compute_default_rope_parameters ignores the factor: the whole head rotates
        (
            lambda: transformers.LlamaConfig(
                hidden_size=32,
                num_attention_heads=4,
                num_hidden_layers=1,
                vocab_size=16,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            ),
            8,
        ),
        # GPT-NeoX's reads it: half of each head rotates
        (
            lambda: transformers.GPTNeoXConfig(
                hidden_size=32,
                num_attention_heads=4,
                num_hidden_layers=1,
                vocab_size=16,
                intermediate_size=16,
                rotary_pct=0.5,
            ),
            4,
        ),
    ],
    ids=["llama ignores it", "gpt_neox reads it"],
)
def test_a_partial_rotary_factor_counts_only_where_the_models_own_rope_reads_it(config, rotary_dim):
    """A false fail found by a break-it run: llama with partial_rotary_factor 0.5 was described as
    rotating 4 of 8 dims, and the audit failed steps 2, 5 and 6 on a model that rotates all 8."""
    layer = hf.describe_config(config()).layers[0]
    assert layer.method == "rope" and layer.rotary_dim == rotary_dim
