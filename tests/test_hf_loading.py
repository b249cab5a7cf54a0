"""HF loading lives in :mod:`nopelens.models.hf_loading` (issue 39): the names it took from
:mod:`nopelens.analyses.subjects` still import from there, and one ``SIZE_FIELDS`` serves both the
config check and the hint for saved weights that do not fit the config."""

import pytest
from safetensors.torch import save_file
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig

from nopelens.analyses import subjects
from nopelens.models import hf, hf_loading

MOVED = (
    "INPUTS",
    "DEVICES",
    "DTYPES",
    "HFInput",
    "eager_attention_bytes",
    "attention_shortfall",
    "load_tokenizer",
    "text_windows",
    "load_hf_dir",
    "checked_hf_config",
    "SIZE_FIELDS",
)


@pytest.mark.parametrize("name", MOVED)
def test_a_moved_name_still_imports_from_subjects_as_the_same_object(name):
    assert getattr(subjects, name) is getattr(hf_loading, name)


def test_one_size_fields_for_the_config_check_and_the_weights_hint():
    assert hf_loading.SIZE_FIELDS is hf.SIZE_FIELDS
    # the check once lacked intermediate_size, the hint every family's own names (n_embd, n_head, ...)
    assert {"intermediate_size", "hidden_size", "n_embd", "d_model", "n_head", "num_heads"} <= set(hf.SIZE_FIELDS)
    with pytest.raises(hf.ConfigError, match="intermediate_size is 0"):
        hf.check_config(LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=0))


def test_the_weights_hint_names_the_sizes_of_the_family_at_hand(tmp_path):
    """GPT-NeoX names its sizes like Llama; a shape mismatch is named with the fields its config gives."""
    config = GPTNeoXConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    weights = {name: tensor.contiguous() for name, tensor in GPTNeoXForCausalLM(config).state_dict().items()}
    config.intermediate_size = 48  # the saved MLP is 32 wide
    config.save_pretrained(tmp_path)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"do not match config\.json .*check hidden_size / num_attention_heads"
        r".* / intermediate_size / vocab_size",
    ):
        hf_loading.load_hf_dir(tmp_path)


def test_the_bos_id_is_read_from_text_config_or_generation_config(tmp_path):
    """Multimodal wrappers (GLM-5 Next, Mistral Large 4, Muse) keep bos_token_id in text_config: it was lost."""
    import json

    config, generation = tmp_path / "config.json", tmp_path / "generation_config.json"
    config.write_text(json.dumps({"model_type": "glm5_next", "text_config": {"bos_token_id": 1}}))
    assert hf_loading.config_bos_id(tmp_path) == 1
    config.write_text(json.dumps({"model_type": "llama", "bos_token_id": None, "text_config": None}))
    assert hf_loading.config_bos_id(tmp_path) is None
    generation.write_text(json.dumps({"bos_token_id": 3}))
    assert hf_loading.config_bos_id(tmp_path) == 3
    config.write_text(json.dumps({"bos_token_id": 2}))  # the config's own comes first
    assert hf_loading.config_bos_id(tmp_path) == 2


def test_saved_weights_the_config_leaves_unused_are_refused(tmp_path):
    """A llama config cut to 1 layer over a 2-layer checkpoint measured a model that was never saved, silently."""
    import json

    from hf_families import build

    build("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    with pytest.raises(
        ValueError,
        match=r"holds weights config\.json does not use \(model\.layers\.1\.input_layernorm"
        r"\.weight, .* and 6 more\); .*check num_hidden_layers \(1; the checkpoint "
        r"holds layer 1\)",
    ):
        hf_loading.load_hf_dir(tmp_path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            {"vocab_size": 10**12},
            r"do not match config\.json \(model\.embed_tokens\.weight: checkpoint \[64, 32\], config "
            r"gives \[1000000000000, 32\]; 1 more tensors differ\)",
        ),
        (
            {"num_hidden_layers": 1000},
            r"config\.json gives a model of [\d,]+ parameters, more than twice the [\d,]+ the "
            r"checkpoint holds: check num_hidden_layers",
        ),
    ],
    ids=["vocab_size", "num_hidden_layers"],
)
def test_a_config_far_larger_than_its_checkpoint_is_refused_before_allocating(tmp_path, monkeypatch, edit, message):
    """vocab_size 10**12, or a wrapper without text_config (full-size defaults), was OOM-killed while loading."""
    import json

    from hf_families import build

    build("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))

    def allocates(*args, **kwargs):
        raise MemoryError("the weights were allocated")

    monkeypatch.setattr(hf_loading.AutoModelForCausalLM, "from_pretrained", allocates)
    with pytest.raises(ValueError, match=message):
        hf_loading.load_hf_dir(tmp_path)
