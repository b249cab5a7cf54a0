"""Interventions (issue 14): known answers on the Theorem 1/2 circuit, hook hygiene, HF bridges, CLI."""

import numpy as np
import pandas as pd
import pytest
import torch
from schema import assert_folder_documented

from nopelens.analyses import intervene as iv
from nopelens.analyses.cli import main
from nopelens.analyses.intervene import measure
from nopelens.circuits import distance
from nopelens.circuits.layout import ATTENDED_POSITION, BOS_TOKEN, POSITION
from nopelens.models import Decoder, DecoderConfig
from nopelens.models.adapters import HookedModule, bridge_hf_model
from nopelens.probes import Activations, collect, probe_absolute_index

SETTINGS = iv.ProbeSettings(n_splits=3, n_boot=30)


@pytest.fixture(scope="module")
def circuit():
    torch.set_num_threads(1)
    model = distance(n_ctx=24)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, model.cfg.d_vocab, (12, 24), generator=generator)
    tokens[:, 0] = BOS_TOKEN
    return model, tokens, torch.ones_like(tokens)


def linear_rows(table: pd.DataFrame, **where) -> pd.DataFrame:
    rows = table
    for column, value in where.items():
        rows = rows[rows[column] == value]
    return rows


def beats_chance(table: pd.DataFrame, metric: str, **where) -> bool:
    """The linear probe's CI lies above every chance baseline's CI (shuffled labels, majority)."""
    rows = linear_rows(table, metric=metric, **where)
    linear = rows[rows["probe"] == "linear"].iloc[0]
    chance = rows[rows["probe"].isin(["shuffled", "majority"])]["ci_high"].max()
    return bool(linear["ci_low"] > chance)


def test_circuit_sink_ablation_known_answers(circuit):
    """Theorem 1: the index is 1/(i+1) of the first token's value. Without that key in block 0,
    layer 1 carries no index and block 1's q.k read no distance; ablating block 1 leaves layer 1."""
    model, tokens, mask = circuit
    probes, behavior = iv.sink_ablation(model, tokens, mask, 2, SETTINGS, modes=("remove_key", "mean_value"))
    clean = probes[probes["condition"] == "clean"]
    assert beats_chance(clean, "r2", layer=1, target="absolute_index")
    assert beats_chance(clean, "accuracy", layer=1, target="absolute_index")
    assert beats_chance(clean, "r2", target="relative_distance", block=1)
    for mode in ("remove_key", "mean_value"):
        ablated = probes[(probes["condition"] == mode) & (probes["ablated_block"] == 0)]
        assert not beats_chance(ablated, "r2", layer=1, target="absolute_index")
        assert not beats_chance(ablated, "accuracy", layer=1, target="absolute_index")
        assert not beats_chance(ablated, "r2", target="relative_distance", block=1)
    assert set(behavior["status"]) == {"measured"}

    hooks = iv.sink_hooks(1, "remove_key", iv.first_real_index(mask))
    with iv.intervention(model, hooks):
        after = collect(model, tokens, [1, 2])
    before = collect(model, tokens, [1, 2])
    assert np.array_equal(after.acts["blocks.0.hook_resid_post"], before.acts["blocks.0.hook_resid_post"])
    assert not np.array_equal(after.acts["blocks.1.hook_resid_post"], before.acts["blocks.1.hook_resid_post"])


def relative_read_with_and_without_sink(position: str) -> tuple[pd.Series, pd.Series]:
    """Block 1's q.k read of i - j in an untrained 2-block model, clean and with the sink removed in block 0.

    Content is a BOS then two token types, so the read is mostly about position."""
    config = DecoderConfig(d_vocab=32, n_ctx=24, n_layers=2, d_model=32, n_heads=2, d_head=8, position=position)
    model = Decoder(config, seed=0).eval()
    tokens = 5 + torch.randint(0, 2, (12, 24), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = 0
    mask = torch.ones_like(tokens)
    settings = iv.ProbeSettings(n_splits=3, n_boot=30, tasks=("regression",), controls=False, bilinear="outer")
    hooks = iv.sink_hooks(0, "remove_key", iv.first_real_index(mask))
    read = dict(target="relative_distance", probe="linear", metric="r2")
    return tuple(linear_rows(iv.reprobe(model, tokens, mask, 1, 2, settings, h), **read).iloc[0] for h in ([], hooks))


def test_untrained_rope_relative_read_does_not_need_the_sink():
    torch.set_num_threads(1)
    before, after = relative_read_with_and_without_sink("rope")
    assert before["value"] > 0.9  # the rotation alone makes i - j readable
    assert abs(after["value"] - before["value"]) < 0.05
    # the same test fails where the distance does come from the sink: an untrained NoPE model
    before, after = relative_read_with_and_without_sink("nope")
    assert after["value"] < before["value"] - 0.2 and after["ci_high"] < before["ci_low"]


def test_remove_key_is_exact_on_the_fused_path_too():
    """Hooking hook_attn_scores forces the explicit path: the fused and explicit passes agree, and
    the pattern gives the removed key exactly zero and renormalizes over the rest."""
    config = DecoderConfig(d_vocab=16, n_ctx=16, n_layers=2, d_model=16, n_heads=2, position="nope")
    model = Decoder(config, seed=3).eval()
    tokens = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(0))
    hooks = iv.sink_hooks(0, "remove_key", torch.zeros(2, dtype=torch.long))
    with torch.no_grad():
        clean = model(tokens)
        with iv.intervention(model, hooks):
            fused = model(tokens)
            _, cache = model.run_with_cache(tokens, names_filter="blocks.0.attn.hook_pattern")
        model.set_fused_attention(False)
        with iv.intervention(model, hooks):
            explicit = model(tokens)
        model.set_fused_attention(True)
    pattern = cache["blocks.0.attn.hook_pattern"]
    assert torch.equal(pattern[:, :, 1:, 0], torch.zeros_like(pattern[:, :, 1:, 0]))
    assert torch.allclose(pattern.sum(-1), torch.ones(pattern.shape[:-1]))
    assert torch.allclose(pattern[:, :, 0, 0], torch.ones(2, 2))  # the first query keeps its own key
    assert torch.allclose(fused, explicit, atol=1e-6)
    assert not torch.allclose(fused, clean, atol=1e-4)


def test_hooks_are_removed_after_the_pass_and_when_it_raises(circuit):
    model, tokens, mask = circuit
    hooks = iv.sink_hooks(0, "remove_key", iv.first_real_index(mask))
    point = model.hook_dict["blocks.0.attn.hook_attn_scores"]
    with torch.no_grad():
        clean = model(tokens)
        with iv.intervention(model, hooks):
            assert len(point._forward_hooks) == 1
        assert not point._forward_hooks
        bad = tokens.clone()
        bad[0, 3] = model.cfg.d_vocab  # outside the vocabulary: the forward raises
        with pytest.raises(ValueError, match="outside the vocabulary"):
            with iv.intervention(model, hooks):
                model(bad)
        assert not point._forward_hooks
        with pytest.raises(RuntimeError, match="inside"):
            with iv.intervention(
                model, iv.IndexDirection(1, torch.ones(model.cfg.d_model), torch.zeros(model.cfg.d_model), 0.0).shift(2)
            ):
                raise RuntimeError("inside")
        assert not any(p._forward_hooks for p in model.hook_dict.values())
        assert torch.equal(model(tokens), clean)
    with pytest.raises(KeyError, match="no hook point"):
        with iv.intervention(model, [("blocks.9.hook_resid_pre", lambda x, hook: x)]):
            pass


def test_shifting_the_index_dimension_shifts_what_the_distance_head_writes_by_k(circuit):
    """Block 1's head scores -m(i - j): moving every index by k leaves its pattern unchanged (a
    relative head) and moves the position it writes, sum_j A_ij j, by exactly k."""
    model, tokens, mask = circuit
    unit = torch.zeros(model.cfg.d_model)
    unit[POSITION] = 1.0
    for k in (3, -2):
        sites = ["blocks.1.attn.hook_pattern", "blocks.1.hook_resid_post"]
        before = collect(model, tokens, sites)
        with iv.intervention(model, [("blocks.0.hook_resid_post", iv.shift_hook(unit, k))]):
            after = collect(model, tokens, sites)
        for a, b in zip(after.patterns["blocks.1.attn.hook_pattern"], before.patterns["blocks.1.attn.hook_pattern"]):
            np.testing.assert_allclose(a, b, atol=1e-6)
        moved = (
            after.acts["blocks.1.hook_resid_post"][:, ATTENDED_POSITION]
            - before.acts["blocks.1.hook_resid_post"][:, ATTENDED_POSITION]
        )
        np.testing.assert_allclose(moved, k, atol=1e-4)


def test_probe_direction_shift_and_projection(circuit):
    model, tokens, mask = circuit
    clean = iv.later_tokens(collect(model, tokens, [1]))
    direction = iv.IndexDirection.fit(clean, 1)
    with iv.intervention(model, direction.shift(5)):
        shifted = iv.later_tokens(collect(model, tokens, [1]))
    with iv.intervention(model, direction.project_out()):
        projected = iv.later_tokens(collect(model, tokens, [1]))
    site = "blocks.0.hook_resid_post"

    def read(acts):
        return direction.predict(torch.from_numpy(acts.features(site))).numpy()

    np.testing.assert_allclose(read(shifted) - read(clean), 5, atol=1e-3)
    np.testing.assert_allclose(read(projected), direction.intercept, atol=1e-3)
    table = iv.direction_interventions(model, tokens, mask, 2, SETTINGS, layers=[1], shifts=(2,))
    shift = table[(table["intervention"] == "shift") & (table["read_layer"] == 1)].iloc[0]
    assert shift["read_shift"] == pytest.approx(2, abs=0.2)  # an out-of-fold probe, not the direction's own
    projected_row = table[(table["intervention"] == "project_out") & (table["read_layer"] == 1)].iloc[0]
    assert projected_row["r2_clean_probe"] < 0.2 < projected_row["r2_refit"]  # i^2 and 1/(i+1) still hold it


def test_patching_on_the_circuit(circuit):
    """An embedding has no index in a NoPE model (nothing moves); after block 0 the position dimension
    moves with the state, while block 1's head rereads positions from the unpatched keys."""
    model, tokens, mask = circuit
    table = iv.position_patching(model, tokens, 2, SETTINGS, shift=6, positions=[10, 20])
    layer0, layer1 = table[table["layer"] == 0], table[table["layer"] == 1]
    np.testing.assert_allclose(layer0["moved"], 0, atol=1e-6)
    assert ((layer1["moved"] > 0.3) & (layer1["moved"] < 0.95)).all()
    assert (layer1["copy_read"] < layer1["original_read"] - 5).all()
    with pytest.raises(ValueError, match="patched positions"):
        iv.position_patching(model, tokens, 2, SETTINGS, shift=6, positions=[3])
    # more sequences than one collection batch (64): every row is patched with its own token's state
    many = torch.randint(1, model.cfg.d_vocab, (70, 24), generator=torch.Generator().manual_seed(1))
    many[:, 0] = BOS_TOKEN
    again = iv.position_patching(model, many, 2, SETTINGS, shift=6, positions=[10])
    np.testing.assert_allclose(again[again["layer"] == 0]["moved"], 0, atol=1e-6)
    assert ((again[again["layer"] == 1]["moved"] > 0.3) & (again[again["layer"] == 1]["moved"] <= 1.0)).all()


def hf_models():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return {
        "gpt2": GPT2LMHeadModel(
            GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=0)
        ),
        "llama": LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                intermediate_size=64,
                vocab_size=64,
                max_position_embeddings=64,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
    }


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_interventions_on_bridged_hf_models(name):
    torch.set_num_threads(1)
    bridge = bridge_hf_model(hf_models()[name].eval())
    tokens = torch.randint(1, 64, (6, 12), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 0
    mask = torch.ones_like(tokens)
    settings = iv.ProbeSettings(n_splits=2, n_boot=20, tasks=("regression",), controls=False, relative=False)
    probes, behavior = iv.sink_ablation(bridge, tokens, mask, 2, settings)
    assert set(behavior["status"]) == {"measured"}
    assert (behavior[behavior["metric"] == "loss"]["delta"].abs() > 0).all()
    with torch.no_grad():
        clean = bridge(tokens)
        with pytest.raises((IndexError, ValueError)):  # a token outside the vocabulary
            with iv.intervention(bridge, iv.sink_hooks(0, "remove_key", iv.first_real_index(mask))):
                bridge(tokens + 100)
        assert torch.equal(bridge(tokens), clean)
    patched = iv.position_patching(bridge, tokens, 2, settings, shift=3, positions=[8])
    assert len(patched) == 2
    assert (np.isfinite(patched["moved"]) | patched["note"].str.contains("no scale")).all()


def test_a_model_whose_ablation_cannot_be_checked_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=64)).eval()
    wrapped = HookedModule(
        hf, {"blocks.0.hook_resid_pre": "transformer.drop", "blocks.0.hook_resid_post": "transformer.h.0"}
    )
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(iv.NotApplicable, match="no hook point blocks.0.attn.hook_attn_scores"):
        iv.check_sink_ablation(wrapped, 0, "remove_key", tokens, torch.ones_like(tokens))
    wrapped = HookedModule(
        hf,
        {
            "blocks.0.attn.hook_attn_scores": "transformer.h.0.attn.attn_dropout",
            "blocks.0.hook_resid_post": "transformer.h.0",
        },
    )
    with pytest.raises(iv.NotApplicable, match="to check that the ablation"):
        iv.check_sink_ablation(wrapped, 0, "remove_key", tokens, torch.ones_like(tokens))
    _, behavior = iv.sink_ablation(
        wrapped,
        tokens,
        torch.ones_like(tokens),
        1,
        iv.ProbeSettings(n_splits=2, n_boot=10, tasks=("regression",), controls=False, relative=False),
        modes=("remove_key",),
    )
    assert behavior["status"].tolist() == ["not_applicable"]


@pytest.mark.slow
def test_cli_writes_a_run_folder_and_bad_input_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        "intervene",
        "circuit",
        "--out",
        str(out),
        "--n-sequences",
        "6",
        "--seq-len",
        "12",
        "--n-boot",
        "10",
        "--modes",
        "remove_key",
        "--quiet",
    ]
    assert main(args) == 0
    for name in (
        "summary.csv",
        "sink_probes.csv",
        "sink_behavior.csv",
        "directions.csv",
        "patching.csv",
        "intervene.png",
        "intervene.svg",
        "intervene.json",
    ):
        assert (out / name).is_file(), name
    summary = pd.read_csv(out / "summary.csv")
    assert summary.loc[summary["ablated_block"] == 0, "abs_r2_delta"].iloc[0] < -0.5
    assert_folder_documented(out, "intervene")  # every column is in docs/schema.md
    assert main(args) == 0  # resumes from the written tables
    printed = capsys.readouterr().out
    assert "NaN" not in printed and "qk_r2 n/a" in printed  # the circuit's last block has no read after it
    for bad, message in (
        (["intervene", "nosuch-model"], "unknown model"),
        (["intervene", "circuit", "--modes", "sideways", "--out", str(tmp_path / "b")], "sideways"),
        (["intervene", "circuit", "--shift", "0", "--out", str(tmp_path / "c")], "non-zero"),
        (["intervene", "circuit", "--n-sequences", "3", "--out", str(tmp_path / "d")], "folds"),
        (args[:-3] + ["--n-boot", "11"], "other settings"),
    ):
        assert main(bad) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and message in err and "Traceback" not in err


def test_sweep_compact_ablation_gives_intervenes_numbers():
    """Issue 21: the sweep's compact sink ablation and `nopelens intervene` measure one thing one way: on the
    same sequences, the compact table's R² clean -> ablated (and CIs) at layer l + 1 are intervene's
    remove_key rows. (The sweep once probed a 16-sequence subset and read a different, lower number.)"""
    torch.set_num_threads(1)
    config = DecoderConfig(d_vocab=16, n_ctx=20, n_layers=2, d_model=32, n_heads=2, position="nope")
    model = Decoder(config, seed=3).eval()
    tokens = torch.randint(2, 16, (20, 20), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = 1
    mask = torch.ones_like(tokens)
    acts = collect(model, tokens, [f"blocks.{l}.hook_resid_post" for l in range(2)], attention_mask=mask)
    compact = iv.sink_ablation_drop(model, tokens, mask, 2, acts, n_splits=3, n_boot=30, seed=0)
    settings = iv.ProbeSettings(n_splits=3, n_boot=30, tasks=("regression",), controls=False, relative=False)
    probes, _ = iv.sink_ablation(model, tokens, mask, 2, settings, modes=("remove_key",))
    r2 = probes[(probes["probe"] == "linear") & (probes["metric"] == "r2")]
    for _, row in compact.iterrows():
        full = r2[(r2["layer"] == row["layer"]) & (r2["ablated_block"] == row["block"])].iloc[0]
        assert (row["r2_clean"], row["r2_ablated"]) == (full["clean_value"], full["value"])
        assert (row["r2_ablated_ci_low"], row["r2_ablated_ci_high"]) == (full["ci_low"], full["ci_high"])
    assert (compact["drop"].abs() > 1e-6).any()  # the ablation did something to compare
    # a subset of the sequences is a different measurement, with a different number
    subset = iv.sink_ablation_drop(model, tokens, mask, 2, acts, n_splits=3, n_boot=30, seed=0, max_sequences=8)
    assert not np.allclose(subset["r2_ablated"], compact["r2_ablated"])


def _left_padded_subject(n_sequences: int = 40, length: int = 12):
    """A random-init NoPE Decoder and ``n_sequences`` left-padded sequences: row s has s % 3 pads, so
    the rows of the second batch of 32 do not share the first rows' first real indices."""
    config = DecoderConfig(d_vocab=16, n_ctx=length, n_layers=2, d_model=32, n_heads=2, position="nope")
    model = Decoder(config, seed=5).eval()
    tokens = torch.randint(2, 16, (n_sequences, length), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(tokens)
    for s in range(n_sequences):
        pads = s % 3
        mask[s, :pads], tokens[s, :pads] = 0, 0
        tokens[s, pads] = 1  # BOS at the first real token
    return model, tokens, mask


def _one_by_one(model, tokens, mask, sites, block):
    """The states of every sequence run alone with its own first key removed in ``block`` (the reference)."""
    parts = []
    for s in range(len(tokens)):
        with iv.intervention(model, iv.sink_hooks(block, "remove_key", iv.first_real_index(mask[s : s + 1]))):
            parts.append(collect(model, tokens[s : s + 1], sites, attention_mask=mask[s : s + 1]))
    return {site: np.concatenate([part.acts[site] for part in parts]) for site in sites}


def test_sink_ablation_removes_each_rows_own_first_key_in_every_batch(one_thread):
    """A sink ablation made once for all sequences and run in batches of 32 used rows 0.. of the first
    batch's first indices for every later batch, so left-padded rows from the 33rd on had a padded key
    blocked instead of their BOS. Per-batch hooks give every row its own: the batched ablated states
    equal each sequence run alone, and the sweep's compact ablation probes those states."""
    model, tokens, mask = _left_padded_subject()
    sites = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    reference = _one_by_one(model, tokens, mask, sites, block=0)
    for batch_size in (3, 32):
        batched = collect(
            model, tokens, sites, attention_mask=mask, batch_size=batch_size, hooks=iv.sink_batch_hooks(0, "remove_key")
        )
        for site in sites:
            np.testing.assert_allclose(batched.acts[site], reference[site], atol=1e-5, err_msg=site)
    clean = collect(model, tokens, sites, attention_mask=mask)
    table = iv.sink_ablation_drop(model, tokens, mask, 2, clean, n_splits=3, n_boot=20, seed=0)
    acts = iv.later_tokens(
        Activations(
            acts={sites[0]: reference[sites[0]]},
            sequence_id=clean.sequence_id,
            position=clean.position,
            token=clean.token,
        )
    )
    expected = probe_absolute_index(
        acts, sites=[sites[0]], tasks=("regression",), controls=False, n_splits=3, n_boot=20, seed=0
    )
    expected = expected[(expected["probe"] == "linear") & (expected["metric"] == "r2")].iloc[0]["value"]
    assert table.loc[0, "r2_ablated"] == pytest.approx(expected, abs=1e-5)
    # the behaviour under the same ablation: each sequence's loss is its own run's
    batched = iv.behavior(model, tokens, mask, hooks=iv.sink_batch_hooks(0, "remove_key"))
    alone = pd.concat(
        [
            iv.behavior(
                model,
                tokens[s : s + 1],
                mask[s : s + 1],
                hooks=iv.sink_hooks(0, "remove_key", iv.first_real_index(mask[s : s + 1])),
            )
            for s in range(len(tokens))
        ],
        ignore_index=True,
    )
    np.testing.assert_allclose(batched["loss"], alone["loss"], rtol=1e-5)


def test_a_sink_hook_made_for_other_rows_is_refused():
    model, tokens, mask = _left_padded_subject(n_sequences=6)
    hooks = iv.sink_hooks(0, "remove_key", iv.first_real_index(mask))  # made for 6 rows
    with pytest.raises(ValueError, match="made for 6 rows but sees a batch of 4"):
        with iv.intervention(model, hooks):
            model(tokens[:4], attention_mask=mask[:4])
    means = iv.mean_values(model, tokens, mask, [0])
    with pytest.raises(ValueError, match="made for 6 rows"):
        with iv.intervention(model, iv.sink_hooks(0, "mean_value", iv.first_real_index(mask), means[0])):
            model(tokens[:4], attention_mask=mask[:4])
    with pytest.raises(ValueError, match="sink ablation mode"):
        iv.sink_batch_hooks(0, "zero")


def test_seeds_past_2_to_the_32_draw_bootstrap_cis_and_too_short_sequences_are_named(tmp_path):
    """--seed takes 0..2^63 - 1; SciPy's RandomState takes seeds below 2^32 (those keep their numbers)."""
    from scipy import stats

    values = np.arange(12, dtype=float) % 5
    before = stats.bootstrap(
        (values,), np.mean, n_resamples=50, method="percentile", random_state=np.random.RandomState(7)
    ).confidence_interval
    assert measure._mean_ci(values, 50, 7) == (before.low, before.high)
    low, high = measure._mean_ci(values, 50, 2**40)
    assert low <= values.mean() <= high
    with pytest.raises(ValueError, match="--seq-len 3 is too short for position patching: it needs at least 4"):
        iv.run_intervene(iv.InterveneSettings(model="circuit", seq_len=3), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_the_clean_behaviour_refuses_logits_that_are_not_finite():
    model = Decoder(DecoderConfig(d_vocab=16, n_ctx=16, n_layers=1, d_model=16, n_heads=2, position="nope"), seed=0)
    with torch.no_grad():
        model.unembed.W_U[0, 3] = float("nan")
    tokens = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    assert iv.behavior(model, tokens, mask)["loss"].isna().all()  # an ablated run's NaN is its own measurement
    with pytest.raises(ValueError, match="logits are not finite"):
        iv.behavior(model, tokens, mask, check_finite=True)
