"""Streamed probes and reads (issue 19): the tables equal the in-memory ones on the same batches,
whether every batch is kept (one pass) or recomputed (two passes), shards on a Dask cluster add
up to one machine's, probes run at 2,048 tokens with position bins and spread distances, and the
sink ablation streamed (an intervention per batch) equals the in-memory one."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch

from nopelens.analyses.intervene import first_real_index
from nopelens.models import Decoder, DecoderConfig
from nopelens.probes import collect, probe_absolute_index, probe_relative_distance, resid_sites, sequence_splits
from nopelens.probes.fitting import BlockMoments
from nopelens.probes.sinks import attention_variance
from nopelens.probes.stream import KeepBudget, Sequences, run
from nopelens.probes.stream_probes import absolute_index_probes, relative_distance_probes
from nopelens.probes.variance import AttentionVariance

TOLERANCE = 1e-8


def assert_tables_equal(memory: pd.DataFrame, streamed: pd.DataFrame, tolerance: float = TOLERANCE) -> None:
    """Same rows and labels; every number equal to ``tolerance`` (absolute and relative)."""
    assert list(memory.columns) == list(streamed.columns)
    assert len(memory) == len(streamed)
    for column in memory.columns:
        if memory[column].dtype.kind == "f":
            np.testing.assert_allclose(
                streamed[column].to_numpy(),
                memory[column].to_numpy(),
                rtol=tolerance,
                atol=tolerance,
                equal_nan=True,
                err_msg=column,
            )
        else:
            pd.testing.assert_series_equal(streamed[column], memory[column], check_dtype=False)


def sweep_reads(n_layers: int, qk, scores, inner=()):
    """The sweep's probe set of a model (analyses.sweep.analyse_subject, without sinks)."""
    residual = resid_sites(n_layers)
    return residual, list(inner), list(qk), list(scores)


def in_memory(model, tokens, mask, residual, inner, qk, scores, n_splits, n_boot, mode, pairs):
    sites = residual + inner + [s for pair in qk for s in pair] + scores
    acts = collect(model, tokens, sites, attention_mask=mask, batch_size=4)
    common = dict(n_splits=n_splits, n_boot=n_boot, seed=0)
    absolute = probe_absolute_index(
        acts, sites=residual + inner, extrapolate_from=tokens.shape[1] // 2, max_classes=64, **common
    )
    relative = probe_relative_distance(
        acts,
        sites=residual,
        feature_kinds=("concat",),
        attention=qk,
        scores=scores,
        bilinear=mode,
        tasks=("regression",),
        pairs_per_distance=pairs,
        **common,
    )
    variance = attention_variance(acts, inner[:1]) if inner else None
    return absolute, relative, variance


def streamed(model, tokens, mask, residual, inner, qk, scores, n_splits, n_boot, mode, pairs, keep, **run_kwargs):
    sequences = Sequences.of(tokens, mask)
    budget = KeepBudget(keep)
    common = dict(n_splits=n_splits, n_boot=n_boot, seed=0, keep=budget)
    measurements = [
        absolute_index_probes(sequences, residual + inner, extrapolate_from=tokens.shape[1] // 2, **common),
        relative_distance_probes(
            sequences,
            sites=residual,
            feature_kinds=("concat",),
            attention=qk,
            scores=scores,
            bilinear=mode,
            tasks=("regression",),
            pairs_per_distance=pairs,
            distances=None,
            **common,
        ),
    ]
    if inner:
        measurements.append(AttentionVariance(sequences, inner[:1]))
    return run(model, sequences, measurements, batch_size=4, **run_kwargs), measurements


@pytest.fixture(scope="module")
def circuit():
    from nopelens.analyses.subjects import resolve

    with torch.no_grad():
        return resolve("circuit", 12, 16, seed=0, progress=False)


@pytest.mark.parametrize("keep", [None, 0, 60_000])
def test_streamed_sweep_probes_equal_in_memory_on_the_circuit(circuit, one_thread, keep):
    """Every batch kept (one pass), none kept (two passes), or some: the same tables to 1e-8."""
    layers = circuit.n_layers
    qk = [(f"blocks.{l}.attn.hook_q", f"blocks.{l}.attn.hook_k") for l in range(layers)]
    scores = [f"blocks.{l}.attn.hook_attn_scores" for l in range(layers)]
    inner = [f"blocks.{l}.hook_attn_out" for l in range(layers)]
    args = (
        circuit.model,
        circuit.tokens,
        circuit.attention_mask,
        resid_sites(layers),
        inner,
        qk,
        scores,
        4,
        40,
        "elementwise",
        12,
    )
    absolute, relative, variance = in_memory(*args)
    tables, measurements = streamed(*args, keep=keep)
    assert_tables_equal(absolute, tables[0])
    assert_tables_equal(relative, tables[1])
    assert_tables_equal(variance, tables[2], tolerance=1e-12)
    reruns = [job.rerun for m in measurements[:2] for job in m.jobs]
    n_batches = len(circuit.tokens) // 4
    if keep is None:
        assert not any(reruns), "an unlimited budget keeps every batch: one pass"
    elif keep == 0:
        assert all(rerun == set(range(n_batches)) for rerun in reruns), "nothing kept: every batch runs twice"
    else:
        assert any(reruns) and not all(rerun == set(range(n_batches)) for rerun in reruns)
    assert measurements[0].budget.used == 0, "kept features are released after the fit"
    # the circuit's known answer survives streaming: block 0 counts positions exactly
    linear = tables[0][(tables[0].probe == "linear") & (tables[0].metric == "r2") & (tables[0].split == "grouped")]
    assert linear.set_index("site").loc["blocks.0.hook_resid_post", "value"] > 0.999


def _tiny_bridged_llama():
    """A random-init 2-layer Llama (grouped-query heads, RoPE inside HF's attention), bridged."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nopelens.models.adapters import bridge_hf_model

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=64,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bridge_hf_model(LlamaForCausalLM(config).eval())


def test_streamed_probes_equal_in_memory_on_a_bridged_hf_llama(one_thread):
    """Grouped-query attention, RoPE applied inside HF's attention, bridged by TransformerLens."""
    model = _tiny_bridged_llama()
    tokens = torch.randint(0, 64, (10, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[:3, :4] = 0  # left padding: positions come from the mask, padding is never a sample
    qk = [("blocks.1.attn.hook_rot_q", "blocks.1.attn.hook_rot_k")]
    args = (model, tokens, mask, resid_sites(2), [], qk, ["blocks.1.attn.hook_attn_scores"], 3, 40, "outer", 6)
    absolute, relative, _ = in_memory(*args)
    tables, _ = streamed(*args, keep=0)
    assert_tables_equal(absolute, tables[0])
    assert_tables_equal(relative, tables[1])
    assert tables[0]["n_samples"].max() == int(mask.sum())


def test_two_folds_halve_the_blocks_and_left_padding_stays_out_of_the_samples(one_thread):
    """With 2 folds every fitting side is one block, so blocks are halved by sequence for the inner
    CV (fold_blocks); an ALiBi decoder, left-padded rows."""
    model = Decoder(
        DecoderConfig(d_vocab=50, n_ctx=32, n_layers=2, d_model=32, n_heads=4, position="alibi"), seed=1
    ).eval()
    tokens = torch.randint(0, 50, (9, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(tokens)
    mask[2:5, :6] = 0
    qk = [("blocks.1.attn.hook_q", "blocks.1.attn.hook_k")]
    args = (
        model,
        tokens,
        mask,
        resid_sites(2),
        ["blocks.0.hook_attn_out"],
        qk,
        ["blocks.1.attn.hook_attn_scores"],
        2,
        30,
        "outer",
        3,
    )
    for memory, stream in zip(in_memory(*args), streamed(*args, keep=0)[0]):
        assert_tables_equal(memory, stream)


def test_constant_input_in_bfloat16_recovers_nothing_streamed_as_in_memory(one_thread):
    """Round-off is not signal: the streamed statistics judge raw per-feature extremes by the
    activations' own dtype (bfloat16 here, kept as such), as the in-memory path does."""
    model = Decoder(
        DecoderConfig(d_vocab=50, n_ctx=32, n_layers=2, d_model=32, n_heads=4, position="nope"),
        seed=1,
        dtype=torch.bfloat16,
    ).eval()
    tokens = torch.full((8, 20), 3)  # one token id, no BOS: every position has the same state
    qk = [("blocks.1.attn.hook_q", "blocks.1.attn.hook_k")]
    args = (
        model,
        tokens,
        None,
        resid_sites(2),
        ["blocks.0.hook_attn_out"],
        qk,
        ["blocks.1.attn.hook_attn_scores"],
        4,
        30,
        "outer",
        4,
    )
    tables, measurements = streamed(*args, keep=0)
    for memory, stream in zip(in_memory(*args)[:2], tables[:2]):
        assert_tables_equal(memory, stream)
    assert {job.dtype for job in measurements[0].jobs} == {"bfloat16"}
    grouped = tables[0][(tables[0].probe == "linear") & (tables[0].metric == "r2") & (tables[0].split == "grouped")]
    assert (grouped["value"] == 0.0).all(), "every feature is round-off: the fit is the mean"


def _tiny_rope_decoder():
    return Decoder(
        DecoderConfig(d_vocab=50, n_ctx=32, n_layers=2, d_model=32, n_heads=4, position="rope"), seed=3
    ).eval()


def test_shards_on_a_dask_cluster_equal_one_machine(one_thread):
    distributed = pytest.importorskip("distributed", reason='Dask distributed is not installed (pip install ".[dask]")')
    tokens = torch.randint(0, 50, (12, 20), generator=torch.Generator().manual_seed(2))
    qk = [("blocks.1.attn.hook_rot_q", "blocks.1.attn.hook_rot_k")]
    args = (
        tokens,
        None,
        resid_sites(2),
        ["blocks.0.hook_attn_out"],
        qk,
        ["blocks.1.attn.hook_attn_scores"],
        4,
        40,
        "elementwise",
        8,
    )
    local, _ = streamed(_tiny_rope_decoder(), *args, keep=None)
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
    ) as cluster:
        with distributed.Client(cluster) as client:
            sharded, measurements = streamed(
                _tiny_rope_decoder, *args, keep=None, executor=client.get_executor(pure=False), shards=3
            )
    assert all(job.rerun == {0, 1, 2} for job in measurements[0].jobs), "a shard keeps nothing: a second pass predicts"
    for one, many in zip(local, sharded):
        assert_tables_equal(one, many, tolerance=1e-10)
    with pytest.raises(TypeError, match="loads the model"):
        run(_tiny_rope_decoder(), Sequences.of(tokens), [], executor=object())


def test_long_context_2048_tokens_with_position_bins_and_spread_distances(one_thread):
    """T = 2,048 on a tiny sinusoidal decoder: the absolute index is read at layer 0 (its input
    carries the position table), classification is over 64 bins of 32 positions, the pairs cover
    0..2047 at 64 distances, and the in-memory path gives the same table."""
    T = 2048
    model = Decoder(
        DecoderConfig(d_vocab=50, n_ctx=T, n_layers=1, d_model=32, n_heads=2, position="sinusoidal"), seed=0
    ).eval()
    tokens = torch.randint(0, 50, (3, T), generator=torch.Generator().manual_seed(0))
    sequences = Sequences.of(tokens)
    sites = resid_sites(1)
    common = dict(n_splits=3, n_boot=20, seed=0, keep=0)
    absolute = absolute_index_probes(sequences, sites, **common)
    relative = relative_distance_probes(
        sequences,
        sites=sites[:1],
        feature_kinds=("concat",),
        scores=["blocks.0.attn.hook_attn_scores"],
        tasks=("regression",),
        **common,
    )
    table, pairs = run(model, sequences, [absolute, relative], batch_size=1)
    assert set(table["target"]) == {"absolute_index//32", "absolute_index"}
    bins = table[table.target == "absolute_index//32"]
    assert (bins["task"] == "classification").all() and not (
        table[table.target == "absolute_index"]["task"] != "regression"
    ).any()
    linear = table[(table.probe == "linear") & (table.site == sites[0])].set_index(["task", "metric"])["value"]
    assert linear["regression", "r2"] > 0.99 and linear["regression", "mad"] < 20
    assert linear["classification", "within_one"] > 0.9
    distances = np.unique(relative.pairs.distance)
    assert len(distances) == 64 and distances[0] == 0 and distances[-1] == T - 1
    assert pairs["n_samples"].iloc[0] == 64 * 3
    acts = collect(model, tokens, sites + ["blocks.0.attn.hook_attn_scores"], batch_size=1)
    assert_tables_equal(probe_absolute_index(acts, sites=sites, n_splits=3, n_boot=20, max_classes=64), table)


def test_block_moments_of_two_shards_with_their_own_shifts_add_up_to_the_whole():
    rng = np.random.default_rng(0)
    X = torch.as_tensor(rng.normal(5.0, 2.0, (40, 3)))
    y = torch.as_tensor(rng.normal(size=(40, 2)))
    label = torch.as_tensor(rng.integers(0, 3, 40))
    classes = [np.arange(3)]

    def moments(rows, shift):
        m = BlockMoments(2, shift, n_values=2, classes=classes)
        for block in (0, 1):
            part = rows[rows % 2 == block]
            m.add(block, X[part] - shift, X[part], y[part], [label[part]])
        return m

    whole = moments(torch.arange(40), X.mean(0))
    first, second = moments(torch.arange(20), X[:20].mean(0)), moments(torch.arange(20, 40), X[20:].mean(0))
    merged = first.merge(second).reshifted(X.mean(0))
    for name in ("count", "total", "gram", "high", "low", "ysum", "yy", "xty"):
        torch.testing.assert_close(getattr(merged, name), getattr(whole, name), rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(merged.class_sums[0], whole.class_sums[0], rtol=1e-12, atol=1e-10)
    grouped = whole.group([[0, 1]])
    torch.testing.assert_close(grouped.gram[0], whole.gram.sum(0))


def test_packed_block_moments_hold_half_the_gram_and_group_to_the_same_full_matrices():
    rng = np.random.default_rng(1)
    X = torch.as_tensor(rng.normal(3.0, 1.0, (30, 5)))
    y = torch.as_tensor(rng.normal(size=(30, 1)))
    shift, other_shift = X.mean(0), X[:10].mean(0)
    full, packed = (BlockMoments(3, shift, n_values=1, packed=p) for p in (False, True))
    for m in (full, packed):
        for block in range(3):
            m.add(block, X[block::3] - shift, X[block::3], y[block::3])
    assert packed.gram.shape == (3, 15) and full.gram.shape == (3, 5, 5)
    blocks = [[0, 2], [1]]
    assert torch.equal(packed.group(blocks).gram, full.group(blocks).gram)  # the same sums, bit for bit
    torch.testing.assert_close(
        packed.reshifted(other_shift).group(blocks).gram,
        full.reshifted(other_shift).group(blocks).gram,
        rtol=1e-14,
        atol=1e-12,
    )
    with pytest.raises(ValueError, match="cannot be merged"):
        full.merge(packed)


def test_the_default_keep_budget_is_capped_so_memory_stops_growing_with_the_tokens(monkeypatch):
    import nopelens.probes.memory as memory

    monkeypatch.setattr(memory, "available_memory", lambda device=None: 64 * 2**30)
    assert KeepBudget().limit == memory.AUTO_KEEP_BYTES == 2**29  # a big machine: the fixed cap
    monkeypatch.setattr(memory, "available_memory", lambda device=None: 2**30)
    assert KeepBudget("auto").limit == 2**28  # a small one: a quarter of what is available
    assert KeepBudget(None).limit is None and KeepBudget(0).limit == 0
    with pytest.raises(ValueError, match="a keep budget is a number of bytes"):
        KeepBudget(-1)


def test_bad_plans_fail_before_any_forward_pass_and_bad_activations_name_their_site(one_thread):
    tokens = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="5 folds need at least 5 sequences"):
        absolute_index_probes(Sequences.of(tokens), resid_sites(1))
    probes = absolute_index_probes(Sequences.of(tokens), resid_sites(1), n_splits=3, n_boot=10)
    with pytest.raises(ValueError, match="not been fed"):
        probes.result()
    model = _tiny_rope_decoder()
    with torch.no_grad():
        model.blocks[0].attn.W_O.fill_(float("nan"))
    with pytest.raises(ValueError, match="blocks.0.hook_resid_post.*sequence 0"):
        run(model, Sequences.of(tokens), [probes], batch_size=2)
    with pytest.raises(KeyError, match="unknown sites"):
        run(model, Sequences.of(tokens), [AttentionVariance(Sequences.of(tokens), ["blocks.9.hook_attn_out"])])


def test_a_non_finite_score_names_the_scores_site(one_thread):
    """The streamed score read checks the scores it is handed, as collect does: NaN or +inf at a real
    key of a real query is named by the scores site (not found later, or blamed on a window)."""
    tokens = torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(0))
    site = "blocks.0.attn.hook_attn_scores"
    for bad in (float("nan"), float("inf")):

        def corrupt(value, hook, bad=bad):
            value[1, 2, 6, 3] = bad  # sequence 1, head 2, query 6, a visible key
            return value

        probes = relative_distance_probes(
            Sequences.of(tokens), scores=[site], tasks=("regression",), n_splits=2, n_boot=10
        )
        with pytest.raises(
            ValueError, match=f"non-finite value at site '{site}', sequence 1, head 2, query position 6"
        ):
            run(_tiny_rope_decoder(), Sequences.of(tokens), [probes], batch_size=4, hooks=[(site, corrupt)])


def test_streamed_probes_equal_in_memory_on_the_zoo_hybrid(one_thread):
    """The zoo's RoPE/NoPE hybrid (its config, untrained: the probes' arithmetic does not care),
    with the sweep's sites: rotated q/k where the layer rotates, plain ones in its NoPE layer,
    every block's scores and outputs."""
    from nopelens.models import zoo

    model = Decoder(zoo.recipe("text-hybrid-4l").config, seed=0).eval()
    layers = model.cfg.n_layers
    tokens = torch.randint(1, model.cfg.d_vocab, (8, 20), generator=torch.Generator().manual_seed(4))
    tokens[:, 0] = 0
    rotated = [f"blocks.{l}.attn.hook_rot_q" in model.hook_dict for l in range(layers)]
    qk = [(f"blocks.{l}.attn.hook_{'rot_' * r}q", f"blocks.{l}.attn.hook_{'rot_' * r}k") for l, r in enumerate(rotated)]
    inner = [f"blocks.{l}.hook_{name}" for l in range(layers) for name in ("attn_out", "mlp_out")]
    scores = [f"blocks.{l}.attn.hook_attn_scores" for l in range(layers)]
    args = (model, tokens, None, resid_sites(layers), inner, qk, scores, 4, 40, "elementwise", 8)
    absolute, relative, variance = in_memory(*args)
    tables, _ = streamed(*args, keep=0)
    assert {pair[0].rsplit(".", 1)[-1] for pair in qk} == {"hook_rot_q", "hook_q"}
    assert_tables_equal(absolute, tables[0])
    assert_tables_equal(relative, tables[1])
    assert_tables_equal(variance, tables[2], tolerance=1e-12)


# ----------------------------------------------------------------------------- attention sinks


def _sinks_both_ways(model, tokens, mask, sites, n_tokens, windows=None, sinks=None, batch_size=3):
    from nopelens.probes.sinks import SinkStats, sink_table

    with torch.no_grad():
        extra = [
            s.replace("hook_pattern", name)
            for s in sites
            if (sinks or {}).get(int(s.split(".")[1]), (None,))[0] == "output_scale"
            for name in ("hook_v", "hook_z")
        ]
        acts = collect(model, tokens, sites + extra, attention_mask=mask, batch_size=batch_size)
        memory = sink_table(acts, n_tokens=n_tokens, windows=windows, sinks=sinks)
        sequences = Sequences.of(tokens, mask)
        (streamed_table,) = run(
            model,
            sequences,
            [SinkStats(sequences, sites, n_tokens=n_tokens, windows=windows, sinks=sinks)],
            batch_size=batch_size,
        )
    return memory, streamed_table


def test_streamed_sinks_equal_the_in_memory_table_with_padding_and_a_window(one_thread):
    """Left padding (the sink is the first real key), a sliding window on block 1 (only the queries
    that see key 0 count): the table of sums equals sink_table's means up to their float32 round-off."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nopelens.models.adapters import bridge_hf_model
    from nopelens.models.masks import KeyWindow

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = bridge_hf_model(LlamaForCausalLM(config).eval())
    tokens = torch.randint(0, 64, (7, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[:3, :4] = 0
    sites = ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    windows = {1: KeyWindow(window=5)}
    memory, streamed_table = _sinks_both_ways(model, tokens, mask, sites, n_tokens=10, windows=windows)
    assert_tables_equal(memory, streamed_table, tolerance=1e-6)
    assert set(streamed_table["key_window"]) == {"causal", "sliding window 5"}
    # a wrong window would average other queries: the numbers must move
    _, causal = _sinks_both_ways(model, tokens, mask, sites[1:], n_tokens=10)
    assert np.abs(causal["sink_mass"].to_numpy() - streamed_table["sink_mass"].to_numpy()[4:]).max() > 1e-3


def test_streamed_sinks_of_uniform_attention_and_learned_sinks_are_the_known_answers(one_thread):
    """Known answers: a repeated token under NoPE gives exactly uniform attention (Gu et al. 2025,
    Prop. 1), so sink mass = mean_{i>=1} 1/(i+1) and Gu's score H_T / T; a learned sink logit log 2 with
    q = 0 takes 2 / (n + 2) of a row of n keys (validate.check_learned_sinks), streamed as in memory."""
    import transformers as T

    from nopelens.analyses.validate import TINY_SPECIAL, _hf_model
    from nopelens.models.adapters import hook_hf_model
    from nopelens.probes.sinks import SinkStats, uniform_sink_score

    n = 12
    nope = Decoder(
        DecoderConfig(d_model=16, n_layers=1, n_heads=2, d_head=8, d_mlp=32, d_vocab=8, n_ctx=n, position="nope")
    )
    tokens = torch.full((5, n), 3)
    sequences = Sequences.of(tokens)
    with torch.no_grad():
        (table,) = run(
            nope, sequences, [SinkStats(sequences, ["blocks.0.attn.hook_pattern"], n_tokens=n)], batch_size=2
        )
    expected = np.mean([1 / (i + 1) for i in range(1, n)])
    np.testing.assert_allclose(table["sink_mass"], expected, atol=1e-6)
    np.testing.assert_allclose(table["sink_score"], uniform_sink_score(n), atol=1e-6)
    assert not table["is_sink"].any()

    base = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        initializer_range=0.2,
        **TINY_SPECIAL,
    )
    for cls, config, kind in [
        (
            T.FlintForCausalLM,
            T.FlintConfig(
                **base,
                head_dim=8,
                num_experts=2,
                num_experts_per_tok=1,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                layer_types=["full_attention"],
            ),
            "learned",
        ),
        (T.GraniteSWAForCausalLM, T.GraniteSWAConfig(**base, layer_types=["full_attention"]), "output_scale"),
    ]:
        hf_model = _hf_model(cls, config, 0)
        attention = hf_model.model.layers[0].self_attn
        attention.q_proj.weight.data.zero_()
        attention.sinks.data.fill_(float(np.log(2.0)))
        model = hook_hf_model(hf_model)
        tokens = torch.randint(3, 64, (4, n), generator=torch.Generator().manual_seed(2))
        memory, streamed_table = _sinks_both_ways(
            model, tokens, None, ["blocks.0.attn.hook_pattern"], n_tokens=n, sinks={0: (kind, attention.sinks.detach())}
        )
        assert_tables_equal(memory, streamed_table, tolerance=1e-6)
        np.testing.assert_allclose(
            streamed_table["learned_sink_mass"], np.mean([2 / (i + 3) for i in range(n)]), atol=1e-5, err_msg=kind
        )


# ----------------------------------------------------------------------------- sink ablation


def _ablation_both_ways(model, tokens, mask, n_layers, keep, n_splits=3, n_boot=30):
    """sink_ablation_drop in memory and streamed (batches of 4) on the same sequences."""
    from nopelens.analyses import intervene as iv

    with torch.no_grad():
        clean = collect(model, tokens, resid_sites(n_layers)[1:], attention_mask=mask, batch_size=4)
        memory = iv.sink_ablation_drop(model, tokens, mask, n_layers, clean, n_splits, n_boot, seed=0)
        sequences = Sequences.of(tokens, mask)
        budget = KeepBudget(keep)
        refused = iv.refused_sink_blocks(model, n_layers, tokens, sequences.mask)
        blocks = [b for b in range(n_layers) if b not in refused]
        clean_probes = iv.later_token_probes(sequences, [b + 1 for b in blocks], n_splits, n_boot, 0, budget)
        (clean_table,) = run(model, sequences, [clean_probes], batch_size=4)
        streamed_table = iv.sink_ablation_drop_streamed(
            model, sequences, n_layers, clean_table, refused, n_splits, n_boot, 0, budget, batch_size=4
        )
    assert budget.used == 0, "kept features are released after each fit"
    return memory, streamed_table


@pytest.mark.parametrize("keep", [None, 0])
def test_streamed_sink_ablation_equals_in_memory_on_a_zoo_nope_model(one_thread, keep):
    """text-nope-4l's config (untrained), left-padded rows: the streamed table (one pass per ablated
    block, or two when nothing is kept) equals sink_ablation_drop's to 1e-8."""
    from nopelens.models import zoo

    model = Decoder(zoo.recipe("text-nope-4l").config, seed=0).eval()
    tokens = torch.randint(1, model.cfg.d_vocab, (9, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(tokens)
    for row, pads in ((1, 3), (4, 2), (7, 5)):
        mask[row, :pads] = 0
    tokens[torch.arange(9), first_real_index(mask)] = 0  # a BOS at each row's first real token
    memory, streamed_table = _ablation_both_ways(model, tokens, mask, model.cfg.n_layers, keep)
    assert set(memory["status"]) == {"measured"}
    assert_tables_equal(memory, streamed_table)
    assert (memory["drop"].abs() > 1e-3).any(), "the ablation changes something to compare"


def test_streamed_sink_ablation_equals_in_memory_on_a_bridged_hf_model_with_left_padding(one_thread):
    """A bridged Llama (RoPE inside HF's attention, grouped-query heads), left-padded rows spread over
    three batches: each batch removes its own rows' first key, in memory and streamed alike."""
    model = _tiny_bridged_llama()
    tokens = torch.randint(1, 64, (10, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    for row, pads in ((0, 4), (5, 2), (9, 6)):
        mask[row, :pads] = 0
    tokens[torch.arange(10), first_real_index(mask)] = 0
    memory, streamed_table = _ablation_both_ways(model, tokens, mask, 2, keep=None)
    assert set(memory["status"]) == {"measured"}
    assert_tables_equal(memory, streamed_table)
    assert (memory["drop"].abs() > 1e-3).any()


def test_later_token_probes_equal_the_in_memory_probe_of_later_tokens(one_thread):
    """min_position=1 leaves out each row's first real token (the rows keep their positions), as
    later_tokens does in memory; with min_position=0 the first tokens are samples again."""
    from nopelens.analyses.intervene import later_tokens

    model = _tiny_rope_decoder()
    tokens = torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(tokens)
    mask[2, :5] = 0
    sites = resid_sites(2)
    acts = later_tokens(collect(model, tokens, sites, attention_mask=mask))
    common = dict(tasks=("classification", "regression"), controls=True, n_splits=4, n_boot=30, seed=0)
    memory = probe_absolute_index(acts, sites=sites, **common)
    sequences = Sequences.of(tokens, mask)
    (later,) = run(
        model, sequences, [absolute_index_probes(sequences, sites, keep=0, min_position=1, **common)], batch_size=3
    )
    assert_tables_equal(memory, later)
    assert later["n_samples"].max() == int(mask.sum()) - 8
    with pytest.raises(ValueError, match="min_position"):
        absolute_index_probes(sequences, sites, min_position=-1)


def test_an_intervention_is_added_per_batch_and_sent_to_shards_or_refused(one_thread):
    """run(hooks=...) changes what the measurements read, batch by batch, on one machine and on a Dask
    cluster alike; hooks that cannot be sent to the shards are refused before any pass."""
    from nopelens.analyses import intervene as iv

    distributed = pytest.importorskip("distributed", reason='Dask distributed is not installed (pip install ".[dask]")')
    tokens = torch.randint(0, 50, (12, 16), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(tokens)
    mask[5, :3] = mask[10, :6] = 0
    sequences = Sequences.of(tokens, mask)
    hooks = iv.sink_batch_hooks(0, "remove_key")

    def probe():
        return iv.later_token_probes(sequences, [1], n_splits=3, n_boot=30, keep=None)

    (clean,) = run(_tiny_rope_decoder(), sequences, [probe()], batch_size=4)
    (local,) = run(_tiny_rope_decoder(), sequences, [probe()], batch_size=4, hooks=hooks)
    assert not np.allclose(local["value"], clean["value"]), "the intervention changed the states"
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
    ) as cluster:
        with distributed.Client(cluster) as client:
            executor = client.get_executor(pure=False)
            (sharded,) = run(
                _tiny_rope_decoder, sequences, [probe()], batch_size=4, executor=executor, shards=3, hooks=hooks
            )
            with pytest.raises(TypeError, match="cannot be sent to the shards"):
                run(
                    _tiny_rope_decoder,
                    sequences,
                    [probe()],
                    batch_size=4,
                    executor=executor,
                    hooks=lambda rows, mask: hooks(rows, mask),
                )
    assert_tables_equal(local, sharded, tolerance=1e-10)


def test_attention_variance_in_row_chunks_is_bit_identical(monkeypatch):
    """AttentionVariance converts a batch to float64 a few rows at a time (glibc reuses such copies
    instead of mapping a fresh one per call); chunks of 7 rows give the same sums, bit for bit, as one
    chunk, with padded sequences and float32 and float64 outputs."""
    import nopelens.probes.variance as variance_module
    from nopelens.probes.stream import Batch

    torch.manual_seed(0)
    tokens = torch.randint(3, 50, (5, 40))
    mask = torch.ones(5, 40, dtype=torch.long)
    mask[1, 30:] = 0
    mask[3, :9] = 0
    sequences = Sequences.of(tokens, mask)
    batch = Batch(0, slice(0, 5), slice(0, int(mask.sum())), sequences)
    values = [(torch.randn(5, 40, 12) * 3 + 5).to(dtype) for dtype in (torch.float32, torch.float64)]

    def state(rows_at_once):
        monkeypatch.setattr(variance_module, "ROWS_AT_ONCE", rows_at_once)
        measurement = AttentionVariance(sequences, ["blocks.0.hook_attn_out"])
        for value in values:
            measurement.update("blocks.0.hook_attn_out", value, batch)
        return measurement.state["blocks.0.hook_attn_out"]

    for chunked, whole in zip(state(7 * 12), state(1 << 20)):
        assert torch.equal(chunked, whole)
    assert values[0].shape[0] * values[0].shape[1] > 7, "the small chunk really splits the batch"


# ----------------------------------------------------------------------------- one engine vs the oracle


def _oracle_predictions(X: np.ndarray, y: np.ndarray, splits, task: str) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's own computation of a linear probe's out-of-fold predictions: the outer
    GroupKFold splits; for values, GridSearchCV over StandardScaler + Ridge on the same 28
    penalties, its inner folds the fitting side's sequences grouped as the outer folds left them
    (grouped, never splitting a sequence); for classes, StandardScaler + PooledLDA."""
    from sklearn.linear_model import Ridge
    from sklearn.model_selection import GridSearchCV, PredefinedSplit
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from nopelens.probes import PooledLDA
    from nopelens.probes.fitting import ALPHAS

    fold_of = np.full(len(y), -1)
    for k, (_, score) in enumerate(splits):
        fold_of[score] = k
    X = X.astype(np.float64)
    index, predicted = [], []
    for fit, score in splits:
        if task == "regression":
            model = GridSearchCV(
                make_pipeline(StandardScaler(), Ridge()),
                {"ridge__alpha": list(ALPHAS)},
                cv=PredefinedSplit(fold_of[fit]),
                scoring="neg_mean_squared_error",
            )
        else:
            model = make_pipeline(StandardScaler(), PooledLDA())
        index.append(score)
        predicted.append(model.fit(X[fit], y[fit]).predict(X[score]))
    return np.concatenate(index), np.concatenate(predicted)


def _default_reads_both_ways(model, tokens, mask, qk, scores, n_splits=3):
    """Every default read's table (the sweep's target table), streamed with nothing kept (the
    statistics alone) and in memory (cached activations replayed into the same engine)."""
    from nopelens.analyses.sweep.reads import ProbeInput, SweepSites, measure_in_memory, measure_targets

    layers = len([s for s in model.hook_dict if s.endswith("hook_resid_post")])
    sites = SweepSites(resid_sites(layers), [], list(qk), list(scores), [])
    sequences = Sequences.of(tokens, mask)
    settings = dict(
        seq_len=tokens.shape[1],
        n_sequences=len(tokens),
        n_splits=n_splits,
        n_boot=20,
        seed=0,
        bilinear="outer",
        max_classes=None,
        distances=None,
    )
    streamed_tables = run(
        model, sequences, measure_targets(ProbeInput(sequences, sites, keep=KeepBudget(0), **settings)), batch_size=4
    )
    acts = collect(model, tokens, sites.all(), attention_mask=mask, batch_size=4)
    memory = measure_in_memory(measure_targets(ProbeInput(Sequences.of_activations(acts), sites, **settings)), acts)
    return pd.concat(streamed_tables, ignore_index=True), memory, acts, sites


@pytest.mark.parametrize("kind", ["nope", "rope", "hf"])
def test_every_default_read_streamed_in_memory_and_by_scikit_learn_agree(kind, one_thread):
    """Issue 38: each default read, streamed from statistics and in memory, equals scikit-learn's
    own pipelines on the same folds to 1e-6 (R^2 and accuracy absolute), on a NoPE, a RoPE and an
    HF-bridged model."""
    from sklearn.metrics import accuracy_score, r2_score

    from nopelens.analyses.sweep.reads import SWEEP_READS
    from nopelens.probes.linear import is_target, position_classes
    from nopelens.probes.targets import bilinear_features, pair_features, sample_distance_pairs, score_features

    tokens = torch.randint(0, 50, (9, 12), generator=torch.Generator().manual_seed(7))
    mask = None
    if kind == "hf":
        model, rot = _tiny_bridged_llama(), "rot_"
    else:
        model = Decoder(
            DecoderConfig(d_vocab=50, n_ctx=32, n_layers=2, d_model=16, n_heads=2, position=kind), seed=4
        ).eval()
        rot = "rot_" if kind == "rope" else ""
    qk = [(f"blocks.{l}.attn.hook_{rot}q", f"blocks.{l}.attn.hook_{rot}k") for l in range(2)]
    scores = [f"blocks.{l}.attn.hook_attn_scores" for l in range(2)]
    streamed_table, memory, acts, sites = _default_reads_both_ways(model, tokens, mask, qk, scores)
    assert_tables_equal(memory, streamed_table, tolerance=1e-6)

    pairs = sample_distance_pairs(acts.sequence_id, acts.position, None, min(64, len(tokens)), 0)
    token_splits = sequence_splits(acts.sequence_id, 3)
    pair_splits = sequence_splits(pairs.sequence_id, 3)
    features = {
        "token": lambda s: acts.features(s),
        "concat": lambda s: pair_features(acts.features(s), pairs),
        "score": lambda s: score_features(acts.patterns[s], acts.sequence_id, acts.position, pairs),
    }
    heads = {q: k for q, k in qk}
    checked = 0
    for read in SWEEP_READS:
        rows = memory[
            (memory.probe == "linear")
            & (memory.split == "grouped")
            & is_target(memory.target, read.target)
            & (memory.task == read.task)
            & (memory.metric == read.metric)
            & memory.features.str.startswith(read.features.rstrip("*"))
        ]
        assert len(rows), f"{read.column}: no rows"
        for _, row in rows.iterrows():
            if row.features.startswith("bilinear"):
                shape = lambda s: acts.acts[s]  # noqa: E731
                X = bilinear_features(shape(row.site), shape(heads[row.site]), pairs, "outer")
            else:
                X = features[row.features](row.site)
            if read.target == "absolute_index":
                y, splits = (
                    (
                        position_classes(acts.position, None)[0]
                        if read.task == "classification"
                        else acts.position.astype(float)
                    ),
                    token_splits,
                )
            else:
                y, splits = pairs.distance.astype(float), pair_splits
            index, predicted = _oracle_predictions(X, y, splits, read.task)
            oracle = r2_score(y[index], predicted) if read.metric == "r2" else accuracy_score(y[index], predicted)
            assert abs(row.value - oracle) <= 1e-6, f"{read.column} at {row.site}: {row.value} vs scikit-learn {oracle}"
            checked += 1
    assert checked >= 2 * 3 + 3 + 2 + 2
