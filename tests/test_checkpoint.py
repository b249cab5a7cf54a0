"""Checkpoints: round trip, atomic replace, and refusals that name the problem."""

import json
import os

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from nopelens.models import Decoder, DecoderConfig
from nopelens.models.checkpoint import (
    DESCRIPTION_DIGEST,
    METADATA_FILE,
    WEIGHTS_FILE,
    TrainedModel,
    description_digest,
    load_checkpoint,
    save_checkpoint,
)

CFG = DecoderConfig(d_vocab=12, n_ctx=16, n_layers=2, d_model=16, n_heads=2, position="learned")


@pytest.fixture
def saved(tmp_path):
    model = Decoder(CFG, seed=3)
    curve = pd.DataFrame({"step": [1, 2], "loss": [2.5, 2.0]})
    trained = TrainedModel(model, {"task": {"name": "copy", "kwargs": {"n_symbols": 8}}, "seed": 3}, curve)
    path = save_checkpoint(tmp_path / "ckpt", trained, {"steps": 2})
    return path, model


def test_round_trip_same_logits_metadata_and_curve(saved):
    path, model = saved
    loaded = load_checkpoint(path)
    tokens = torch.randint(0, 12, (3, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded.model(tokens), model(tokens))
    assert loaded.config == CFG
    meta = loaded.metadata
    assert meta["format"] == "nopelens-checkpoint" and meta["steps"] == 2 and meta["seed"] == 3
    assert "nopelens_version" in meta and meta["config"]["position"] == "learned"
    assert loaded.loss_curve["loss"].tolist() == [2.5, 2.0]
    assert loaded.task.d_vocab == 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_checkpoint_keeps_its_dtype_unless_asked_for_another(tmp_path, dtype):
    model = Decoder(CFG.replace(position="rope"), seed=3, dtype=dtype)
    path = save_checkpoint(tmp_path / "ckpt", model)
    assert json.loads((path / METADATA_FILE).read_text())["dtype"] == str(dtype).removeprefix("torch.")
    loaded = load_checkpoint(path).model
    tokens = torch.randint(0, 12, (2, 9), generator=torch.Generator().manual_seed(0))
    for name, param in loaded.state_dict().items():
        assert param.dtype == dtype and torch.equal(param, model.state_dict()[name]), name
    assert torch.equal(loaded(tokens), model(tokens)) and loaded(tokens).dtype == dtype
    upcast = load_checkpoint(path, dtype=torch.float64).model
    for name, param in upcast.state_dict().items():
        assert param.dtype == torch.float64 and torch.equal(param, model.state_dict()[name].double()), name


def test_hybrid_config_round_trip(tmp_path):
    cfg = DecoderConfig(d_vocab=10, n_ctx=8, n_layers=2, d_model=16, n_heads=2, position=["nope", "rope"])
    model = Decoder(cfg, seed=0)
    loaded = load_checkpoint(save_checkpoint(tmp_path / "hybrid", model))
    assert loaded.config == cfg
    assert loaded.loss_curve.empty


def test_overwrite_replaces_atomically_and_leaves_no_temp(saved, tmp_path):
    path, _ = saved
    other = Decoder(CFG, seed=4)
    save_checkpoint(path, other)
    assert torch.equal(load_checkpoint(path).model.embed.W_E, other.embed.W_E)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o777 & ~mask  # as mkdir makes it, not mkdtemp's 0o700
    assert (path / WEIGHTS_FILE).stat().st_mode & 0o777 == 0o666 & ~mask


def test_metadata_that_is_not_json_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="checkpoint metadata is not JSON-serializable"):
        save_checkpoint(tmp_path / "bad", Decoder(CFG), {"when": object()})
    assert list(tmp_path.iterdir()) == []  # the staging folder is gone
    path = save_checkpoint(tmp_path / "ckpt", Decoder(CFG), {"d": {1: "a", "b": 2}})  # JSON: keys become strings
    assert load_checkpoint(path).metadata["d"] == {"1": "a", "b": 2}


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a nopelens checkpoint"):
        save_checkpoint(tmp_path / "notes", Decoder(CFG))
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_missing_path_and_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nothing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a nopelens checkpoint.*no nopelens.json"):
        load_checkpoint(tmp_path / "plain")
    (tmp_path / "file.bin").write_bytes(b"\x00")
    with pytest.raises(ValueError, match="not a nopelens checkpoint"):
        load_checkpoint(tmp_path / "file.bin")
    other = tmp_path / "other"
    other.mkdir()
    (other / METADATA_FILE).write_text(json.dumps({"format": "someone-else"}))
    with pytest.raises(ValueError, match="format marker is 'someone-else'"):
        load_checkpoint(other)


def _rewrite(path, tensors, meta=None):
    """Replace the weights (and the JSON, if ``meta`` is given), reseal the description and re-record
    the weights' sha256, as a careful forger would."""
    from nopelens.models.io import file_sha256

    meta = meta or json.loads((path / METADATA_FILE).read_text())
    save_file(tensors, path / WEIGHTS_FILE, metadata={DESCRIPTION_DIGEST: description_digest(meta)})
    meta["sha256"][WEIGHTS_FILE] = file_sha256(path / WEIGHTS_FILE)
    (path / METADATA_FILE).write_text(json.dumps(meta))


def _forge_json(path, edit):
    """Edit ``nopelens.json`` with ``edit(meta)`` and reseal it, to reach the checks behind the seal."""
    meta = json.loads((path / METADATA_FILE).read_text())
    edit(meta)
    _rewrite(path, load_file(path / WEIGHTS_FILE), meta)


@pytest.mark.parametrize(
    "edit",
    [
        lambda meta: meta["config"].update(position="rope"),  # same shapes: it would load as another model
        lambda meta: meta.update(steps=99),
        lambda meta: meta["sha256"].pop("loss_curve.csv"),
        lambda meta: meta.update(note="added"),
    ],
)
def test_an_edited_json_is_refused(saved, edit):
    path, _ = saved
    meta = json.loads((path / METADATA_FILE).read_text())
    edit(meta)
    (path / METADATA_FILE).write_text(json.dumps(meta, indent=4))
    with pytest.raises(ValueError, match="nopelens.json was edited after the checkpoint was written"):
        load_checkpoint(path)


def test_the_json_may_be_reformatted_and_an_unsealed_older_checkpoint_loads(saved):
    path, model = saved
    meta = json.loads((path / METADATA_FILE).read_text())
    (path / METADATA_FILE).write_text(json.dumps(meta, indent=1, sort_keys=False))  # same description
    assert torch.equal(load_checkpoint(path).model.embed.W_E, model.embed.W_E)
    as_jq_writes = json.loads(
        (path / METADATA_FILE).read_text(),
        parse_float=lambda text: int(float(text)) if float(text).is_integer() else float(text),
    )  # 10000.0 -> 10000, the same JSON number
    assert json.dumps(as_jq_writes) != json.dumps(meta)  # (as dicts they are equal: 10000 == 10000.0)
    (path / METADATA_FILE).write_text(json.dumps(as_jq_writes))
    assert torch.equal(load_checkpoint(path).model.embed.W_E, model.embed.W_E)
    from nopelens.models.io import file_sha256

    save_file(load_file(path / WEIGHTS_FILE), path / WEIGHTS_FILE)  # no digest, as written before it existed
    meta["sha256"][WEIGHTS_FILE] = file_sha256(path / WEIGHTS_FILE)
    meta["steps"] = 5
    (path / METADATA_FILE).write_text(json.dumps(meta))
    assert load_checkpoint(path).metadata["steps"] == 5


def test_missing_and_extra_tensors_are_named(saved):
    path, _ = saved
    tensors = load_file(path / WEIGHTS_FILE)
    del tensors["blocks.1.attn.W_Q"]
    tensors["blocks.9.attn.W_Q"] = torch.zeros(2, 16, 8)
    _rewrite(path, tensors)
    with pytest.raises(
        ValueError, match=r"missing tensors \['blocks.1.attn.W_Q'\]; extra tensors \['blocks.9.attn.W_Q'\]"
    ):
        load_checkpoint(path)


def test_config_not_matching_weight_shapes(saved):
    path, _ = saved
    _forge_json(path, lambda meta: meta["config"].update(n_ctx=32))
    with pytest.raises(ValueError, match=r"pos_embed.W_pos: config gives \(32, 16\), weights have \(16, 16\)"):
        load_checkpoint(path)


def test_config_with_another_method_has_missing_tensors(saved):
    path, _ = saved
    _forge_json(path, lambda meta: meta["config"].update(position="nope"))
    with pytest.raises(ValueError, match=r"extra tensors \['pos_embed.W_pos'\]"):
        load_checkpoint(path)


def test_corrupted_weights_and_json(saved):
    path, _ = saved
    data = bytearray((path / WEIGHTS_FILE).read_bytes())
    data[-5] ^= 0xFF
    (path / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors is corrupted"):
        load_checkpoint(path)
    (path / METADATA_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="corrupted"):
        load_checkpoint(path)


@pytest.mark.parametrize("text", ['{"step": ' + "9" * 5000 + "}", "[" * 100_000 + "]" * 100_000])
def test_json_python_cannot_read_is_named_corrupted(saved, text):
    path, _ = saved
    (path / METADATA_FILE).write_text(text)
    with pytest.raises(ValueError, match=r"nopelens.json is corrupted \(not valid JSON"):
        load_checkpoint(path)


def test_truncated_safetensors_with_matching_hash_is_refused_not_crashing(saved):
    path, _ = saved
    from nopelens.models.io import file_sha256

    (path / WEIGHTS_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    meta = json.loads((path / METADATA_FILE).read_text())
    meta["sha256"][WEIGHTS_FILE] = file_sha256(path / WEIGHTS_FILE)
    (path / METADATA_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="corrupted"):
        load_checkpoint(path)


def test_never_unpickles(saved, monkeypatch):
    import pickle

    def forbidden(*args, **kwargs):
        raise AssertionError("checkpoint loading must never unpickle")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    path, _ = saved
    load_checkpoint(path)
