"""Models larger than one device (issue 48): an HF model loaded through accelerate's device map with
part of its layers offloaded to disk gives every probe, sink and audit number of the same model
loaded whole (float32 on one thread: bit for bit); the plan names the placement; bad placements are
refused in one line, exit 2, before any weight is read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from make_hf_model import save_smol  # noqa: E402

ARGS = ["--quick", "--seq-len", "12", "--n-sequences", "6", "--quiet"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_smol(tmp_path_factory.mktemp("hf") / "smol")


def _half(model_dir: Path) -> str:
    """``--max-memory`` giving the CPU half the checkpoint's bytes."""
    return f"cpu={(model_dir / 'model.safetensors').stat().st_size // 2}B"


def _placed(model_dir: Path, tmp_path: Path) -> list[str]:
    return ["--device-map", "auto", "--max-memory", _half(model_dir), "--offload-folder", str(tmp_path / "offload")]


def _same_tables(a: Path, b: Path, names: list[str]) -> None:
    for name in names:
        whole, placed = pd.read_csv(a / name), pd.read_csv(b / name)
        assert list(whole.columns) == list(placed.columns) and whole.shape == placed.shape, name
        numbers = whole.select_dtypes("number").columns
        assert not whole[numbers].isna().all().all(), name
        np.testing.assert_allclose(
            placed[numbers].to_numpy(float), whole[numbers].to_numpy(float), rtol=0, atol=1e-10, err_msg=name
        )
        text = [column for column in whole.columns if column not in numbers]
        assert whole[text].fillna("").equals(placed[text].fillna("")), name


def _same_probe(model_dir: Path, tmp_path: Path, options: list[str], tables: list[str]) -> None:
    from nopelens.analyses.cli import main

    whole, placed = tmp_path / "whole", tmp_path / "placed"
    assert main(["probe", f"hf:{model_dir}", *ARGS, *options, "--no-figures", "--out", str(whole)]) == 0
    assert (
        main(
            [
                "probe",
                f"hf:{model_dir}",
                *ARGS,
                *options,
                *_placed(model_dir, tmp_path),
                "--no-figures",
                "--out",
                str(placed),
            ]
        )
        == 0
    )
    _same_tables(whole, placed, tables)


@pytest.mark.slow
def test_every_probe_number_of_an_offloaded_model_is_the_whole_models(model_dir, tmp_path, one_thread):
    _same_probe(
        model_dir,
        tmp_path,
        [],
        ["probes.csv", "layers.csv", "summary.csv", "sinks.csv", "variance.csv", "sink_ablation.csv"],
    )
    from nopelens.analyses.cli import main

    assert main(["sinks", f"hf:{model_dir}", *ARGS, "--out", str(tmp_path / "sinks-whole")]) == 0
    assert (
        main(
            ["sinks", f"hf:{model_dir}", *ARGS, *_placed(model_dir, tmp_path), "--out", str(tmp_path / "sinks-placed")]
        )
        == 0
    )
    _same_tables(tmp_path / "sinks-whole", tmp_path / "sinks-placed", ["sinks.csv"])


def test_offloaded_model_measures_what_the_whole_model_does(model_dir, tmp_path, one_thread):
    from nopelens.analyses.cli import main

    # the fast lane's share: a RoPE and the NoPE block, without the sink ablation's extra fits
    _same_probe(
        model_dir,
        tmp_path,
        ["--layers", "1,3", "--no-sink-ablation"],
        ["probes.csv", "layers.csv", "summary.csv", "sinks.csv", "variance.csv"],
    )
    assert main(["audit", "--hf-dir", str(model_dir), "--out", str(tmp_path / "audit-whole")]) == 0
    assert (
        main(
            [
                "audit",
                "--hf-dir",
                str(model_dir),
                *_placed(model_dir, tmp_path),
                "--out",
                str(tmp_path / "audit-placed"),
            ]
        )
        == 0
    )
    reports = [json.loads((tmp_path / f"audit-{how}" / "audit.json").read_text()) for how in ("whole", "placed")]
    assert reports[0]["steps"] == reports[1]["steps"] and reports[0]["model"] == reports[1]["model"]


def test_the_offloaded_share_stays_on_disk_and_the_plan_says_so(model_dir, tmp_path, capsys):
    from nopelens.analyses.cli import main
    from nopelens.models.hf_loading import load_hf_dir

    model = load_hf_dir(
        model_dir, device_map="auto", max_memory=_half(model_dir), offload_folder=str(tmp_path / "offload")
    )
    report, size = model.placement, (model_dir / "model.safetensors").stat().st_size
    assert report.weights["disk"] > 0 and report.offloaded_bytes == report.weights["disk"]
    # the offloaded parameters hold no memory (meta tensors); what is resident fits the CPU budget
    resident = sum(p.numel() * p.element_size() for p in model.original_model.parameters() if not p.is_meta)
    assert resident == report.weights["cpu"] <= size // 2
    assert main(["probe", f"hf:{model_dir}", *ARGS, *_placed(model_dir, tmp_path), "--plan"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "sites hooked by the bridge on the blocks wherever they live" in out
    assert f"disk: weights {report.weights['disk'] / 2**10:,.1f} KiB" in out and "offload traffic" in out


@pytest.mark.parametrize(
    "options, message",
    [
        (["--device-map", "auto", "--max-memory", "7=1GiB"], "device 7 does not exist here"),
        (["--device-map", "auto", "--max-memory", "disk=1GiB"], "disk takes no budget"),
        (["--device-map", "TIED", "--offload-folder", "OFF"], "are one tied weight, placed apart"),
        (
            [
                "--device-map",
                "MAP",
            ],
            "names 'model.layer.0', which SmolLM3ForCausalLM does not have",
        ),
        (["--device-map", "auto", "--max-memory", "cpu=4KiB", "--offload-folder", "OFF"], "cannot hold one layer"),
        (["--device-map", "auto", "--max-memory", "HALF", "--offload-folder", "FILE/offload"], "cannot be written"),
        (["--device-map", "auto", "--max-memory", "HALF"], "give --offload-folder"),
        (["--max-memory", "cpu=1GiB"], "--max-memory applies with --device-map"),
    ],
)
def test_bad_placements_are_one_line(model_dir, tmp_path, capsys, options, message):
    from nopelens.analyses.cli import main

    (tmp_path / "map.json").write_text(json.dumps({"model.embed_tokens": "cpu", "model.layer.0": "cpu"}))
    (tmp_path / "file").write_text("")
    (tmp_path / "tied.json").write_text(json.dumps({"model": "cpu", "lm_head": "disk"}))
    given = [
        {
            "MAP": str(tmp_path / "map.json"),
            "TIED": str(tmp_path / "tied.json"),
            "OFF": str(tmp_path / "off"),
            "HALF": _half(model_dir),
            "FILE/offload": str(tmp_path / "file" / "offload"),
        }.get(option, option)
        for option in options
    ]
    for command in (["probe", f"hf:{model_dir}", *ARGS, "--plan"], ["audit", "--hf-dir", str(model_dir)]):
        code = main([*command, *given])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "error" in line]
        assert code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in err, err


def test_device_and_device_map_are_one_choice(model_dir, capsys):
    from nopelens.analyses.cli import main

    assert main(["probe", f"hf:{model_dir}", *ARGS, "--plan", "--device-map", "auto", "--device", "cpu"]) == 2
    assert "--device and --device-map: give one" in capsys.readouterr().err


@pytest.mark.slow
def test_the_gpu_script_runs_its_checks_at_a_tiny_size_on_the_cpu(tmp_path, capsys, one_thread):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_probe

    assert gpu_probe.main(["--tiny", "--out", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("check ")]
    assert len(lines) == 4 and all(": ok: " in line for line in lines), lines
    assert "largest difference of every number in the run folders 0 " in lines[-1]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["checks_passed"] and result["split_largest_difference"] == 0


@pytest.mark.parametrize("hooks", ["the bridge", "forward hooks"])
def test_a_model_built_in_memory_is_dispatched_by_load_hf_model(model_dir, tmp_path, one_thread, monkeypatch, hooks):
    import torch
    from transformers import AutoModelForCausalLM

    from nopelens.models.adapters import load_hf_model

    def built():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.config._attn_implementation = "eager"
        return model.eval()

    if hooks == "forward hooks":  # as for a family TransformerLens has no adapter for
        monkeypatch.setattr("nopelens.models.adapters.bridge_supports", lambda architecture: False)
    whole = load_hf_model(built())
    placed = load_hf_model(
        built(), device_map="auto", max_memory=_half(model_dir), offload_folder=str(tmp_path / "offload")
    )
    assert whole.placement is None and placed.placement.weights["disk"] > 0 and placed.placement.hooks == hooks
    assert any((tmp_path / "offload").iterdir())  # accelerate wrote the disk share there and freed it
    assert sum(p.is_meta for p in placed.original_model.parameters()) > 0
    tokens = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    (a, cache_a), (b, cache_b) = whole.run_with_cache(tokens), placed.run_with_cache(tokens)
    assert torch.equal(a, b) and set(cache_a) == set(cache_b)
    assert all(torch.equal(cache_a[name], cache_b[name]) for name in cache_a)
