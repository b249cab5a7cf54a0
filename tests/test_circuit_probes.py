"""The probe pipeline finds the position signal the hand-built circuits are known to carry (issue 4)."""

import numpy as np
import torch

from nopelens.circuits import counter, distance
from nopelens.circuits.layout import BOS_TOKEN
from nopelens.probes import (
    collect,
    make_probe,
    out_of_fold_predictions,
    probe_absolute_index,
    probe_relative_distance,
    resid_site,
    sequence_splits,
)


def circuit_batch(model, n_sequences, length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, model.cfg.d_vocab, (n_sequences, length), generator=generator)
    tokens[:, 0] = BOS_TOKEN
    return tokens


def linear_value(table, site, task, metric):
    row = table[
        (table["site"] == site)
        & (table["task"] == task)
        & (table["metric"] == metric)
        & (table["probe"] == "linear")
        & (table["split"] == "grouped")
    ]
    assert len(row) == 1
    return float(row["value"].iloc[0])


def test_absolute_index_is_at_chance_at_layer_0_and_exact_at_layer_1_up_to_n_ctx():
    """Every length up to n_ctx = 256, far past the 64-token windows the zoo models train on.

    The rounded linear (ridge) readout names every position exactly. A 256-class linear classifier
    does not: with 10 sequences per class, LDA's class means of the content dims are too noisy, so
    exact classification is checked at the sweep's 64 positions instead.
    """
    model = counter(n_ctx=256)
    tokens = circuit_batch(model, 10, 256)
    acts = collect(model, tokens, [resid_site(0), resid_site(1)])
    table = probe_absolute_index(acts, tasks=("regression",), controls=False, n_boot=50)
    assert linear_value(table, resid_site(0), "regression", "r2") < 0.05
    assert linear_value(table, resid_site(1), "regression", "r2") > 0.99999
    splits = sequence_splits(acts.sequence_id, 5)
    index, pred = out_of_fold_predictions(make_probe("regression"), acts.features(resid_site(1)), acts.position, splits)
    assert np.array_equal(np.rint(pred), acts.position[index]), "the rounded readout is exact at every position"


def test_absolute_index_classification_is_exact_at_layer_1_and_at_chance_at_layer_0():
    model = counter(n_ctx=64)
    acts = collect(model, circuit_batch(model, 10, 64), [resid_site(0), resid_site(1)])
    table = probe_absolute_index(acts, tasks=("classification",), controls=False, n_boot=50)
    assert linear_value(table, resid_site(0), "classification", "accuracy") < 5 / 64
    assert linear_value(table, resid_site(1), "classification", "accuracy") == 1.0


def test_relative_distance_is_first_read_by_block_1_attention():
    """Theorem 2: block 1's head scores -m(i - j); block 0's uniform head (W_Q = 0) reads nothing."""
    model = distance(n_ctx=48)
    tokens = circuit_batch(model, 12, 48)
    sites = [f"blocks.{l}.attn.hook_{x}" for l in range(2) for x in ("q", "k")]
    acts = collect(model, tokens, sites)
    pairs = [("blocks.0.attn.hook_q", "blocks.0.attn.hook_k"), ("blocks.1.attn.hook_q", "blocks.1.attn.hook_k")]
    table = probe_relative_distance(
        acts, sites=[], attention=pairs, tasks=("regression",), controls=False, pairs_per_distance=12, n_boot=50
    )
    assert linear_value(table, "blocks.0.attn.hook_q", "regression", "r2") < 0.05
    assert linear_value(table, "blocks.1.attn.hook_q", "regression", "r2") > 0.999


def test_without_bos_the_counter_carries_no_position():
    model = counter(n_ctx=64)
    tokens = circuit_batch(model, 12, 64)
    tokens[:, 0] = 1 + (tokens[:, 1] % (model.cfg.d_vocab - 1))  # no BOS anywhere
    acts = collect(model, tokens, [resid_site(1)])
    table = probe_absolute_index(acts, tasks=("regression",), controls=False, n_boot=50)
    assert linear_value(table, resid_site(1), "regression", "r2") < 0.05
    assert np.all(acts.acts[resid_site(1)][:, model.circuit.counter_dim] == 0)
