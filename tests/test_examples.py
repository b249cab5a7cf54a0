"""The three examples in examples/ run end to end on small settings, write what they promise and say
where (issue 15), use the sweep's defaults, and end like the CLI: one line and exit 2 on bad input."""

import contextlib
import importlib.util
import runpy
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from schema import assert_documented

from nopelens.analyses.cli import guarded
from nopelens.analyses.sweep import SweepSettings, sweep
from nopelens.models import Decoder, DecoderConfig
from nopelens.models.checkpoint import TrainedModel, save_checkpoint

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _no_exit():
    yield


def example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_layers_on_the_circuit_finds_position_at_layer_1_and_reads_as_the_sweep(tmp_path, capsys):
    paths = example("probe_layers").main(
        ["circuit", "--n-sequences", "12", "--seq-len", "10", "--n-boot", "10", "--out", str(tmp_path)]
    )
    assert sorted(p.name for p in paths) == ["probe_layers.csv", "probe_layers.png", "probe_layers.svg"]
    assert f"wrote {tmp_path / 'probe_layers.png'}" in capsys.readouterr().out, "it says where it wrote"
    table = pd.read_csv(tmp_path / "probe_layers.csv")
    assert_documented(table, "examples: probe_layers.csv")
    accuracy = table.query("probe == 'linear' and metric == 'accuracy'").set_index("layer")["value"]
    assert accuracy[1] == 1.0 and accuracy[0] < 0.5  # Theorem 1: exact after block 0, not before

    # the sweep's numbers on the same settings (equal up to round-off: the sweep also hooks the
    # attention pattern, which makes the decoder skip its fused attention kernel)
    swept = sweep(SweepSettings(models=("circuit",), n_sequences=12, seq_len=10, n_boot=10), progress=False).probes
    key = ["site", "target", "features", "task", "probe", "metric"]
    swept = swept[(swept["split"] == "grouped") & swept["site"].isin(table["site"])].set_index(key)["value"]
    mine = table.set_index(key)["value"]
    linear = mine[mine.index.get_level_values("probe") == "linear"]
    assert linear.index.isin(swept.index).all() and len(linear) == 3 * 7  # 3 layers x (4 + 3) metrics
    np.testing.assert_allclose(linear, swept.loc[linear.index], atol=1e-5)


def test_probe_layers_defaults_are_the_sweeps():
    parser_defaults = example("probe_layers").SWEEP
    default = SweepSettings(models=())
    assert (parser_defaults.n_sequences, parser_defaults.seq_len, parser_defaults.n_boot) == (80, 64, 200)
    assert parser_defaults == default


@pytest.mark.parametrize(
    "name, argv, message",
    [
        ("probe_layers", ["gpt-17"], "unknown model 'gpt-17'"),
        ("probe_layers", ["runs/no/such/checkpoint"], "no checkpoint directory at runs/no/such/checkpoint"),
        ("hook_external", ["--hf-dir", "/no/such/dir"], "no such HF model directory"),
        ("circuit_demo", ["--n-ctx", "1"], "--n-ctx must be >= 2"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(name, argv, message, capsys):
    module = example(name)
    assert guarded(lambda: module.main(argv), f"{name}.py") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{name}.py: error: ") and message in err[0], err


def test_a_script_run_as_main_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    """``python examples/circuit_demo.py --n-ctx 1``: its ``__main__`` block, run as the shell would."""
    monkeypatch.setattr(sys, "argv", ["circuit_demo.py", "--n-ctx", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(EXAMPLES / "circuit_demo.py"), run_name="__main__")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "circuit_demo.py: error: --n-ctx must be >= 2 (BOS and one token), got 1"
    ]
    monkeypatch.setattr(sys, "argv", ["circuit_demo.py", "--bogus"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(EXAMPLES / "circuit_demo.py"), run_name="__main__")
    assert exit_info.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_probe_layers_on_a_checkpoint(tmp_path):
    model = Decoder(DecoderConfig(d_vocab=12, n_ctx=16, n_layers=1, d_model=16, n_heads=2), seed=0)
    meta = {"task": {"name": "copy", "kwargs": {"n_symbols": 8}}, "train_lengths": [1, 4]}
    save_checkpoint(tmp_path / "ckpt", TrainedModel(model, meta))
    example("probe_layers").main(
        [str(tmp_path / "ckpt"), "--n-sequences", "10", "--n-boot", "10", "--out", str(tmp_path / "out")]
    )
    table = pd.read_csv(tmp_path / "out" / "probe_layers.csv")
    assert sorted(table.layer.unique()) == [0, 1]


def test_circuit_demo_counts_and_matches_alibi(tmp_path, capsys):
    paths = example("circuit_demo").main(["--out", str(tmp_path)])
    assert [p.suffix for p in paths] == [".png", ".svg", ".csv"]
    assert paths[1].stat().st_size < 200_000, "the 64 x 64 patterns are images, not 4096 vector cells each"
    table = pd.read_csv(tmp_path / "circuit_demo.csv")
    assert_documented(table, "examples: circuit_demo.csv")
    np.testing.assert_allclose(table.counter, 1 / (table.position + 1), atol=1e-6)
    np.testing.assert_allclose(table.bos_weight, 1 / (table.position + 1), atol=1e-6)
    assert "max |pattern - ALiBi(m=0.5)|" in capsys.readouterr().out


def test_hook_external_probes_an_hf_directory_and_a_plain_module(tmp_path):
    torch.manual_seed(0)
    example("hook_external").main(["--n-sequences", "10", "--seq-len", "8", "--n-boot", "10", "--out", str(tmp_path)])
    table = pd.read_csv(tmp_path / "hook_external.csv")
    assert_documented(table, "examples: hook_external.csv")
    assert table.groupby("model").layer.apply(sorted).tolist() == [[0, 1, 2], [0, 1, 2]]
    assert table.value.notna().all()


def test_make_hf_model_saves_a_model_nopelens_probe_reads_and_refuses_to_overwrite(tmp_path, capsys, one_thread):
    """``python examples/make_hf_model.py --out DIR``, run as the shell would, then the command it
    suggests (its plan); a second run into the same folder is one line and exit code 2."""
    from nopelens.analyses.cli import main

    out = tmp_path / "smol"
    for expected in (0, 2):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, "argv", ["make_hf_model.py", "--out", str(out)])
            with pytest.raises(SystemExit) as exit_info:
                runpy.run_path(str(EXAMPLES / "make_hf_model.py"), run_name="__main__")
        assert exit_info.value.code == expected
    captured = capsys.readouterr()
    assert f"nopelens probe hf:{out} --quick" in captured.out
    assert captured.err.strip().splitlines() == [
        f"make_hf_model.py: error: {out} already holds a model (config.json); give another --out, or delete it"
    ]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    module = example("make_hf_model")
    (tmp_path / "afile").write_text("")
    for argv, message in [
        (["--out", str(tmp_path / "afile")], "is a file; give a folder"),
        (["--out", str(tmp_path / "other"), "--seed", "-1"], "argument --seed: a seed is an integer"),
    ]:
        with pytest.raises(SystemExit) if "--seed" in argv else _no_exit():
            assert guarded(lambda: module.main(argv), "make_hf_model.py") == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "other").exists(), "a bad --seed writes nothing"
    assert (
        main(
            [
                "probe",
                f"hf:{out}",
                "--quick",
                "--seq-len",
                "16",
                "--n-sequences",
                "6",
                "--plan",
                "--out",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    assert "plan for hf:" in capsys.readouterr().out
