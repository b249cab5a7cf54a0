"""The known-answer suite: models where theory fixes every number, probed as the sweep probes them.

Every row builds a small model here (untrained, constant input or hand-set), measures one number
with the functions the sweep uses (:func:`~nopelens.probes.collect`,
:func:`~nopelens.probes.probe_absolute_index`, :func:`~nopelens.probes.probe_relative_distance`,
:func:`~nopelens.probes.sinks.sink_table`, :func:`~nopelens.probes.sinks.attention_variance`), and
compares it with the value derived in the docstring of the check that makes it. A verdict of the
sweep ("recoverable at layer l") is only as good as these rows: if the probes read float round-off
as position, or miss a bias in the scores, a row here fails.

Rows (L = :data:`LENGTH` positions, 0..L - 1, every sequence of full length):

- :func:`check_learned`: untrained learned absolute positions, layer 0, classification accuracy 1;
- :func:`check_sinusoidal`: untrained sinusoidal, layer 0, regression R² 1;
- :func:`check_constant`: constant input, no BOS, each attention method and a hybrid, float32:
  chance (R² 0, accuracy 1/L) at every layer;
- :func:`check_bos_constant`: NoPE with a BOS and constant content: layer 0 sees only the BOS flag,
  R² = 3/(L + 1), accuracy 2/L, MAD (L - 2)/4; and a mean predictor's MAD / chance = 3L²/(4(L² - 1));
- :func:`check_circuit`: the Theorem 1/2 circuit: chance at layer 0, exact at layer 1, score read
  exact at block 1 (and nothing at block 0);
- :func:`check_alibi`: untrained ALiBi, score read R² 1 at block 0;
- :func:`check_rope_constant`: RoPE with constant content, content-only q·k read R² 1;
- :func:`check_sinks`: a head with all mass on token 0 and a uniform head, Gu et al.'s sink scores
  1 and H_T/T;
- :func:`check_variance`: untrained NoPE block 0, variance slope -1 within 3 bootstrap standard
  errors;
- :func:`check_repeated_tokens`: NoPE on one repeated token: attention exactly uniform (Gu et al.
  2025, Prop. 1), so the first-token sink rate is 0;
- :func:`check_query_temperatures`: Llama 4's and Beam's NoPE-layer query temperatures, measured
  from the patterns, equal their formulas;
- :func:`check_detector`: the per-layer detector reads nope / relative right on a Decoder hybrid
  of known layers and on SmolLM3 with a known ``no_rope_layers``;
- :func:`check_learned_sinks`: with q = 0 every score is 0, so a sink logit log 2 takes 2 / (n + 2)
  of n visible keys' row, for GPT-OSS-style learned sinks (Flint) and Granite SWA's output scale.

``nopelens validate`` (:mod:`nopelens.analyses.cli.validate`) prints the rows and writes
``docs/known_answers.md``; the tests assert each row.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Callable

import numpy as np
import pandas as pd
import torch
import transformers as T

from nopelens.analyses.audit import Tolerance
from nopelens.analyses.audit.core import make_subject
from nopelens.analyses.audit.detector import declared_reading, detect
from nopelens.circuits import distance
from nopelens.circuits.layout import BOS_TOKEN
from nopelens.models import Decoder, DecoderConfig
from nopelens.models.adapters import bridge_hf_model, hook_hf_model
from nopelens.models.hf import QueryScale
from nopelens.models.hooks import act_names
from nopelens.models.threads import one_thread
from nopelens.probes import Activations, collect, probe_absolute_index, probe_relative_distance, resid_site
from nopelens.probes.sinks import attention_variance, sink_rate, sink_table, variance_slopes

LENGTH = 16
"""Positions per sequence (even, so the MAD formulas below hold as written)."""
N_SEQUENCES = 40
N_BOOT = 100
SEED = 0
EXACT = 1e-3
"""Tolerance of a value theory fixes exactly but a ridge probe reaches only up to its penalty."""


@dataclass(frozen=True)
class Row:
    """One known answer: what was measured on which model, against what theory says.

    Attributes:
        name: stable id (tests parametrize over it).
        model: the model, in words.
        quantity: what is measured, in words.
        expected: the derived value.
        measured: the measured value.
        comparison: ``==`` (|measured - expected| <= tolerance), ``<=`` (measured <= expected +
            tolerance) or ``>=`` (measured >= expected - tolerance).
        tolerance: allowed slack, in the quantity's units.
        derivation: where ``expected`` comes from, one line.
    """

    name: str
    model: str
    quantity: str
    expected: float
    measured: float
    comparison: str
    tolerance: float
    derivation: str

    @property
    def passed(self) -> bool:
        if not np.isfinite(self.measured):
            return False
        if self.comparison == "==":
            return abs(self.measured - self.expected) <= self.tolerance
        if self.comparison == "<=":
            return self.measured <= self.expected + self.tolerance
        if self.comparison == ">=":
            return self.measured >= self.expected - self.tolerance
        raise ValueError(f"unknown comparison {self.comparison!r}")


# ----------------------------------------------------------------------------- helpers


def _tokens(n: int, length: int, low: int, high: int, seed: int) -> torch.Tensor:
    return torch.randint(low, high, (n, length), generator=torch.Generator().manual_seed(seed))


def _linear(table: pd.DataFrame, metric: str, task: str = "regression", **where) -> pd.Series:
    """Values of the linear grouped probe for ``metric``, indexed by layer."""
    rows = table[(table["probe"] == "linear") & (table["split"] == "grouped") & (table["metric"] == metric)
                 & (table["task"] == task)]
    for column, value in where.items():
        rows = rows[rows[column] == value]
    return rows.set_index("layer")["value"]


def _absolute(model, tokens, layers, tasks=("classification", "regression"), controls=False, seed=SEED):
    acts = collect(model, tokens, [resid_site(layer) for layer in layers])
    return probe_absolute_index(acts, tasks=tasks, controls=controls, n_boot=N_BOOT, seed=seed)


def _decoder(seed: int = SEED, **config):
    defaults = dict(d_vocab=16, n_ctx=LENGTH, n_layers=1, d_model=32, n_heads=4)
    return Decoder(DecoderConfig(**{**defaults, **config}), seed=seed).eval()


# ----------------------------------------------------------------------------- the checks


def check_learned(seed: int = SEED) -> list[Row]:
    """Untrained learned absolute positions: layer 0 names every position exactly.

    Layer 0 is x = W_E[t] + W_pos[p]. Differences of token embeddings span at most d_vocab - 1
    directions; L random position rows are, with probability 1, affinely independent of them when
    L + d_vocab - 1 <= d_model (here 16 + 8 - 1 <= 32). Projected off the token directions, each
    position is one point with no spread, so a linear classifier separates the L classes exactly:
    accuracy 1.
    """
    model = _decoder(seed, d_vocab=8, position="learned")
    table = _absolute(model, _tokens(N_SEQUENCES, LENGTH, 0, 8, seed), [0], tasks=("classification",))
    return [Row("learned_layer0_accuracy", "untrained learned APE (d_vocab 8, d_model 32)",
                "layer 0 absolute index, classification accuracy", 1.0, _linear(table, "accuracy", "classification")[0],
                "==", 0.0, "position rows independent of token directions (L + d_vocab - 1 <= d_model)")]


def check_sinusoidal(seed: int = SEED) -> list[Row]:
    """Untrained sinusoidal positions: layer 0 reads the index with R² 1.

    Layer 0 is W_E[t] + PE[p] with PE the exact Vaswani table (d_model 32, L = 16). The table has
    rank L - 1 after centering, so p is an exact linear function of PE[p]; with d_vocab = 8 the
    token directions leave room for such a function orthogonal to them (as for learned rows), so the
    linear read is exact and R² = 1, up to the ridge penalty (:data:`EXACT`).
    """
    model = _decoder(seed, d_vocab=8, position="sinusoidal")
    table = _absolute(model, _tokens(N_SEQUENCES, LENGTH, 0, 8, seed), [0], tasks=("regression",))
    return [Row("sinusoidal_layer0_r2", "untrained sinusoidal (d_vocab 8, d_model 32)",
                "layer 0 absolute index, regression R²", 1.0, _linear(table, "r2")[0], "==", EXACT,
                "p is linear in the exact table PE[p] (rank L - 1 after centering)")]


CONSTANT_METHODS = {"nope": "nope", "rope": "rope", "alibi": "alibi", "shaw": "shaw", "hybrid": ("rope", "nope")}
"""Constant-input models: every attention method, and a RoPE/NoPE hybrid (NoPE in the last layer)."""


def check_constant(seed: int = SEED) -> list[Row]:
    """Constant input, no BOS, float32: chance at every layer, for every attention method and a hybrid.

    With every token the same id, layer 0 is the same vector at every position. In block l, every key
    and every value are then equal, so whatever the pattern (uniform for NoPE, shaped by RoPE's
    rotation, ALiBi's or Shaw's bias), the head outputs that one value: sum_j A_ij v = v. By
    induction every layer holds one vector for all positions, and no probe can beat the mean: R² = 0,
    and accuracy 1/L (one class predicted for L equally frequent positions). Float32 leaves
    position-dependent round-off of about 1e-7 relative (the softmax weights sum to 1 only up to
    rounding); it is not signal, and a probe that reads it fails this row. Measured: the largest
    value over layers 0..2. Every sequence has all L positions, so the fitting side's mean is the
    scoring side's and the mean predictor's R² is exactly 0; tolerance 1e-6 (R²) and 1e-9
    (accuracy).
    """
    rows = []
    tokens = torch.full((N_SEQUENCES, LENGTH), 3, dtype=torch.long)
    for name, position in CONSTANT_METHODS.items():
        model = _decoder(seed, n_layers=2, position=position)
        table = _absolute(model, tokens, [0, 1, 2])
        label = f"untrained {name if name != 'hybrid' else 'RoPE+NoPE hybrid'}, constant input, no BOS, float32"
        rows.append(Row(f"constant_{name}_max_r2", label, "largest regression R² over layers 0-2", 0.0,
                        float(_linear(table, "r2").max()), "==", 1e-6, "one state at every position: nothing to read"))
        rows.append(Row(f"constant_{name}_max_accuracy", label, "largest classification accuracy over layers 0-2",
                        1 / LENGTH, float(_linear(table, "accuracy", "classification").max()), "==", 1e-9,
                        "one class predicted for L equally frequent positions"))
    return rows


def check_bos_constant(seed: int = SEED) -> list[Row]:
    """NoPE with a BOS and constant content: layer 0 sees only the BOS flag.

    Layer 0 is the token embedding alone: position 0 (BOS) has one vector, positions 1..L-1 all share
    another. The best linear read predicts 0 at position 0 and the mean L/2 of 1..L-1 elsewhere.

    - R²: the residual variance is that of 1..L-1, (L² - 2L)/12, on a fraction (L - 1)/L of the
      samples; over Var(p) = (L² - 1)/12 this gives R² = 1 - (L - 1)(L - 2)/(L² - 1) = 3/(L + 1).
    - Accuracy: position 0 is always right; the L - 1 others share one vector, so one of them is
      predicted for all: accuracy (1 + 1)/L = 2/L.
    - MAD of the regression read: (1/L) sum_{p=1}^{L-1} |p - L/2| = (L - 2)/4 for even L.
    - A mean predictor (the sweep's ``majority`` row) predicts (L - 1)/2 everywhere:
      MAD = L/4 for even L, over the chance value (L² - 1)/(3L) gives 3L²/(4(L² - 1)). The chance
      value is the sweep's own (the table's ``chance`` column, E|X - Y| over the scored positions),
      which on L equally frequent positions is (L² - 1)/(3L).
    """
    model = _decoder(seed, d_vocab=8, position="nope")
    tokens = torch.full((N_SEQUENCES, LENGTH), 3, dtype=torch.long)
    tokens[:, 0] = 0  # BOS
    table = _absolute(model, tokens, [0], controls=True)
    label = "untrained NoPE, BOS + constant content"
    L = LENGTH
    majority = table[(table["probe"] == "majority") & (table["task"] == "regression") & (table["metric"] == "mad")]
    return [
        Row("bos_constant_layer0_r2", label, "layer 0 regression R²", 3 / (L + 1), _linear(table, "r2")[0], "==", EXACT,
            "R² = 3/(L + 1): only position 0 is told apart"),
        Row("bos_constant_layer0_accuracy", label, "layer 0 classification accuracy", 2 / L,
            _linear(table, "accuracy", "classification")[0], "==", 1e-9, "accuracy = 2/L"),
        Row("bos_constant_layer0_mad", label, "layer 0 regression MAD (positions)", (L - 2) / 4,
            _linear(table, "mad")[0], "==", EXACT * L, "MAD = (L - 2)/4 for even L"),
        Row("mean_predictor_mad_over_chance", "a mean predictor (the sweep's majority row)",
            "MAD / chance MAD", 3 * L**2 / (4 * (L**2 - 1)),
            float(majority["value"].iloc[0]) / float(majority["chance"].iloc[0]), "==",
            1e-9, "MAD = L/4 over (L² - 1)/(3L) = 3L²/(4(L² - 1))"),
    ]


def check_circuit(seed: int = SEED) -> list[Row]:
    """The Theorem 1/2 circuit (Kazemnejad et al. 2023, App. C): chance, then exact, then the score read.

    Layer 0 is embeddings only (NoPE): a BOS flag plus one-hot content drawn independently of
    position, so at most the BOS flag is read: R² <= 3/(L + 1) and accuracy <= 2/L (see
    :func:`check_bos_constant`; tolerance 0.05 for the noise of fitting the content dims). Block 0's
    uniform head writes 1/(i+1) and its MLP turns it into i exactly: layer 1 accuracy 1, R² 1.
    Block 0's head has W_Q = 0, so its scores are 0 and read nothing (R² <= 0); block 1's head scores
    -m (i - j) (Theorem 2), a linear function of i - j: score read R² 1, reported at layer 2.
    """
    model = distance(n_ctx=LENGTH)
    tokens = _tokens(N_SEQUENCES, LENGTH, 1, model.cfg.d_vocab, seed)
    tokens[:, 0] = BOS_TOKEN
    scores = ["blocks.0.attn.hook_attn_scores", "blocks.1.attn.hook_attn_scores"]
    acts = collect(model, tokens, [resid_site(0), resid_site(1)] + scores)
    absolute = probe_absolute_index(acts, controls=False, n_boot=N_BOOT, seed=seed)
    relative = probe_relative_distance(acts, sites=[], scores=scores, tasks=("regression",), controls=False,
                                       n_boot=N_BOOT, seed=seed)
    r2, accuracy = _linear(absolute, "r2"), _linear(absolute, "accuracy", "classification")
    score_r2 = _linear(relative, "r2", features="score")
    label = "Theorem 1/2 circuit (hand-set NoPE, BOS)"
    L = LENGTH
    return [
        Row("circuit_layer0_r2", label, "layer 0 regression R²", 3 / (L + 1), r2[0], "<=", 0.05, "BOS flag only"),
        Row("circuit_layer0_accuracy", label, "layer 0 classification accuracy", 2 / L, accuracy[0], "<=", 0.05,
            "BOS flag only"),
        Row("circuit_layer1_r2", label, "layer 1 regression R²", 1.0, r2[1], "==", EXACT, "Theorem 1: i written exactly"),
        Row("circuit_layer1_accuracy", label, "layer 1 classification accuracy", 1.0, accuracy[1], "==", 0.0,
            "Theorem 1: i written exactly"),
        Row("circuit_block0_score_r2", label, "block 0 score read R² (layer 1)", 0.0, score_r2[1], "<=", 0.01,
            "W_Q = 0: every score 0"),
        Row("circuit_block1_score_r2", label, "block 1 score read R² (layer 2)", 1.0, score_r2[2], "==", EXACT,
            "Theorem 2: score = -m (i - j)"),
    ]


def check_alibi(seed: int = SEED) -> list[Row]:
    """Untrained ALiBi: block 0's scores read i - j with R² 1.

    The score is q_i.k_j / sqrt(d_head) - m_h (i - j). At init (std 0.02) the content term is of
    order 1e-3, against a bias of m_h (i - j) up to 0.25 * 15 for the steepest of 4 heads, so the
    scores are linear in i - j up to that noise: R² >= 0.99 (tolerance 0.01).
    """
    model = _decoder(seed, d_vocab=50, position="alibi")
    acts = collect(model, _tokens(N_SEQUENCES, LENGTH, 0, 50, seed), ["blocks.0.attn.hook_attn_scores"])
    table = probe_relative_distance(acts, sites=[], scores=list(acts.patterns), tasks=("regression",),
                                    controls=False, n_boot=N_BOOT, seed=seed)
    return [Row("alibi_block0_score_r2", "untrained ALiBi (d_model 32, 4 heads), random tokens",
                "block 0 score read R² (layer 1)", 1.0, _linear(table, "r2", features="score")[1], ">=", 0.01,
                "score = content (~1e-3) - m_h (i - j)")]


def check_rope_constant(seed: int = SEED) -> list[Row]:
    """RoPE with constant content: the content-only q·k read gives i - j with R² 1.

    With one token, q_i = R_i q and k_j = R_j k. The outer product of the rotated pairs holds
    cos((i - j) theta_r) and sin((i - j) theta_r) for every frequency; the lowest, theta = 10000^(-3/4)
    for d_head 8, keeps (i - j) theta <= 0.015, where sin is linear to 4e-5 relative, so i - j is
    a linear function of the features up to far less than the ridge penalty: R² = 1.
    """
    model = _decoder(seed, position="rope")
    sites = ("blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k")
    acts = collect(model, torch.full((N_SEQUENCES, LENGTH), 3, dtype=torch.long), list(sites))
    table = probe_relative_distance(acts, sites=[], attention=[sites], tasks=("regression",), controls=False,
                                    n_boot=N_BOOT, seed=seed)
    return [Row("rope_constant_content_qk_r2", "untrained RoPE, constant content",
                "block 0 content-only q·k read R² (layer 1)", 1.0, _linear(table, "r2", features="bilinear_outer")[1],
                "==", EXACT, "rotated q_i k_j holds sin/cos of (i - j) theta")]


def sink_model():
    """A hand-set one-layer NoPE decoder: head 0 puts all its mass on token 0 (BOS), head 1 is uniform.

    Embedding: dim 0 is 1 for BOS (token 0), dim 1 for every other token. Head 0's query is the
    constant b_Q = (200, 0) and its key reads dim 0, so its score is 200/sqrt(2) for BOS and 0
    otherwise: e^-141 underflows in float32 and the whole mass lands on token 0. Head 1 has zero
    weights: every score 0, uniform attention.
    """
    cfg = DecoderConfig(d_vocab=4, n_ctx=LENGTH, n_layers=1, d_model=4, n_heads=2, d_mlp=0,
                        normalization="none", position="nope")
    model = Decoder(cfg, seed=SEED)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.embed.W_E[0, 0] = 1.0
        model.embed.W_E[1:, 1] = 1.0
        attn = model.blocks[0].attn
        attn.b_Q[0, 0] = 200.0
        attn.W_K[0, 0, 0] = 1.0
    return model.eval()


def check_sinks(seed: int = SEED) -> list[Row]:
    """Gu et al. 2025 sink scores over T = L tokens: 1 for all mass on token 0, H_T/T for uniform.

    Query i of a uniform head gives 1/(i + 1) to token 0, so the mean over queries 0..T-1 is
    (1/T) sum_{i=1}^T 1/i = H_T / T (computed here as an exact fraction).
    """
    tokens = _tokens(N_SEQUENCES, LENGTH, 1, 4, seed)
    tokens[:, 0] = 0
    acts = collect(sink_model(), tokens, ["blocks.0.attn.hook_pattern"])
    scores = sink_table(acts, n_tokens=LENGTH).set_index("head")["sink_score"]
    harmonic = float(sum(Fraction(1, i) for i in range(1, LENGTH + 1)) / LENGTH)
    label = "hand-set one-layer NoPE, 2 heads"
    return [
        Row("sink_all_mass_on_token0", label, f"sink score of head 0 (T = {LENGTH})", 1.0, scores[0], "==", 1e-6,
            "every query puts weight 1 on token 0"),
        Row("sink_uniform_head", label, f"sink score of head 1 (T = {LENGTH})", harmonic, scores[1], "==", 1e-6,
            "uniform: H_T / T"),
    ]


def check_variance(seed: int = SEED, n_sequences: int = 200, n_boot: int = 100) -> list[Row]:
    """Untrained NoPE block 0: attention-output variance falls as 1/(i + 1), log-log slope -1.

    Block 0 of NoPE reads token embeddings of i.i.d. random tokens; at init the scores are ~0, so
    the head averages i + 1 independent values and Var(z_i) = Var(v)/(i + 1) (Chi et al. 2023; seed
    ``004_150f630256efbd1c.txt``). The slope is measured with the sweep's functions on
    ``n_sequences`` sequences; its sampling error is the standard deviation of the slope over
    ``n_boot`` bootstrap resamples of whole sequences, and the row passes within 3 of them.
    """
    site = "blocks.0.hook_attn_out"
    model = _decoder(seed, d_vocab=64, position="nope")
    acts = collect(model, _tokens(n_sequences, LENGTH, 0, 64, seed), [site])
    slope = float(variance_slopes(attention_variance(acts))["slope"].iloc[0])
    rng = np.random.default_rng(seed)
    by_sequence = acts.acts[site].reshape(n_sequences, LENGTH, -1)
    boot = []
    for _ in range(n_boot):
        draw = by_sequence[rng.integers(0, n_sequences, n_sequences)]
        resampled = Activations(acts={site: draw.reshape(n_sequences * LENGTH, -1)},
                                sequence_id=np.repeat(np.arange(n_sequences), LENGTH),
                                position=np.tile(np.arange(LENGTH), n_sequences),
                                token=np.zeros(n_sequences * LENGTH, dtype=np.int64))
        boot.append(float(variance_slopes(attention_variance(resampled))["slope"].iloc[0]))
    error = float(np.std(boot, ddof=1))
    return [Row("nope_block0_variance_slope", f"untrained NoPE, {n_sequences} random sequences",
                "log-log slope of block 0 attention-output variance vs position + 1", -1.0, slope, "==", 3 * error,
                f"Var(z_i) = Var(v)/(i + 1); tolerance 3 bootstrap SE (SE {error:.3f})")]


def check_repeated_tokens(seed: int = SEED) -> list[Row]:
    """NoPE on one repeated token: every key is the same vector, so every score of a row is equal
    and the attention is exactly uniform, 1/(i + 1) (Gu et al. 2025, "When attention sink emerges",
    Prop. 1); Gu's score of token 0 is then H_T/T = 0.211 for T = 16 < 0.3, so the sink rate is 0.
    Measured on a 2-layer random NoPE Decoder (every layer sees equal inputs, so both are uniform).
    """
    model = _decoder(seed, n_layers=2, position="nope", init_std=0.3)
    tokens = torch.full((4, LENGTH), 5, dtype=torch.long)
    sites = act_names("pattern", 2)
    acts = collect(model, tokens, sites)
    uniform = np.tril(np.ones((LENGTH, LENGTH))) / np.arange(1, LENGTH + 1)[:, None]
    deviation = max(float(np.abs(p - uniform[None]).max()) for site in sites for p in acts.patterns[site])
    rate = sink_rate(sink_table(acts, n_tokens=LENGTH))
    label = "random 2-layer NoPE, one repeated token, no BOS"
    return [
        Row("nope_repeated_tokens_uniform", label, "max |pattern - 1/(i + 1)| at allowed keys", 0.0, deviation,
            "==", 1e-6, "equal keys give equal scores: uniform attention (Gu et al. Prop. 1)"),
        Row("nope_repeated_tokens_sink_rate", label, "Gu sink rate (eps 0.3)", 0.0, rate, "==", 0.0,
            f"uniform gives token 0 the score H_T/T = {float(uniform[:, 0].mean()):.3f} < 0.3"),
    ]


def check_query_temperatures(seed: int = SEED) -> list[Row]:
    """The NoPE-layer query temperatures of Llama 4 and Beam, measured, against their formulas.

    A temperature tau_i multiplies query i, so the row-centred scores s_ij - s_ii (= log p_ij -
    log p_ii) of row i are multiplied by it; the factor of each row is fitted by least squares
    between two runs with the layer's input fixed:

    - Llama 4 (``attn_temperature_tuning``, floor_scale 4, attn_scale 0.1): tuning off against on;
      the factor is tau(i) = 1 + 0.1 log1p(floor((i + 1) / 4)), i the token index;
    - Beam: position ids p against p + 100000; the factor is tau(p + 100000) / tau(p) with
      tau(p) = (1 + (p + 1) / 2048)^0.1.
    """
    index = torch.arange(LENGTH)
    rows = []
    config = T.Llama4TextConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=8, intermediate_size=64, intermediate_size_mlp=64, num_local_experts=2,
                                vocab_size=64, no_rope_layers=[1, 0], floor_scale=4, attn_scale=0.1,
                                attn_temperature_tuning=True, initializer_range=0.2, attention_chunk_size=LENGTH,
                                **TINY_SPECIAL)
    llama4 = _hf_model(T.Llama4ForCausalLM, config, seed)
    tokens = _tokens(1, LENGTH, 0, 64, seed)
    attention = llama4.model.layers[1].self_attn
    patterns = []
    for tuning in (False, True):
        attention.attn_temperature_tuning = tuning
        patterns.append(llama4(tokens, attention_mask=torch.ones_like(tokens), output_attentions=True).attentions[1])
    measured = _row_factors(patterns[0], patterns[1])
    expected = QueryScale("llama4", "index", 4.0, 0.1).factor(index)
    rows.append(Row("llama4_query_temperature", "tiny Llama 4, NoPE layer 1, floor_scale 4",
                    "max |fitted row factor - tau(i)| over query rows 1..15", 0.0,
                    float((measured[1:] - expected[1:]).abs().max()), "==", 1e-4,
                    "tau(i) = 1 + attn_scale log1p(floor((i + 1) / floor_scale)), i the token index"))

    config = T.BeamConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=64, moe_intermediate_size=32, num_experts=2,
                          num_experts_per_tok=1, n_group=1, topk_group=1, vocab_size=64, initializer_range=0.2,
                          layer_types=["sliding_attention", "full_attention"], sliding_window=LENGTH, **TINY_SPECIAL)
    beam = hook_hf_model(_hf_model(T.BeamForCausalLM, config, seed))
    ids = index[None]
    held = {}

    def hold(x, hook):
        if "x" in held:
            return held["x"]
        held["x"] = x.detach().clone()
        return None

    shifted_patterns = []
    for shift in (0, 100_000):
        with beam.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", hold)]):
            _, cache = beam.run_with_cache(tokens, attention_mask=torch.ones_like(tokens), position_ids=ids + shift,
                                           names_filter="blocks.1.attn.hook_pattern")
        shifted_patterns.append(cache["blocks.1.attn.hook_pattern"])
    measured = _row_factors(shifted_patterns[0], shifted_patterns[1])
    tau = QueryScale("beam", "position")
    expected = tau.factor(index + 100_000) / tau.factor(index)
    rows.append(Row("beam_query_temperature", "tiny Beam, NoPE layer 1, positions + 100000",
                    "max |fitted row factor - tau(p + 100000) / tau(p)| over query rows 1..15", 0.0,
                    float((measured[1:] - expected[1:]).abs().max()), "==", 1e-4,
                    "tau(p) = (1 + (p + 1) / 2048)^0.1, p the position id"))
    return rows


TINY_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
"""Special token ids inside the tiny HF models' 64-token vocabulary."""


def _hf_model(cls, config, seed: int):
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(config).eval()


def _row_factors(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Per query row, the least-squares factor c with (log p_after - own) = c (log p_before - own),
    over heads and visible keys; ``[query_pos]`` (row 0, with no other key, gets 1)."""
    def centred(p):
        logp = p.double().clamp(min=1e-300).log()
        visible = p > 0
        return (logp - logp.diagonal(dim1=-2, dim2=-1)[..., :, None]).masked_fill(~visible, 0.0)

    a, b = centred(after[0]), centred(before[0])  # [head, query, key]
    norm = (b * b).sum((0, 2))
    return torch.where(norm > 0, (a * b).sum((0, 2)) / norm.clamp(min=1e-300), torch.ones_like(norm))


def check_detector(seed: int = SEED) -> list[Row]:
    """The per-layer detector on models whose layers are known: a Decoder with NoPE, RoPE, ALiBi
    and NoPE layers, and SmolLM3 with ``no_rope_layers`` [0, 1, 1, 0] (1 = RoPE, as its config
    docstring says). Each layer's reading must be what its method implies (nope or relative)."""
    tokens = _tokens(2, LENGTH, 3, 16, seed)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0
    decoder = _decoder(seed, n_layers=4, position=["nope", "rope", "alibi", "nope"], init_std=0.3)
    config = T.SmolLM3Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=64, vocab_size=64, no_rope_layers=[0, 1, 1, 0], initializer_range=0.2,
                             **TINY_SPECIAL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        smollm3 = bridge_hf_model(_hf_model(T.SmolLM3ForCausalLM, config, seed))
    rows = []
    for name, model, label in (("detector_decoder_hybrid", decoder, "Decoder nope, rope, alibi, nope"),
                               ("detector_smollm3", smollm3, "tiny SmolLM3, no_rope_layers [0, 1, 1, 0]")):
        subject, _ = make_subject(model, None)
        readings = detect(subject, tokens, mask, Tolerance())
        right = sum(r.reading == declared_reading(subject, r.layer) for r in readings)
        rows.append(Row(name, label, "layers whose measured reading is the declared one", float(len(readings)),
                        float(right), "==", 0.0, "NoPE layers bitwise unchanged under re-spaced positions, "
                        "rotating and ALiBi layers changed but shift-invariant"))
    return rows


def check_learned_sinks(seed: int = SEED) -> list[Row]:
    """Known sink masses: with q = 0 every score of a row of n visible keys is 0, so a sink logit s
    takes e^s / (e^s + n) of it; with s = log 2, 2 / (n + 2). Full-attention layer 0 of Flint (a
    learned logit in the denominator, GPT-OSS style) and of Granite SWA (the same as an output scale
    sigmoid(lse - s)): mean over queries i of 2 / (i + 3), read by ``sink_table``."""
    base = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, vocab_size=64, initializer_range=0.2, **TINY_SPECIAL)
    models = {
        "flint": (T.FlintForCausalLM, T.FlintConfig(**base, head_dim=8, num_experts=2, num_experts_per_tok=1,
                                                    moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                    layer_types=["full_attention"]), "learned"),
        "granite_swa": (T.GraniteSWAForCausalLM, T.GraniteSWAConfig(**base, layer_types=["full_attention"]),
                        "output_scale"),
    }
    expected = float(np.mean([2.0 / (i + 3) for i in range(LENGTH)]))
    # no pad id: its embedding row is zero, and a query whose values are all zero shows no output scale
    tokens = _tokens(3, LENGTH, TINY_SPECIAL["pad_token_id"] + 1, 64, seed)
    rows = []
    for name, (cls, config, kind) in models.items():
        hf_model = _hf_model(cls, config, seed)
        attention = hf_model.model.layers[0].self_attn
        attention.q_proj.weight.data.zero_()
        attention.sinks.data.fill_(float(np.log(2.0)))
        model = hook_hf_model(hf_model)
        sites = ["blocks.0.attn.hook_pattern"] + (["blocks.0.attn.hook_v", "blocks.0.attn.hook_z"]
                                                  if kind == "output_scale" else [])
        acts = collect(model, tokens, sites)
        table = sink_table(acts, n_tokens=LENGTH, sinks={0: (kind, attention.sinks.detach())})
        rows.append(Row(f"{name}_sink_mass", f"tiny {name}, q = 0, sink logit log 2 ({kind})",
                        "mean learned_sink_mass over heads", expected, float(table["learned_sink_mass"].mean()),
                        "==", 1e-5, "e^s / (e^s + n) = 2 / (n + 2) for n = i + 1 visible keys"))
    return rows


CHECKS: tuple[Callable[[int], list[Row]], ...] = (
    check_learned, check_sinusoidal, check_constant, check_bos_constant, check_circuit, check_alibi,
    check_rope_constant, check_sinks, check_variance, check_repeated_tokens, check_query_temperatures,
    check_detector, check_learned_sinks,
)

ROW_NAMES = (
    "learned_layer0_accuracy", "sinusoidal_layer0_r2",
    *(f"constant_{name}_{what}" for name in CONSTANT_METHODS for what in ("max_r2", "max_accuracy")),
    "bos_constant_layer0_r2", "bos_constant_layer0_accuracy", "bos_constant_layer0_mad",
    "mean_predictor_mad_over_chance",
    "circuit_layer0_r2", "circuit_layer0_accuracy", "circuit_layer1_r2", "circuit_layer1_accuracy",
    "circuit_block0_score_r2", "circuit_block1_score_r2",
    "alibi_block0_score_r2", "rope_constant_content_qk_r2",
    "sink_all_mass_on_token0", "sink_uniform_head", "nope_block0_variance_slope",
    "nope_repeated_tokens_uniform", "nope_repeated_tokens_sink_rate", "llama4_query_temperature",
    "beam_query_temperature", "detector_decoder_hybrid", "detector_smollm3", "flint_sink_mass",
    "granite_swa_sink_mass",
)
"""Every row the suite produces, in order."""


def run_suite(seed: int = SEED) -> pd.DataFrame:
    """Run every check; one row per known answer with ``passed``.

    Returns:
        DataFrame with the :class:`Row` fields plus ``passed``, in :data:`ROW_NAMES` order.
    """
    rows = []
    with one_thread(), torch.no_grad():
        for check in CHECKS:
            rows += check(seed)
    table = pd.DataFrame([{**asdict(row), "passed": row.passed} for row in rows])
    return table


def report_markdown(table: pd.DataFrame, command: str = "nopelens validate") -> str:
    """``docs/known_answers.md``: the rows, expected against measured, and how each value is derived."""
    shown = table.assign(
        expected=table["expected"].map(lambda v: f"{v:.6g}"),
        measured=table["measured"].map(lambda v: f"{v:.6g}"),
        tolerance=table["tolerance"].map(lambda v: f"{v:.3g}"),
        passed=table["passed"].map({True: "pass", False: "FAIL"}),
    )
    columns = {"name": "row", "model": "model", "quantity": "quantity", "expected": "expected",
               "comparison": "test", "measured": "measured", "tolerance": "tolerance", "passed": "result",
               "derivation": "why"}
    n_failed = int((~table["passed"]).sum())
    verdict = "every row passes" if n_failed == 0 else f"{n_failed} of {len(table)} rows FAIL"
    return "\n".join([
        "# Known answers",
        "",
        "Models where theory fixes the number, built by nopelens and probed with the functions the sweep "
        "uses (`collect`, `probe_absolute_index`, `probe_relative_distance`, `sink_table`, "
        "`attention_variance`). Each expected value is derived in the docstring of its check in "
        "`analyses/validate.py` (`nopelens.analyses.validate`). A row passes when the measured value is "
        "within the tolerance: `==` both ways, `<=` at most expected + tolerance, `>=` at least expected − "
        f"tolerance. L = {LENGTH} positions per sequence, {N_SEQUENCES} sequences per model, float32.",
        "",
        f"Result: {verdict}.",
        "",
        shown[list(columns)].rename(columns=columns).to_markdown(index=False),
        "",
        f"Written by `{command}`.",
        "",
    ])
