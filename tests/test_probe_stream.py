"""``nopelens probe hf:DIR`` through the streaming engine (issue 19): text through the model's own
tokenizer (trained offline here with the ``tokenizers`` library and saved next to a random-init
SmolLM3-shaped model, NoPE in its last block), the planned streamed tables equal the sweep's one pass
on the same subject, the repeated-token known answer, the plan, and bad input in one line."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from hf_families import build  # noqa: E402
from make_hf_model import save_smol  # noqa: E402
from schema import assert_folder_documented  # noqa: E402

ARGS = ["--quick", "--seq-len", "16", "--n-sequences", "6", "--quiet"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The README's ``hf:smol``: ``examples/make_hf_model.py``'s SmolLM3-shaped model and tokenizer."""
    return save_smol(tmp_path_factory.mktemp("hf") / "smol")


def _one_error(code: int, err: str, message: str) -> None:
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in err, err


def test_text_is_read_through_the_models_tokenizer_with_its_bos(model_dir, tmp_path):
    from transformers import AutoTokenizer

    from nopelens.analyses.subjects import HFInput, resolve
    from nopelens.models.tasks import default_documents

    text = tmp_path / "mine.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    corpus = "\n\n".join(default_documents().values())
    for how, source in [(HFInput(input="text"), corpus), (HFInput(input="text", text=str(text)), text.read_text())]:
        subject = resolve(f"hf:{model_dir}", 5, 16, seed=0, progress=False, hf_input=how)
        assert subject.has_bos and subject.bos_token_id == 1 and (subject.tokens[:, 0] == 1).all()
        assert subject.tokens.shape == (5, 16) and len({tuple(row) for row in subject.tokens.tolist()}) > 1
        for row in subject.tokens:
            assert tokenizer.decode(row[1:].tolist()) in source  # a window of the text, as the tokenizer cuts it
    other = resolve(f"hf:{model_dir}", 5, 16, seed=1, progress=False, hf_input=HFInput(input="text"))
    assert not (
        other.tokens == resolve(f"hf:{model_dir}", 5, 16, seed=0, progress=False, hf_input=HFInput(input="text")).tokens
    ).all()


def test_special_token_text_is_read_as_characters_and_a_length_of_only_specials_is_named(model_dir, tmp_path):
    """An HTML ``<s>`` in the user's text is text, not a BOS in mid-sequence (the sink reads would
    see a second first token); a --seq-len that only the BOS fills says so."""
    from transformers import AutoTokenizer

    from nopelens.models.hf_loading import text_windows

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = tmp_path / "tags.txt"
    text.write_text("<s>a paragraph</s><pad> " * 200, encoding="utf-8")
    tokens, bos = text_windows(tokenizer, str(text), 4, 16, 0, tokenizer.vocab_size)
    specials = set(tokenizer.all_special_ids)
    assert bos == 1 and (tokens[:, 0] == 1).all() and not specials & set(tokens[:, 1:].flatten().tolist())
    with pytest.raises(ValueError, match="--seq-len 1 leaves no room for text: the model's tokenizer adds 1 special"):
        text_windows(tokenizer, str(text), 4, 1, 0, tokenizer.vocab_size)


def test_streamed_probe_tables_equal_the_sweeps_one_pass_on_the_same_text(model_dir, one_thread):
    """Probes (grouped CV, controls, bootstrap; the q.k and score reads), sinks with and without BOS,
    variance, the sink ablation: ``nopelens probe``'s planned run (batches of 4; features kept, or
    none kept and a second pass) gives the tables of the sweep's one pass (every feature kept,
    batches of 32, the fits from the kept features)."""
    import dataclasses

    import torch

    from nopelens.analyses.subjects import HFInput, resolve
    from nopelens.analyses.sweep import SweepSettings, analyse_subject

    settings = dataclasses.replace(
        SweepSettings.quick("text", (f"hf:{model_dir}",), controls=False),
        n_sequences=6,
        seq_len=16,
        hf_input=HFInput(input="text"),
        streamed=True,
        batch_size=4,
    )
    subject = resolve(f"hf:{model_dir}", 6, 16, seed=0, progress=False, hf_input=settings.hf_input)
    with torch.no_grad():
        memory = analyse_subject(subject, dataclasses.replace(settings, streamed=False, batch_size="auto"))
        assert subject.info["streamed"]["second_pass_batches"] == [] and subject.info["streamed"]["batch_size"] == 6
        assert subject.info["streamed"]["kept_bytes_limit"] is None  # unlimited: one pass
        streamed = analyse_subject(subject, settings)
        assert subject.info["streamed"]["second_pass_batches"] == []  # every batch kept: one pass
        twice = analyse_subject(subject, dataclasses.replace(settings, keep_mib=0))
        assert subject.info["streamed"]["second_pass_batches"] == [0, 1]  # nothing kept: two passes
    keys = {
        "probes": ["site", "target", "features", "task", "probe", "split", "metric"],
        "sinks": ["condition", "site", "head"],
        "variance": ["site", "position"],
        "sink_ablation": ["block"],
    }
    for tables in (streamed, twice):
        for name, key in keys.items():
            a = memory[name].sort_values(key).reset_index(drop=True)
            b = tables[name].sort_values(key).reset_index(drop=True)[list(a.columns)]
            assert len(a) == len(b) > 0, name
            for column in a.columns:
                if a[column].dtype.kind == "f":
                    tolerance = 1e-6 if name == "sinks" else 1e-8  # sink means are float32, other batches
                    np.testing.assert_allclose(
                        b[column], a[column], rtol=tolerance, atol=tolerance, equal_nan=True, err_msg=f"{name}.{column}"
                    )
                else:
                    pd.testing.assert_series_equal(b[column], a[column], check_dtype=False, obj=f"{name}.{column}")
    assert set(streamed["sinks"]["condition"]) == {"with_bos", "without_bos"}
    assert (
        set(streamed["sink_ablation"]["status"]) == {"measured"}
        and (streamed["sink_ablation"]["drop"].abs() > 1e-3).any()
    )


@pytest.mark.slow
def test_auto_batch_size_fits_the_memory_free_and_leaves_the_tables_unchanged(model_dir, monkeypatch, one_thread):
    """--batch-size auto (the default) takes 32 sequences, or as many as fit half the memory left
    after the statistics and kept features; the numbers do not depend on the batch size."""
    import dataclasses

    import torch

    from nopelens.analyses.subjects import HFInput, resolve
    from nopelens.analyses.sweep import SweepSettings, analyse_subject, streamed, sweep_sites
    from nopelens.analyses.sweep import plan as plan_module

    settings = dataclasses.replace(
        SweepSettings.quick("text", (f"hf:{model_dir}",), controls=False),
        n_sequences=6,
        seq_len=16,
        hf_input=HFInput(input="text"),
        streamed=True,
    )
    assert settings.batch_size == "auto" and "batch_size" not in settings.to_dict()
    subject = resolve(f"hf:{model_dir}", 6, 16, seed=0, progress=False, hf_input=settings.hf_input)
    sites = sweep_sites(subject, settings.sites)
    shapes = streamed.site_shapes(subject, sites.all())
    per_sequence = streamed.sequence_bytes(subject, shapes)
    assert per_sequence > 16 * 4 * subject.hf.d_vocab  # the logits alone are 16 x d_vocab float32
    with torch.no_grad():
        roomy = streamed.measurements(subject, settings, sites, shapes)
        assert roomy.batch_size == 6  # plenty of memory: every sequence (up to 32) in one batch
        jobs = [job for p in roomy.probes + [roomy.ablation] for job in p.jobs]
        statistics = [streamed.job_statistics_bytes(job, shapes) for job in jobs]
        unpacked = max(streamed.job_statistics_bytes(job, shapes, packed=False) for job in jobs)
        assert max(statistics) < unpacked < 2 * max(statistics)  # Gram matrices held as upper triangles
        # every batch kept: the features and one job's (unpacked) statistics at a time;
        # nothing kept: every job's packed statistics at once and one unpacked copy for the fit
        reserved = streamed.held_bytes(roomy, shapes)
        assert reserved == streamed.feature_bytes(roomy, shapes) + int(streamed.STATISTICS_OVERHEAD * unpacked)
        spilled = streamed.measurements(subject, dataclasses.replace(settings, keep_mib=0), sites, shapes)
        assert streamed.held_bytes(spilled, shapes) == int(streamed.STATISTICS_OVERHEAD * sum(statistics)) + unpacked
        # every batch kept (64 MiB budget): the run holds `reserved` whatever the memory; a quarter of it free
        # leaves room for 2 sequences of a patched size, or 4 (two even batches of 3, not 4 + 2)
        tight_settings = dataclasses.replace(settings, keep_mib=64)
        free = 4 * reserved
        monkeypatch.setattr(streamed, "available_memory", lambda device=None: free)
        for fit, expected in ((2, 2), (4, 3)):
            monkeypatch.setattr(streamed, "sequence_bytes", lambda *args, fit=fit: (free - reserved) // 2 // fit)
            assert streamed.measurements(subject, tight_settings, sites, shapes).batch_size == expected
        monkeypatch.setattr(streamed, "sequence_bytes", lambda *args: (free - reserved) // 2 // 2)
        assert "in batches of at most 2 sequences" in plan_module.plan(subject, tight_settings, sites).describe("m")
        small = analyse_subject(subject, tight_settings)
        assert subject.info["streamed"]["batch_size"] == 2
        monkeypatch.undo()
        whole = analyse_subject(subject, settings)
        assert subject.info["streamed"]["batch_size"] == 6
    for name, key in {
        "probes": ["site", "target", "features", "task", "probe", "split", "metric"],
        "sinks": ["condition", "site", "head"],
    }.items():
        a = whole[name].sort_values(key).reset_index(drop=True)
        b = small[name].sort_values(key).reset_index(drop=True)
        np.testing.assert_allclose(
            b["value"], a["value"], rtol=1e-8, atol=1e-8, equal_nan=True, err_msg=name
        ) if "value" in a else pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-8, atol=1e-8)


@pytest.mark.slow
def test_statistics_larger_than_the_memory_free_are_refused_before_any_forward_pass(
    model_dir, tmp_path, capsys, monkeypatch
):
    """With nothing kept the jobs of a run hold their statistics at once; when one job's alone exceed
    the memory free on the device the run says so in one line, before its forward passes, and --plan
    says it too."""
    from nopelens.analyses.cli import main
    from nopelens.analyses.sweep import streamed

    monkeypatch.setattr(streamed, "available_memory", lambda device=None: 2**20)  # 1 MiB free
    common = ["probe", f"hf:{model_dir}", *ARGS, "--no-sink-ablation", "--keep-mib", "0"]
    code = main([*common, "--plan", "--out", str(tmp_path / "plan")])
    out, err = capsys.readouterr()
    assert "WILL NOT FIT (the error line says why)" in out  # the reason once, in the error line
    _one_error(code, err, "the probes' statistics need")
    assert "MiB free on cpu" in err
    forward = []
    monkeypatch.setattr(streamed, "run", lambda *args, **kwargs: forward.append(1))
    code, err = main([*common, "--out", str(tmp_path / "run")]), capsys.readouterr().err
    _one_error(code, err, "MiB free on cpu (the rest is for the forward passes); they grow with the sites' width")
    assert "WILL NOT FIT" not in err, err  # the reason once, not the plan line and then the error
    assert not forward and not (tmp_path / "run").exists()
    # a --memory-mib above what is free is capped, and the message says so
    _one_error(
        main([*common, "--memory-mib", "64", "--out", str(tmp_path / "run")]),
        capsys.readouterr().err,
        "MiB free on cpu, less than --memory-mib 64 (the rest is for the forward passes)",
    )
    monkeypatch.undo()
    # --memory-mib: room for the largest job, not for every job at once: groups, no refusal
    assert main([*common, "--memory-mib", "8", "--plan", "--out", str(tmp_path / "p2")]) == 0
    out = capsys.readouterr().out
    assert "WILL NOT FIT" not in out and "groups whose statistics fit the memory" in out
    _one_error(
        main([*common, "--memory-mib", "1", "--out", str(tmp_path / "p3")]),
        capsys.readouterr().err,
        "MiB allowed (--memory-mib)",
    )
    # the default keep budget leaves room for the largest site: no refusal where keeping nothing fits
    assert (
        main(
            [
                "probe",
                f"hf:{model_dir}",
                *ARGS,
                "--no-sink-ablation",
                "--memory-mib",
                "8",
                "--plan",
                "--out",
                str(tmp_path / "p4"),
            ]
        )
        == 0
    )
    assert "WILL NOT FIT" not in capsys.readouterr().out
    # a keep budget buys a whole pass where the kept features fit the memory, and is never why a run is refused
    passes = {}
    for keep, memory in (("0", "16"), ("100", "16"), ("0", "8"), ("100", "8")):
        assert main([*common[:-1], keep, "--memory-mib", memory, "--plan", "--out", str(tmp_path / "p5")]) == 0
        out = capsys.readouterr().out
        assert "WILL NOT FIT" not in out
        passes[keep, memory] = int(out.split(" forward passes")[0].split()[-1])
    assert passes["100", "16"] == 2 < passes["0", "16"]  # one run and the run without BOS, against groups run twice
    assert passes["100", "8"] < passes["0", "8"]  # where all of them do not fit, groups whose features fit keep them
    # keeping nothing can hold more than keeping every feature (each site fitted alone): the refusal says so
    _one_error(
        main([*common, "--memory-mib", "7", "--out", str(tmp_path / "p6")]),
        capsys.readouterr().err,
        "keep the features (--keep-mib 1 or more) or give a larger --memory-mib, or run where more memory is free",
    )
    assert main([*common[:-1], "1", "--memory-mib", "7", "--plan", "--out", str(tmp_path / "p7")]) == 0


@pytest.mark.slow
def test_sites_whose_statistics_do_not_fit_together_run_in_groups_with_the_same_tables(
    model_dir, monkeypatch, one_thread
):
    """When every job's statistics do not fit the memory at once, the jobs run in groups by depth, a
    run each (stopped after its deepest site); each job's numbers are those of one run, bit for bit,
    and the run holds one group's statistics instead of all of them."""
    import dataclasses

    import torch

    from nopelens.analyses.subjects import HFInput, resolve
    from nopelens.analyses.sweep import SweepSettings, analyse_subject, budget, streamed, sweep_sites
    from nopelens.analyses.sweep import plan as plan_module

    settings = dataclasses.replace(
        SweepSettings.quick("text", (f"hf:{model_dir}",), controls=False),
        n_sequences=6,
        seq_len=16,
        hf_input=HFInput(input="text"),
        streamed=True,
        keep_mib=0,
        batch_size=4,
    )
    subject = resolve(f"hf:{model_dir}", 6, 16, seed=0, progress=False, hf_input=settings.hf_input)
    sites = sweep_sites(subject, settings.sites)
    shapes = streamed.site_shapes(subject, sites.all())
    with torch.no_grad():
        whole = analyse_subject(subject, settings)
        assert subject.info["streamed"]["statistics_groups"] == 1
        one = streamed.measurements(subject, settings, sites, shapes)
        sizes = [streamed.job_statistics_bytes(job, shapes) for probe in one.all_probes() for job in probe.jobs]
        unpacked = max(
            streamed.job_statistics_bytes(job, shapes, packed=False) for probe in one.all_probes() for job in probe.jobs
        )
        # room for a third of the statistics at once (and for the largest job alone), and one fit's copy
        free = (
            int((max(sum(sizes) / 3, max(sizes)) * streamed.STATISTICS_OVERHEAD + unpacked) / streamed.STATISTICS_SHARE)
            + 1
        )
        monkeypatch.setattr(streamed, "available_memory", lambda device=None: free)
        grouped = streamed.measurements(subject, settings, sites, shapes)
        assert 3 <= len(grouped.groups) < len(sizes)
        depths = [[budget._depth(job) for job in group] for group in grouped.groups]
        assert all(max(a) <= min(b) for a, b in zip(depths, depths[1:]))  # shallow sites first
        assert streamed.held_bytes(grouped, shapes) <= streamed.STATISTICS_SHARE * free
        assert streamed.held_bytes(grouped, shapes) < streamed.held_bytes(one, shapes)
        plan = plan_module.plan(subject, settings, sites)
        assert plan.shortfall is None and f"in {len(grouped.groups)} groups whose statistics fit" in plan.describe("m")
        # the run keeps to its plan even when the memory free changes after it: it reads the memory once
        calls = []
        monkeypatch.setattr(
            streamed, "available_memory", lambda device=None: free if calls.append(1) or len(calls) == 1 else 64 * 2**30
        )
        run_in_groups = analyse_subject(subject, settings)
        assert len(calls) == 1 and subject.info["streamed"]["statistics_groups"] == len(grouped.groups)
        # the largest job alone no longer fits: refused, naming it
        monkeypatch.setattr(streamed, "available_memory", lambda device=None: max(sizes))
        assert "alone" in plan_module.plan(subject, settings, sites).shortfall
    for name in ("probes", "sinks", "variance", "sink_ablation"):
        pd.testing.assert_frame_equal(run_in_groups[name], whole[name], check_exact=True, obj=name)


@pytest.mark.slow
def test_layers_probe_a_subset_of_blocks_with_the_numbers_of_the_whole_run(model_dir, tmp_path, capsys, one_thread):
    """--layers 1,2: only those blocks' sites (and residual layers 1-3), sinks, variance and sink
    ablation are measured, each number equal to the whole run's; the run names what it left out."""
    from nopelens.analyses.cli import main

    common = ["probe", f"hf:{model_dir}", *ARGS, "--no-figures"]
    assert main([*common, "--out", str(tmp_path / "all")]) == 0
    assert main([*common, "--layers", "1-2", "--out", str(tmp_path / "some")]) == 0
    out = capsys.readouterr().out
    assert "blocks not probed: blocks 0,3 (--layers 1-2)" in out
    assert main([*common, "--layers", "1-2", "--json", "--out", str(tmp_path / "some")]) == 0  # reread, not measured
    why = json.loads(capsys.readouterr().out)["not_applicable"]["hf:smol"]["blocks not probed"]
    assert why.startswith("blocks 0,3 (--layers 1-2)")
    keys = {
        "probes": ["site", "target", "features", "task", "probe", "split", "metric"],
        "sinks": ["condition", "site", "head"],
        "variance": ["site", "position"],
    }
    for name, key in keys.items():
        whole = pd.read_csv(tmp_path / "all" / f"{name}.csv")
        some = pd.read_csv(tmp_path / "some" / f"{name}.csv")
        assert len(some) and set(some["block"].dropna().astype(int)) <= {0, 1, 2}, name  # layer 1 = block 0's output
        if name == "probes":
            layers = set(some.loc[some["site"].str.contains("hook_resid_"), "layer"].astype(int))
            assert layers == {1, 2, 3}
            assert set(some.loc[~some["site"].str.contains("hook_resid_"), "block"].astype(int)) == {1, 2}
        elif name == "sinks":
            assert set(some["block"].astype(int)) == {1, 2}, name
        else:  # and the model's first attention block, whose slope the summary gives
            assert set(some["block"].astype(int)) == {0, 1, 2}, name
        merged = some.merge(whole, on=key, suffixes=("", "_all"), validate="one_to_one")
        assert len(merged) == len(some), name
        value = "value" if name == "probes" else ("sink_mass" if name == "sinks" else "variance")
        np.testing.assert_allclose(
            merged[value], merged[f"{value}_all"], rtol=1e-10, atol=1e-12, equal_nan=True, err_msg=name
        )
    summaries = [pd.read_csv(tmp_path / run / "summary.csv").iloc[0] for run in ("some", "all")]
    assert summaries[0]["variance_slope_block0"] == pytest.approx(summaries[1]["variance_slope_block0"], abs=1e-12)
    assert np.isnan(summaries[0]["mad_chance_layer0"]) and not np.isnan(summaries[1]["mad_chance_layer0"])
    ablation = pd.read_csv(tmp_path / "some" / "sink_ablation.csv").set_index("block")
    whole = pd.read_csv(tmp_path / "all" / "sink_ablation.csv").set_index("block")
    np.testing.assert_allclose(ablation.loc[[1, 2], "drop"], whole.loc[[1, 2], "drop"], rtol=1e-10, atol=1e-12)
    assert set(ablation.loc[[0, 3], "status"]) == {"not_applicable"}
    assert ablation.loc[0, "note"].startswith("not probed (--layers")
    capsys.readouterr()
    for bad, message in (
        ("4", "--layers 4: hf:smol has 4 blocks (0-3)"),
        ("a", "must be block numbers or rising ranges"),
        ("3-1", "a range must rise"),
    ):
        try:
            code = main([*common, "--layers", bad, "--out", str(tmp_path / "bad")])
        except SystemExit as exit_:  # argparse refuses what its type does not parse
            code = exit_.code
        err = capsys.readouterr().err
        _one_error(code, err, message)
        assert ": probing" not in err, err  # refused before it says what it probes
    assert not (tmp_path / "bad").exists()
    _one_error(
        main(["probe", "circuit", *ARGS, "--layers", "1", "--out", str(tmp_path / "bad")]),
        capsys.readouterr().err,
        "--layers applies to hf:DIR models",
    )


@pytest.mark.slow
def test_probe_cli_on_text_and_the_repeated_token_known_answer(model_dir, tmp_path, capsys, one_thread):
    from nopelens.analyses.cli import main

    code = main(["probe", f"hf:{model_dir}", *ARGS, "--batch-size", "4", "--out", str(tmp_path / "text")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "plan for hf:" in err and not any(word in err for word in (": loading", ": probing", ": measured in"))
    (done,) = (tmp_path / "text" / "parts").glob("*/done.json")
    meta = json.loads(done.read_text())
    assert meta["input"] == "text" and meta["dtype"] == "float32" and meta["device"] == "cpu"
    assert meta["streamed"]["batch_size"] == 4
    assert set(pd.read_csv(tmp_path / "text" / "sinks.csv")["condition"]) == {"with_bos", "without_bos"}
    assert "probes.csv" in assert_folder_documented(tmp_path / "text", "sweep")
    ablation = pd.read_csv(tmp_path / "text" / "sink_ablation.csv")  # streamed, on by default
    assert ablation["block"].tolist() == [0, 1, 2, 3] and set(ablation["status"]) == {"measured"}
    assert "sink ablation" not in meta.get("not_applicable", {})
    assert "sink ablation" in (tmp_path / "text" / "summary.md").read_text().lower()

    code = main(
        [
            "probe",
            f"hf:{model_dir}",
            *ARGS,
            "--input",
            "repeated",
            "--dtype",
            "bfloat16",
            "--no-sink-ablation",
            "--out",
            str(tmp_path / "repeated"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    (done,) = (tmp_path / "repeated" / "parts").glob("*/done.json")
    meta = json.loads(done.read_text())
    assert meta["dtype"] == "bfloat16" and not meta["has_bos"]
    assert "--no-sink-ablation" in meta["not_applicable"]["sink ablation"]
    assert not (tmp_path / "repeated" / "sink_ablation.csv").exists()
    deviation = float(meta["known_answer"].rsplit("largest deviation ", 1)[1].split()[0])
    assert "NoPE blocks [3]" in meta["known_answer"] and deviation < 1e-2  # bfloat16 round-off only
    # repeated tokens: every position's state is the same, so no layer's absolute index is recoverable
    probes = pd.read_csv(tmp_path / "repeated" / "probes.csv")
    r2 = probes[
        (probes.probe == "linear")
        & (probes.metric == "r2")
        & (probes.split == "grouped")
        & (probes.target == "absolute_index")
    ]
    assert len(r2) and (r2["value"] < 0.05).all()


@pytest.mark.slow
def test_a_rerun_refuses_parts_measured_on_other_weights_or_text(model_dir, tmp_path, capsys):
    """A finished part stands for the files it read: after the weights or the --text file change, a
    rerun into the same folder says so instead of reusing the old tables (found by QA)."""
    import shutil

    from nopelens.analyses.cli import main

    model, text = tmp_path / "model", tmp_path / "mine.txt"
    shutil.copytree(model_dir, model)
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    args = [
        "probe",
        f"hf:{model}",
        "--quick",
        "--seq-len",
        "8",
        "--n-sequences",
        "4",
        "--quiet",
        "--no-sink-ablation",
        "--no-figures",
        "--text",
        str(text),
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(args) == 0, capsys.readouterr().err
    (done,) = (tmp_path / "run" / "parts").glob("*/done.json")
    assert set(json.loads(done.read_text())["inputs"]) == {"files", "text_sha256"}
    capsys.readouterr()
    assert main(args) == 0 and "already measured" in capsys.readouterr().err
    respelled = [f"hf:{model}/", *args[2:]]  # the same model, text and device, spelled otherwise
    respelled[respelled.index(str(text))] = f"{text.parent}/./{text.name}"
    auto = [] if torch.cuda.is_available() else ["--device", "auto"]  # auto is cpu here, as measured
    assert main(["probe", *respelled, *auto]) == 0 and "already measured" in capsys.readouterr().err
    text.write_text("A different text, with other windows of other tokens. " * 40, encoding="utf-8")
    code = main(args)
    _one_error(code, capsys.readouterr().err, "was measured on other inputs than hf:")
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")  # the same bytes again
    assert main(args) == 0, capsys.readouterr().err
    (model / "README.md").write_text("notes on this model")  # a file loading the model never reads
    assert main([*args[:-1], str(model / "run")]) == 0, capsys.readouterr().err  # a run folder inside the model's
    assert main([*args[:-1], str(model / "run")]) == 0 and "already measured" in capsys.readouterr().err
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten: a new modification time
    code = main(args)
    _one_error(code, capsys.readouterr().err, "(model.safetensors changed since); use another --out folder")


def test_a_sequence_past_max_position_embeddings_is_noted(model_dir, tmp_path):
    """RoPE and NoPE layers compute any position, so a longer --seq-len runs (length generalization is a
    question users ask), but the run says the positions past the config's length are beyond it."""
    import shutil

    from nopelens.analyses.subjects import HFInput, resolve

    short = tmp_path / "short"
    shutil.copytree(model_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8}))
    how = HFInput(input="random")
    assert "beyond_trained_length" not in resolve(f"hf:{short}", 4, 8, progress=False, hf_input=how).info
    note = resolve(f"hf:{short}", 4, 12, progress=False, hf_input=how).info["beyond_trained_length"]
    assert note.startswith("--seq-len 12 passes max_position_embeddings 8 of config.json: positions from 8 on"), note


@pytest.mark.slow
def test_plan_prints_passes_tokens_memory_and_exits(model_dir, tmp_path, capsys):
    from nopelens.analyses.cli import main

    code = main(["probe", f"hf:{model_dir}", *ARGS, "--plan", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0 and not (tmp_path / "run").exists()
    # 6 sequences of 16 tokens in one batch, the 15-token copies without BOS for the sink table, and one
    # pass over the 96 tokens per block for its sink ablation
    assert (
        "6 forward passes over 570 tokens in batches of at most 6 sequences\n"
        "  - 1 of them over the sequences without BOS, for the sink table\n"
        "  - 4 of them for the sink ablation of 4 blocks, each stopped after its block\n"
        "  - no second pass"
    ) in out, out
    assert max(len(line) for line in out.splitlines()) <= 100, out
    assert "MiB" in out and "ETA about" in out, out
    code = main(["probe", f"hf:{model_dir}", *ARGS, "--plan", "--no-sink-ablation", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0 and "2 forward passes over 186 tokens in batches" in out, out
    # nothing kept: the main run and each ablated block's run make a second pass
    code = main(["probe", f"hf:{model_dir}", *ARGS, "--plan", "--keep-mib", "0", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert (
        code == 0
        and "11 forward passes over 1,050 tokens" in out
        and ("5 of them second passes to predict, 4 of the sink ablation's among them") in out
    ), out


@pytest.mark.slow
def test_three_tokens_leave_no_variance_slope_and_say_so(model_dir, tmp_path, capsys):
    """3 tokens with BOS leave queries that see 2 and 3 keys: no variance slope (it needs 3 distinct
    counts). The plan and the run agree: the run measures the rest and names the read not applicable,
    for causal blocks as for windows (it used to exit 2 after its forward passes)."""
    from nopelens.analyses.cli import main

    args = [
        "probe",
        f"hf:{model_dir}",
        "--quick",
        "--seq-len",
        "3",
        "--n-sequences",
        "5",
        "--quiet",
        "--no-sink-ablation",
        "--no-figures",
        "--out",
        str(tmp_path / "run"),
    ]
    assert main(args) == 0, capsys.readouterr().err
    (done,) = (tmp_path / "run" / "parts").glob("*/done.json")
    reason = json.loads(done.read_text())["not_applicable"]["variance read"]
    assert reason.startswith("blocks [0, 1, 2, 3]: causal: the queries from position 1 on see [2, 3] keys"), reason
    assert "n/a (see below)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "case, message",
    [
        ("no tokenizer", "holds no tokenizer"),
        ("empty text", "is empty"),
        ("short text", "shorter than one 16-token sequence"),
        ("too few windows", "fewer than the 6 sequences"),
        ("bad device", "--device must be one of"),
        ("cuda", "no CUDA device"),
        ("zoo model", "applies to hf:DIR models"),
        ("batch size 0", "--batch-size must be a positive integer or auto, got 0"),
        ("memory 0", "--memory-mib must be an integer >= 1, got 0"),
        ("config not JSON", "holds no loadable HF causal LM: It looks like the config file"),
        ("heads do not divide the width", "config.json is not a valid config: Class validation error"),
        ("no layers", "config.json: num_hidden_layers is 0: a model needs at least one layer"),
        ("no width", "config.json: hidden_size is 0: a model's sizes must be at least 1"),
        ("no dtype", "config.json: dtype 'banana' is not a torch dtype"),
        ("dtype not a name", "config.json: dtype 5 is not a torch dtype"),
        ("more heads than width", "config.json: num_attention_heads 64 is more than hidden_size 32"),
        ("empty input", "--input must be one of text, random, repeated, got ''"),
        ("empty out", "--out is empty: name the run folder"),
        ("no directory", "'hf:' names no directory"),
        ("seeds", "--seeds 0,1: training seeds apply to zoo models"),
        ("text is a directory", "is a directory: give a UTF-8 text file"),
        (
            "attention past the memory",
            "one sequence of 2,048 tokens needs at least 132.0 MiB for one layer's attention",
        ),
        ("attention past all memory", "one sequence of 10,000,000 tokens needs at least 3,147,125,244.1 MiB"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(model_dir, tmp_path, capsys, case, message):
    import shutil

    import torch

    from nopelens.analyses.cli import main

    if case == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is available here")
    target, extra = f"hf:{model_dir}", []
    if case == "no tokenizer":
        bare = tmp_path / "bare"
        bare.mkdir()
        for name in ("config.json", "model.safetensors"):
            shutil.copy(model_dir / name, bare / name)
        target = f"hf:{bare}"
    elif case == "empty text":
        (tmp_path / "empty.txt").write_text("  \n")
        extra = ["--text", str(tmp_path / "empty.txt")]
    elif case == "short text":
        (tmp_path / "short.txt").write_text("a few words")
        extra = ["--text", str(tmp_path / "short.txt")]
    elif case == "too few windows":
        (tmp_path / "few.txt").write_text("The quick brown fox jumps over the lazy dog. " * 2)
        extra = ["--text", str(tmp_path / "few.txt")]
    elif case == "bad device":
        extra = ["--device", "tpu"]
    elif case == "cuda":
        extra = ["--device", "cuda"]
    elif case == "batch size 0":
        extra = ["--batch-size", "0"]
    elif case == "memory 0":
        extra = ["--memory-mib", "0"]
    elif case in (
        "config not JSON",
        "heads do not divide the width",
        "no layers",
        "no width",
        "no dtype",
        "dtype not a name",
        "more heads than width",
    ):
        # with the tokenizer beside it: the message names config.json, not a missing tokenizer
        broken = tmp_path / "broken"
        shutil.copytree(model_dir, broken)
        if case == "heads do not divide the width":  # Llama's config checks its shape (SmolLM3's does not)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                build(
                    "llama", vocab_size=json.loads((broken / "config.json").read_text())["vocab_size"]
                ).save_pretrained(broken)
        config = json.loads((broken / "config.json").read_text())
        config.update(
            {
                "heads do not divide the width": {"num_attention_heads": 3},
                "no layers": {"num_hidden_layers": 0},
                "no width": {"hidden_size": 0},
                "no dtype": {"dtype": "banana"},
                "dtype not a name": {"dtype": 5},
                "more heads than width": {"num_attention_heads": 64, "num_key_value_heads": 64},
            }.get(case, {})
        )
        if case == "no layers":  # without the per-layer lists transformers checks against the count
            config = {
                key: value for key, value in config.items() if not isinstance(value, list) or key == "architectures"
            }
        text = json.dumps(config) if case != "config not JSON" else "{not json"
        (broken / "config.json").write_text(text)
        target = f"hf:{broken}"
    elif case in (
        "empty input",
        "seeds",
        "text is a directory",
        "attention past the memory",
        "attention past all memory",
    ):
        extra = {
            "empty input": ["--input", ""],
            "seeds": ["--seeds", "0,1"],
            "text is a directory": ["--text", str(tmp_path)],
            # 4 float32 heads: 2048^2 (8 * 4 + 1) bytes, past the 100 MiB allowed before any forward pass
            "attention past the memory": ["--input", "random", "--seq-len", "2048", "--memory-mib", "100"],
            # refused once the model is loaded, before 6 x 10^7 tokens are drawn and laid out
            "attention past all memory": ["--input", "random", "--seq-len", "10000000", "--plan"],
        }[case]
    elif case == "no directory":
        target = "hf:"
    elif case == "zoo model":
        target, extra = "circuit", ["--input", "random"]
    capsys.readouterr()
    out = "" if case == "empty out" else str(tmp_path / "run")
    code = main(["probe", target, *ARGS, *extra, "--out", out])
    _one_error(code, capsys.readouterr().err, message)


@pytest.mark.slow
def test_sinks_reads_an_hf_model_through_its_tokenizer_as_probe_does(model_dir, tmp_path, capsys, one_thread):
    """``nopelens sinks hf:DIR`` read uniform random ids whatever the directory held; it now takes
    ``--input`` (default text through the model's tokenizer), ``--text``, ``--device`` and ``--dtype``."""
    from nopelens.analyses.cli import main
    from nopelens.analyses.subjects import HFInput, resolve
    from nopelens.analyses.sweep.streamed import measure_sinks

    args = ["sinks", f"hf:{model_dir}", "--quick", "--seq-len", "16", "--n-sequences", "6", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "text")]) == 0, capsys.readouterr().err
    assert main([*args, "--input", "random", "--out", str(tmp_path / "random")]) == 0, capsys.readouterr().err
    text, random = (pd.read_csv(tmp_path / name / "sinks.csv") for name in ("text", "random"))
    expected = measure_sinks(resolve(f"hf:{model_dir}", 6, 16, 0, False, hf_input=HFInput(input="text")))
    np.testing.assert_allclose(text["sink_mass"], expected["sink_mass"], atol=1e-12)
    assert not np.allclose(text["sink_mass"], random["sink_mass"])
    capsys.readouterr()
    _one_error(
        main(["sinks", "circuit", "--input", "random"]),
        capsys.readouterr().err,
        "--input applies to hf:DIR models, not to circuit",
    )


@pytest.mark.slow
@pytest.mark.parametrize("keep_mib", [None, 0])
def test_the_plans_fit_count_is_what_the_run_factorizes(model_dir, monkeypatch, keep_mib, one_thread):
    """The ETA's fits are counted from the plan (:func:`~nopelens.analyses.sweep.plan.fit_work`): the
    penalty paths' sum of d^3 is exactly what the run factorizes, kept or summed batch by batch;
    the Cholesky solves counted bound those run (ridge solves once per distinct chosen penalty)."""
    import dataclasses

    from nopelens.analyses.subjects import HFInput, resolve
    from nopelens.analyses.sweep import SweepSettings, analyse_subject, streamed, sweep_sites
    from nopelens.analyses.sweep import plan as plan_module
    from nopelens.analyses.sweep.eta import FitRates
    from nopelens.probes import lda, ridge

    settings = dataclasses.replace(
        SweepSettings.quick("text", (f"hf:{model_dir}",), controls=False),
        n_sequences=6,
        seq_len=16,
        hf_input=HFInput(input="text"),
        streamed=True,
        keep_mib=keep_mib,
        batch_size=4,
    )
    subject = resolve(f"hf:{model_dir}", 6, 16, seed=0, progress=False, hf_input=settings.hf_input)
    sites = sweep_sites(subject, settings.sites)
    shapes = streamed.site_shapes(subject, sites.all())
    with_ablation = plan_module.fit_work(streamed.measurements(subject, settings, sites, shapes), shapes)
    settings = dataclasses.replace(settings, sink_ablation=False)
    counted = plan_module.fit_work(streamed.measurements(subject, settings, sites, shapes), shapes)
    done = {"paths": 0, "solves": 0}
    path, solve = ridge.penalty_path, ridge.spd_solve

    def counting_path(C, b, alphas):
        done["paths"] += C.shape[0] ** 3
        return path(C, b, alphas)

    def counting_solve(A, B):
        done["solves"] += A.shape[0] ** 3
        return solve(A, B)

    monkeypatch.setattr(ridge, "penalty_path", counting_path)
    for module in (ridge, lda):
        monkeypatch.setattr(module, "spd_solve", counting_solve)
    monkeypatch.setattr(
        plan_module, "fit_rates", lambda *args: FitRates(0, 0, 0, 0)
    )  # the plan's timing factorizes too
    with torch.no_grad():
        analyse_subject(subject, settings)
    assert done["paths"] == counted.paths > 0 and with_ablation.paths > counted.paths  # the ablation's probes count too
    assert 0 < done["solves"] <= counted.solves


@pytest.mark.slow
def test_the_plan_estimates_how_long_for_any_model_size(model_dir, capsys):
    """No size cap: the plan times a batch's first block and the fits' kernels here, and says what
    the estimate is made of; a run that does not fit gets no estimate."""
    from nopelens.analyses.cli import main

    code = main(["probe", f"hf:{model_dir}", *ARGS, "--plan"])
    out = capsys.readouterr().out
    assert code == 0 and "ETA about " in out and " of forward passes and " in out and " of fits (" in out, out
    assert "not estimated" not in out
