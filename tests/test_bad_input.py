"""Bad input found by trying to break nopelens: each case raises an error naming the problem."""

import hashlib
import json

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file
from schema import assert_documented

from nopelens.analyses import cli
from nopelens.analyses.audit import audit
from nopelens.analyses.cli import demo
from nopelens.circuits import previous_token
from nopelens.models import Decoder, DecoderConfig
from nopelens.models.checkpoint import load_checkpoint, save_checkpoint
from nopelens.models.decoder import KVCache
from nopelens.models.tasks import make_task
from nopelens.models.training import train
from nopelens.probes import attention_variance, collect, sink_scores


def tiny_config(position="nope", n_layers=1):
    return DecoderConfig(d_vocab=20, n_ctx=24, n_layers=n_layers, d_model=16, n_heads=2, position=position)


# --------------------------------------------------------------------------- training
def test_train_refuses_a_negative_seed():
    with pytest.raises(ValueError, match="seed must be a non-negative integer, got -1"):
        train(tiny_config(), make_task("copy"), 2, max_len=4, seed=-1, progress=False)


def test_train_refuses_an_infinite_lr():
    with pytest.raises(ValueError, match="must be finite"):
        train(tiny_config(), make_task("copy"), 2, max_len=4, lr=float("inf"), progress=False)


def test_a_diverging_run_raises_instead_of_saving_nan(tmp_path):
    torch.set_num_threads(1)
    with pytest.raises(ValueError, match="training loss became nan"):
        train(
            tiny_config(),
            make_task("copy"),
            4,
            batch_size=4,
            max_len=4,
            lr=1e30,
            warmup_steps=0,
            checkpoint_dir=tmp_path / "ckpt",
            checkpoint_every=100,
            progress=False,
        )
    assert not (tmp_path / "ckpt").exists()


def test_an_output_folder_blocked_by_a_file_fails_before_training(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    steps_run = []
    with pytest.raises(ValueError, match="is a file"):
        train(
            tiny_config(),
            make_task("copy"),
            2,
            batch_size=4,
            max_len=4,
            checkpoint_dir=blocker / "zoo" / "m",
            progress=False,
            callback=lambda step, loss, model: steps_run.append(step),
        )
    assert steps_run == []


# --------------------------------------------------------------------------- checkpoints
def _edit_metadata(path, edit):
    meta = json.loads((path / "nopelens.json").read_text())
    edit(meta)
    (path / "nopelens.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda meta: meta.__setitem__("sha256", "abc"), "'sha256' must map file names"),
        (lambda meta: meta.__setitem__("config", "abc"), "'config' must be a dict"),
    ],
)
def test_edited_checkpoint_json_is_reported_as_corrupted(tmp_path, edit, message):
    path = save_checkpoint(tmp_path / "ckpt", Decoder(tiny_config(), seed=0))
    _edit_metadata(path, edit)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


def test_checkpoint_with_nan_weights_is_refused(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt", Decoder(tiny_config(), seed=0))
    state = {name: t.clone() for name, t in Decoder(tiny_config(), seed=0).state_dict().items()}
    state["embed.W_E"][3, 2] = float("nan")
    save_file(state, path / "model.safetensors")
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    _edit_metadata(path, lambda meta: meta["sha256"].__setitem__("model.safetensors", digest))
    with pytest.raises(ValueError, match=r"\['embed.W_E'\] hold NaN or Inf"):
        load_checkpoint(path)


# --------------------------------------------------------------------------- decoder
def test_decoder_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="batch >= 1"):
        Decoder(tiny_config(), seed=0)(torch.zeros(0, 5, dtype=torch.long))


def test_decoder_refuses_a_cache_that_is_not_a_kvcache():
    with pytest.raises(TypeError, match="past_kv must be a KVCache"):
        Decoder(tiny_config(), seed=0)(torch.ones(1, 3, dtype=torch.long), past_kv={"keys": []})


def test_decoder_refuses_a_cache_of_another_depth():
    cache = KVCache.empty(tiny_config(n_layers=1), batch=1)
    with pytest.raises(ValueError, match="past_kv holds 1 layers, this model has 2"):
        Decoder(tiny_config(n_layers=2), seed=0)(torch.ones(1, 3, dtype=torch.long), past_kv=cache)


# --------------------------------------------------------------------------- probes
def test_sink_scores_refuse_a_window_of_zero_tokens():
    pattern = np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None]
    with pytest.raises(ValueError, match="n_tokens"):
        sink_scores([pattern[None]], n_tokens=0)


def test_attention_variance_without_a_site_names_the_problem():
    model = Decoder(tiny_config(), seed=0)
    acts = collect(model, torch.randint(1, 12, (3, 4)), ["blocks.0.attn.hook_pattern"])
    with pytest.raises(ValueError, match="no non-pattern site"):
        attention_variance(acts)


# --------------------------------------------------------------------------- analyses and CLI
def test_audit_refuses_reversed_train_lengths():
    with pytest.raises(ValueError, match="1 <= min <= max"):
        audit(Decoder(tiny_config(), seed=0), train_lengths=(5, 2))


def test_previous_token_circuit_refuses_infinite_sharpness():
    with pytest.raises(ValueError, match="finite"):
        previous_token(16, sharpness=float("inf"))


def test_cli_turns_out_of_memory_into_one_line(monkeypatch, capsys):
    def allocate(args):
        raise RuntimeError(
            "[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried to allocate 8e10 bytes"
        )

    monkeypatch.setattr(demo, "run", allocate)
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nopelens demo: error: out of memory") and "\n" not in err


def test_cli_reports_an_internal_error_in_one_line_not_a_traceback(monkeypatch, capsys):
    def crash(args):
        raise RuntimeError("a bug\nsecond line")

    monkeypatch.setattr(demo, "run", crash)
    monkeypatch.delenv("NOPELENS_TRACEBACK", raising=False)
    assert cli.main(["demo"]) == 3
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "internal error: RuntimeError: a bug (at test_bad_input.py:" in err and "report" in err
    monkeypatch.setenv("NOPELENS_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["demo"])


def test_an_hf_directory_with_pickled_weights_is_refused_not_unpickled(tmp_path):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from nopelens.models.hf_loading import load_hf_dir

    config = GPTNeoXConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    config.save_pretrained(tmp_path)
    torch.save(GPTNeoXForCausalLM(config).state_dict(), tmp_path / "pytorch_model.bin")  # a pickle
    with pytest.raises(ValueError, match="model.safetensors"):
        load_hf_dir(tmp_path)


def test_sweep_with_fewer_sequences_than_folds_fails_before_any_work(tmp_path):
    from nopelens.analyses.sweep import SweepSettings, sweep

    with pytest.raises(ValueError, match="3 evaluation sequences are fewer than the 5 cross-validation folds"):
        sweep(SweepSettings(models=("circuit",), n_sequences=3, n_splits=5), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_sinks_on_a_task_of_mixed_lengths_uses_the_shortest_sequence(tmp_path, capsys):
    torch.set_num_threads(1)
    train(
        tiny_config(),
        make_task("copy"),
        1,
        batch_size=2,
        min_len=1,
        max_len=6,
        checkpoint_dir=tmp_path / "ckpt",
        progress=False,
    )
    assert (
        cli.main(["sinks", str(tmp_path / "ckpt"), "--n-sequences", "8", "--quiet", "--out", str(tmp_path / "s")]) == 0
    )
    assert "T = " in capsys.readouterr().out
    assert_documented(tmp_path / "s" / "sinks.csv", "sinks: sinks.csv")


def test_writing_under_a_file_names_the_blocking_path(tmp_path):
    from nopelens.models.io import write_text_atomic

    (tmp_path / "afile").write_text("x")
    with pytest.raises(FileExistsError, match="afile or a folder above it is a file"):
        write_text_atomic(tmp_path / "afile" / "report.md", "text")


def test_an_interrupt_between_the_checkpoint_renames_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    from nopelens.models import checkpoint

    path = save_checkpoint(tmp_path / "ckpt", Decoder(tiny_config(), seed=0))
    real_replace, calls = checkpoint.os.replace, []

    def interrupted_replace(source, target):
        calls.append(source)
        if len(calls) == 2:  # the old checkpoint is aside, the new one not yet in place
            raise KeyboardInterrupt
        real_replace(source, target)

    monkeypatch.setattr(checkpoint.os, "replace", interrupted_replace)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, Decoder(tiny_config(), seed=1))
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    reloaded = load_checkpoint(path).model.state_dict()["embed.W_E"]
    assert torch.equal(reloaded, Decoder(tiny_config(), seed=0).state_dict()["embed.W_E"])


def test_a_corrupted_zoo_cache_says_how_to_recover(tmp_path):
    from nopelens.models import zoo

    path = zoo.model_dir("copy-nope-3l", tmp_path)
    save_checkpoint(
        path,
        Decoder(tiny_config(), seed=0),
        metadata={"complete": True, "zoo_recipe": zoo.recipe("copy-nope-3l").digest},
    )
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"is corrupted.*; delete {path} to retrain copy-nope-3l"):
        zoo.load("copy-nope-3l", cache_dir=tmp_path, progress=False)


def test_probe_runs_on_a_checkpoint_of_a_synthetic_task(tmp_path, capsys):
    """Copy-task sequences used to have mixed lengths: the extrapolation boundary (seq_len // 2)
    and the relative-distance pair counts then had no data, and `nopelens probe copy-nope-3l` failed."""
    torch.set_num_threads(1)
    train(
        tiny_config(),
        make_task("copy"),
        1,
        batch_size=2,
        min_len=1,
        max_len=6,
        checkpoint_dir=tmp_path / "ckpt",
        progress=False,
    )
    assert cli.main(["probe", str(tmp_path / "ckpt"), "--quick", "--quiet", "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "summary.md").is_file()


def test_late_fixes_from_the_bad_input_pass(tmp_path, capsys):
    """Found by trying to break the merged features: each now refuses with a line naming the problem."""
    import math

    from nopelens.analyses.cli import main
    from nopelens.models.checkpoint import load_checkpoint, save_checkpoint
    from nopelens.probes.linear import first_recoverable_layer

    cfg = DecoderConfig(d_vocab=12, n_ctx=16, n_layers=1, d_model=16, n_heads=2)
    with pytest.raises(ValueError, match="dtype must be a real floating"):
        Decoder(cfg, dtype=torch.complex64)
    with pytest.raises(ValueError, match="dtype must be a real floating"):
        Decoder(cfg, dtype="float16")
    # a training run folder is accepted where its checkpoint/ is meant
    save_checkpoint(tmp_path / "run" / "checkpoint", Decoder(cfg, seed=0))
    assert load_checkpoint(tmp_path / "run").model.cfg == cfg
    with pytest.raises(ValueError, match="threshold must be a finite"):
        first_recoverable_layer(pd.DataFrame(), threshold=math.nan)
    (tmp_path / "afile").write_text("x")  # --out is a run folder: a file in its place is refused before any work
    assert main(["validate", "--out", str(tmp_path / "afile")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_a_truncated_hf_weight_file_is_named_not_an_internal_error(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from nopelens.models.hf_loading import load_hf_dir

    config = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path, safe_serialization=True)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupted or truncated|no loadable"):
        load_hf_dir(tmp_path)


def test_intervene_with_no_mode_is_refused(capsys):
    from nopelens.analyses.cli import main

    assert main(["intervene", "circuit", "--modes", ""]) == 2
    assert "--modes lists no sink ablation" in capsys.readouterr().err


def test_an_hf_config_field_of_the_wrong_type_is_bad_input_not_an_internal_error(tmp_path, capsys):
    import json

    from transformers import LlamaConfig

    from nopelens.analyses.cli import main

    LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32
    ).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    assert main(["audit", "--hf-dir", str(tmp_path)]) == 2  # `probe hf:DIR` loads it the same way
    err = capsys.readouterr().err
    assert "config.json is not a valid config" in err and "hidden_size" in err and "internal error" not in err


# ----------------------------------------------------------------------------- configs that contradict their weights
def _saved(model, folder, **edits):
    """``model`` saved to ``folder`` (no tokenizer), then ``edits`` written into its config.json."""
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edits}))
    return folder


def _one_line_refusal(argv, capsys) -> str:
    capsys.readouterr()  # saving the model wrote a progress bar
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if "error" in line]  # the others are progress lines ("loading")
    assert len(errors) == 1 and errors[0] == err.splitlines()[-1], err
    assert "internal error" not in err and "Traceback" not in err
    return errors[0]


def test_a_per_layer_list_of_another_length_than_the_layers_is_named(tmp_path, capsys):
    """transformers builds this SmolLM3 with an IndexError in a layer's __init__ (was: exit 3, "a bug in nopelens")."""
    from hf_families import build_design

    folder = _saved(build_design("smollm3"), tmp_path / "smollm3", no_rope_layers=[1, 1])
    err = _one_line_refusal(["audit", "--hf-dir", str(folder)], capsys)
    assert f"{folder}/config.json: no_rope_layers has 2 entries for 4 layers (num_hidden_layers)" in err


def test_saved_weights_of_other_shapes_or_fewer_layers_than_the_config_are_named(tmp_path, capsys):
    """transformers raises "You set ignore_mismatched_sizes to False..." (was exit 3); missing layers were random."""
    from hf_families import build

    from nopelens.models.hf_loading import load_hf_dir

    folder = _saved(build("llama"), tmp_path / "heads", num_attention_heads=8)  # head_dim stays 8: q is 64 wide
    err = _one_line_refusal(["audit", "--hf-dir", str(folder)], capsys)
    assert (
        "the saved weights do not match config.json (model.layers.0.self_attn.q_proj.weight: checkpoint "
        "[32, 32], config gives [64, 32]; 3 more tensors differ): check hidden_size / num_attention_heads"
    ) in err
    deeper = _saved(build("llama"), tmp_path / "layers", num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"asks for weights the checkpoint does not hold \(model\.layers\.2\."):
        load_hf_dir(deeper)
    # a config cut to fewer layers than were saved: tests/test_hf_loading.py


@pytest.mark.parametrize(
    "family, field, value",
    [("mistral", "sliding_window", 0), ("mistral", "sliding_window", -3), ("llama4", "attention_chunk_size", 0)],
)
def test_a_window_or_chunk_below_one_token_is_refused_at_description_time(family, field, value):
    """A window of 0 lets no key through (was blamed on the bridge: "the causal mask is dropped")."""
    from hf_families import build

    from nopelens.models.hf import ConfigError, describe_config

    config = build(family).config
    setattr(config, field, value)
    with pytest.raises(ConfigError, match=f"{field} is {value}: a (window|chunk) must be at least 1 token"):
        describe_config(config)


def test_a_zero_window_is_one_line_for_audit_and_probe_and_the_refused_probe_leaves_nothing(tmp_path, capsys):
    from hf_families import build

    folder = _saved(build("mistral"), tmp_path / "mistral", sliding_window=0)
    expected = f"{folder}/config.json: sliding_window is 0: a window must be at least 1 token"
    assert expected in _one_line_refusal(["audit", "--hf-dir", str(folder)], capsys)
    out = tmp_path / "run"
    assert expected in _one_line_refusal(
        ["probe", f"hf:{folder}", "--input", "random", "--out", str(out), "--quiet", "--no-figures"], capsys
    )
    assert not out.exists()


@pytest.mark.parametrize("theta", [0, -10000])
def test_a_rope_base_that_is_not_positive_is_named_not_blamed_on_the_mask(tmp_path, capsys, theta):
    """rope_theta 0 gives NaN RoPE frequencies and NaN attention weights (was: "the causal mask is dropped"):
    refused from the config before the model is built."""
    from hf_families import build_design

    folder = _saved(
        build_design("smollm3"), tmp_path / "smollm3", rope_parameters={"rope_theta": theta, "rope_type": "default"}
    )
    err = _one_line_refusal(["audit", "--hf-dir", str(folder)], capsys)
    assert f"rope_parameters.rope_theta is {theta}: the RoPE base of a rotating layer must be a positive number" in err
    assert "causal mask" not in err


def test_seq_len_on_synthetic_task_models_is_refused_or_noted_not_silently_ignored(tmp_path, capsys):
    """A copy-task model is read at its training length: --seq-len used to do nothing, silently."""
    from nopelens.analyses.subjects import fixed_length

    assert _one_line_refusal(["probe", "copy-nope-3l", "--seq-len", "20", "--out", str(tmp_path / "run")], capsys) == (
        "nopelens probe: error: --seq-len does not apply: copy-nope-3l is a copy-task model, read on copy samples of "
        "its longest training length (max_len 10), so that every sequence covers every trained position; leave "
        "--seq-len out"
    )
    assert not (tmp_path / "run").exists()
    train(
        tiny_config(),
        make_task("copy"),
        1,
        batch_size=2,
        min_len=1,
        max_len=6,
        checkpoint_dir=tmp_path / "ckpt",
        progress=False,
    )
    assert "(max_len 6)" in fixed_length(str(tmp_path / "ckpt"))
    assert fixed_length("text-nope-4l") is None and fixed_length("circuit") is None
    from nopelens.analyses.cli.sweep import _check_seq_len

    _check_seq_len(("copy-nope-3l", "circuit"), "sweep")  # the circuit takes it: a note, not a refusal
    assert "nopelens sweep: note: --seq-len does not apply to copy-nope-3l" in capsys.readouterr().err


def test_the_closing_line_of_a_probe_says_what_was_written(tmp_path, capsys):
    """With --no-figures it said "... and figures" (none were drawn)."""
    from hf_families import build

    folder = _saved(build("llama"), tmp_path / "llama")
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "probe",
                f"hf:{folder}",
                "--input",
                "random",
                "--n-sequences",
                "8",
                "--seq-len",
                "12",
                "--quiet",
                "--no-figures",
                "--no-sink-ablation",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    closing = capsys.readouterr().out.strip().splitlines()[-2]
    assert closing.endswith("no figures (--no-figures), to") and not list(out.glob("*.png"))


def test_an_edited_model_type_does_not_change_the_family_rules():
    """config.json's "model_type" edited, "architectures" kept: transformers still builds SmolLM3, so its
    no_rope_layers rule applies (was: generic labels, rope on every layer, and a probe with wrong labels)."""
    from hf_families import build_design

    from nopelens.models.hf import describe_config

    config = build_design("smollm3").config
    config.model_type = "nonexistent_family"
    assert describe_config(config).layer_methods == ("rope", "rope", "rope", "nope")


# --------------------------------------------------------------------------- found at stop 36
def test_train_refuses_an_lr_beyond_float32():
    with pytest.raises(ValueError, match=r"at most 3.4e\+38 \(float32\), got 1e\+40"):
        train(tiny_config(), make_task("copy"), 2, lr=1e40)


def test_memory_errors_without_a_message_and_a_full_disk_are_one_line(capsys):
    def no_memory():
        raise MemoryError

    def disk_full():
        raise RuntimeError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    assert cli.guarded(no_memory, "nopelens x") == 2
    assert capsys.readouterr().err == "nopelens x: error: out of memory; use smaller lengths, sizes or counts\n"
    assert cli.guarded(lambda: (_ for _ in ()).throw(RuntimeError("std::bad_alloc")), "nopelens x") == 2
    assert "out of memory (std::bad_alloc)" in capsys.readouterr().err
    assert cli.guarded(disk_full, "nopelens x") == 2
    assert capsys.readouterr().err.startswith("nopelens x: error: no space left on the device written to")


def test_threads_are_bounded_and_train_out_is_not_a_checkpoint_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:  # a usage error: argparse exits
        cli.main(["lengthgen", "--quick", "--threads", "100000", "--out", str(tmp_path / "lg")])
    assert exit_.value.code == 2 and "--threads: must be between 1 and" in capsys.readouterr().err
    args = [
        "train",
        "--task",
        "copy",
        "--layers",
        "1",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--max-len",
        "4",
        "--steps",
        "2",
        "--quiet",
    ]
    assert cli.main([*args, "--out", str(tmp_path / "t")]) == 0
    before = (tmp_path / "t" / "checkpoint" / "loss_curve.csv").read_bytes()
    capsys.readouterr()
    assert cli.main([*args, "--out", str(tmp_path / "t" / "checkpoint")]) == 2
    assert "is a checkpoint directory; give the folder to train into" in capsys.readouterr().err
    assert (tmp_path / "t" / "checkpoint" / "loss_curve.csv").read_bytes() == before


def test_dynamics_checks_its_measuring_settings_before_training(tmp_path, capsys):
    for option, value, message in (
        ("--n-boot", "0", "--n-boot must be a positive integer"),
        ("--train-seed", str(10**20), "--train-seed must be an integer in [0, 2^63)"),
    ):
        assert (
            cli.main(
                ["dynamics", "bb-rope-2l", "--quick", "--checkpoints", "2", option, value, "--out", str(tmp_path / "d")]
            )
            == 2
        )
        assert message in capsys.readouterr().err
        assert not (tmp_path / "d").exists()


def test_a_text_too_short_for_one_validation_window_is_refused_before_training(tmp_path):
    corpus = tmp_path / "short.txt"
    corpus.write_text("\n\n".join(["abcdefghij" * 3] * 20))
    task = make_task("text", path=str(corpus))
    config = DecoderConfig(d_vocab=task.d_vocab, n_ctx=130, n_layers=1, d_model=16, n_heads=2)
    with pytest.raises(ValueError, match="the validation stream .* is shorter than one window of 64"):
        train(config, task, 400, max_len=64, checkpoint_dir=tmp_path / "c", out_dir=tmp_path)
    assert not (tmp_path / "c").exists()


def test_a_sharpness_that_overflows_float32_is_refused_not_a_nan_check():
    with pytest.raises(ValueError, match="sharpness 1e\\+38 overflows the circuit's torch.float32 weights"):
        previous_token(sharpness=1e38)


def test_backcopy_report_without_a_scored_trigger_says_so(tmp_path, capsys):
    assert (
        cli.main(
            [
                "train",
                "--task",
                "bigram_backcopy",
                "--max-len",
                "2",
                "--steps",
                "3",
                "--layers",
                "1",
                "--d-model",
                "16",
                "--heads",
                "2",
                "--quiet",
                "--out",
                str(tmp_path / "bb"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "back-copy after triggers: none scored at length 2" in out and "nan" not in out


def test_a_misspelt_zoo_name_gets_the_close_names_in_one_line(capsys):
    assert cli.main(["probe", "text-nope-4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did you mean text-nope-4l" in err and "nopelens train --list" in err
    assert cli.main(["probe", "zzzz"]) == 2
    assert "did you mean" not in capsys.readouterr().err  # nothing close: no guess


@pytest.mark.parametrize(
    "command",
    [
        ["sweep"],
        ["compare", "haviv", "--quick"],
        ["lengthgen", "--quick"],
        ["probe", "circuit"],
        ["train", "--zoo", "text-nope-4l"],
    ],
)
def test_an_empty_out_is_one_line_and_writes_nothing(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # Path("") is the working directory
    assert cli.main([*command, "--out", " "]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out is empty" in err and not any(tmp_path.iterdir())
