"""The three examples in examples/ run end to end on small settings and write what they promise (issue 15)."""

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from nopelens.models import Decoder, DecoderConfig
from nopelens.models.checkpoint import TrainedModel, save_checkpoint

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytestmark = pytest.mark.slow


def example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_layers_on_the_circuit_finds_position_at_layer_1(tmp_path):
    paths = example("probe_layers").main(["circuit", "--n-sequences", "12", "--seq-len", "10", "--n-boot", "10",
                                          "--out", str(tmp_path)])
    assert sorted(p.name for p in paths) == ["probe_layers.csv", "probe_layers.png", "probe_layers.svg"]
    table = pd.read_csv(tmp_path / "probe_layers.csv")
    accuracy = table.query("probe == 'linear' and metric == 'accuracy'").set_index("layer")["value"]
    assert accuracy[1] == 1.0 and accuracy[0] < 0.5  # Theorem 1: exact after block 0, not before


def test_probe_layers_on_a_checkpoint(tmp_path):
    model = Decoder(DecoderConfig(d_vocab=12, n_ctx=16, n_layers=1, d_model=16, n_heads=2), seed=0)
    meta = {"task": {"name": "copy", "kwargs": {"n_symbols": 8}}, "train_lengths": [1, 4]}
    save_checkpoint(tmp_path / "ckpt", TrainedModel(model, meta))
    example("probe_layers").main([str(tmp_path / "ckpt"), "--n-sequences", "10", "--n-boot", "10", "--out", str(tmp_path / "out")])
    table = pd.read_csv(tmp_path / "out" / "probe_layers.csv")
    assert sorted(table.layer.unique()) == [0, 1]


def test_circuit_demo_counts_and_matches_alibi(tmp_path, capsys):
    paths = example("circuit_demo").main(["--n-ctx", "16", "--out", str(tmp_path)])
    assert [p.suffix for p in paths] == [".png", ".svg", ".csv"]
    table = pd.read_csv(tmp_path / "circuit_demo.csv")
    np.testing.assert_allclose(table.counter, 1 / (table.position + 1), atol=1e-6)
    np.testing.assert_allclose(table.bos_weight, 1 / (table.position + 1), atol=1e-6)
    assert "max |pattern - ALiBi(m=0.5)|" in capsys.readouterr().out


def test_hook_external_probes_an_hf_directory_and_a_plain_module(tmp_path):
    torch.manual_seed(0)
    example("hook_external").main(["--n-sequences", "10", "--seq-len", "8", "--n-boot", "10", "--out", str(tmp_path)])
    table = pd.read_csv(tmp_path / "hook_external.csv")
    assert table.groupby("model").layer.apply(sorted).tolist() == [[0, 1, 2], [0, 1, 2]]
    assert table.value.notna().all()
