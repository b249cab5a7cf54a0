"""The known-answer rows on nopelens decoders (untrained, constant input or hand-set), and the
:class:`Row` every check of the suite returns.

Each check measures with the sweep's own functions and derives its expected value in its docstring;
:mod:`nopelens.analyses.validate` runs them with those of :mod:`nopelens.analyses.validate_hf`.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pandas as pd
import torch

from nopelens.circuits import distance
from nopelens.circuits.layout import BOS_TOKEN
from nopelens.models import Decoder, DecoderConfig
from nopelens.models.hooks import act_names
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


def random_tokens(n: int, length: int, low: int, high: int, seed: int) -> torch.Tensor:
    """``[n, length]`` token ids drawn uniformly from ``[low, high)`` with a generator seeded ``seed``."""
    return torch.randint(low, high, (n, length), generator=torch.Generator().manual_seed(seed))


def _linear(table: pd.DataFrame, metric: str, task: str = "regression", **where) -> pd.Series:
    """Values of the linear grouped probe for ``metric``, indexed by layer."""
    rows = table[
        (table["probe"] == "linear")
        & (table["split"] == "grouped")
        & (table["metric"] == metric)
        & (table["task"] == task)
    ]
    for column, value in where.items():
        rows = rows[rows[column] == value]
    return rows.set_index("layer")["value"]


def _absolute(model, tokens, layers, tasks=("classification", "regression"), controls=False, seed=SEED):
    acts = collect(model, tokens, [resid_site(layer) for layer in layers])
    return probe_absolute_index(acts, tasks=tasks, controls=controls, n_boot=N_BOOT, seed=seed)


def small_decoder(seed: int = SEED, **config) -> Decoder:
    """An untrained :class:`Decoder` in eval mode: 1 layer, d_model 32, 4 heads, n_ctx :data:`LENGTH`,
    d_vocab 16, each overridden by ``config``."""
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
    model = small_decoder(seed, d_vocab=8, position="learned")
    table = _absolute(model, random_tokens(N_SEQUENCES, LENGTH, 0, 8, seed), [0], tasks=("classification",))
    return [
        Row(
            "learned_layer0_accuracy",
            "untrained learned APE (d_vocab 8, d_model 32)",
            "layer 0 absolute index, classification accuracy",
            1.0,
            _linear(table, "accuracy", "classification")[0],
            "==",
            0.0,
            "position rows independent of token directions (L + d_vocab - 1 <= d_model)",
        )
    ]


def check_sinusoidal(seed: int = SEED) -> list[Row]:
    """Untrained sinusoidal positions: layer 0 reads the index with R² 1.

    Layer 0 is W_E[t] + PE[p] with PE the exact Vaswani table (d_model 32, L = 16). The table has
    rank L - 1 after centering, so p is an exact linear function of PE[p]; with d_vocab = 8 the
    token directions leave room for such a function orthogonal to them (as for learned rows), so the
    linear read is exact and R² = 1, up to the ridge penalty (:data:`EXACT`).
    """
    model = small_decoder(seed, d_vocab=8, position="sinusoidal")
    table = _absolute(model, random_tokens(N_SEQUENCES, LENGTH, 0, 8, seed), [0], tasks=("regression",))
    return [
        Row(
            "sinusoidal_layer0_r2",
            "untrained sinusoidal (d_vocab 8, d_model 32)",
            "layer 0 absolute index, regression R²",
            1.0,
            _linear(table, "r2")[0],
            "==",
            EXACT,
            "p is linear in the exact table PE[p] (rank L - 1 after centering)",
        )
    ]


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
        model = small_decoder(seed, n_layers=2, position=position)
        table = _absolute(model, tokens, [0, 1, 2])
        label = f"untrained {name if name != 'hybrid' else 'RoPE+NoPE hybrid'}, constant input, no BOS, float32"
        rows.append(
            Row(
                f"constant_{name}_max_r2",
                label,
                "largest regression R² over layers 0-2",
                0.0,
                float(_linear(table, "r2").max()),
                "==",
                1e-6,
                "one state at every position: nothing to read",
            )
        )
        rows.append(
            Row(
                f"constant_{name}_max_accuracy",
                label,
                "largest classification accuracy over layers 0-2",
                1 / LENGTH,
                float(_linear(table, "accuracy", "classification").max()),
                "==",
                1e-9,
                "one class predicted for L equally frequent positions",
            )
        )
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
    model = small_decoder(seed, d_vocab=8, position="nope")
    tokens = torch.full((N_SEQUENCES, LENGTH), 3, dtype=torch.long)
    tokens[:, 0] = 0  # BOS
    table = _absolute(model, tokens, [0], controls=True)
    label = "untrained NoPE, BOS + constant content"
    L = LENGTH
    majority = table[(table["probe"] == "majority") & (table["task"] == "regression") & (table["metric"] == "mad")]
    return [
        Row(
            "bos_constant_layer0_r2",
            label,
            "layer 0 regression R²",
            3 / (L + 1),
            _linear(table, "r2")[0],
            "==",
            EXACT,
            "R² = 3/(L + 1): only position 0 is told apart",
        ),
        Row(
            "bos_constant_layer0_accuracy",
            label,
            "layer 0 classification accuracy",
            2 / L,
            _linear(table, "accuracy", "classification")[0],
            "==",
            1e-9,
            "accuracy = 2/L",
        ),
        Row(
            "bos_constant_layer0_mad",
            label,
            "layer 0 regression MAD (positions)",
            (L - 2) / 4,
            _linear(table, "mad")[0],
            "==",
            EXACT * L,
            "MAD = (L - 2)/4 for even L",
        ),
        Row(
            "mean_predictor_mad_over_chance",
            "a mean predictor (the sweep's majority row)",
            "MAD / chance MAD",
            3 * L**2 / (4 * (L**2 - 1)),
            float(majority["value"].iloc[0]) / float(majority["chance"].iloc[0]),
            "==",
            1e-9,
            "MAD = L/4 over (L² - 1)/(3L) = 3L²/(4(L² - 1))",
        ),
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
    tokens = random_tokens(N_SEQUENCES, LENGTH, 1, model.cfg.d_vocab, seed)
    tokens[:, 0] = BOS_TOKEN
    scores = ["blocks.0.attn.hook_attn_scores", "blocks.1.attn.hook_attn_scores"]
    acts = collect(model, tokens, [resid_site(0), resid_site(1)] + scores)
    absolute = probe_absolute_index(acts, controls=False, n_boot=N_BOOT, seed=seed)
    relative = probe_relative_distance(
        acts, sites=[], scores=scores, tasks=("regression",), controls=False, n_boot=N_BOOT, seed=seed
    )
    r2, accuracy = _linear(absolute, "r2"), _linear(absolute, "accuracy", "classification")
    score_r2 = _linear(relative, "r2", features="score")
    label = "Theorem 1/2 circuit (hand-set NoPE, BOS)"
    L = LENGTH
    return [
        Row("circuit_layer0_r2", label, "layer 0 regression R²", 3 / (L + 1), r2[0], "<=", 0.05, "BOS flag only"),
        Row(
            "circuit_layer0_accuracy",
            label,
            "layer 0 classification accuracy",
            2 / L,
            accuracy[0],
            "<=",
            0.05,
            "BOS flag only",
        ),
        Row(
            "circuit_layer1_r2", label, "layer 1 regression R²", 1.0, r2[1], "==", EXACT, "Theorem 1: i written exactly"
        ),
        Row(
            "circuit_layer1_accuracy",
            label,
            "layer 1 classification accuracy",
            1.0,
            accuracy[1],
            "==",
            0.0,
            "Theorem 1: i written exactly",
        ),
        Row(
            "circuit_block0_score_r2",
            label,
            "block 0 score read R² (layer 1)",
            0.0,
            score_r2[1],
            "<=",
            0.01,
            "W_Q = 0: every score 0",
        ),
        Row(
            "circuit_block1_score_r2",
            label,
            "block 1 score read R² (layer 2)",
            1.0,
            score_r2[2],
            "==",
            EXACT,
            "Theorem 2: score = -m (i - j)",
        ),
    ]


def check_alibi(seed: int = SEED) -> list[Row]:
    """Untrained ALiBi: block 0's scores read i - j with R² 1.

    The score is q_i.k_j / sqrt(d_head) - m_h (i - j). At init (std 0.02) the content term is of
    order 1e-3, against a bias of m_h (i - j) up to 0.25 * 15 for the steepest of 4 heads, so the
    scores are linear in i - j up to that noise: R² >= 0.99 (tolerance 0.01).
    """
    model = small_decoder(seed, d_vocab=50, position="alibi")
    acts = collect(model, random_tokens(N_SEQUENCES, LENGTH, 0, 50, seed), ["blocks.0.attn.hook_attn_scores"])
    table = probe_relative_distance(
        acts, sites=[], scores=list(acts.patterns), tasks=("regression",), controls=False, n_boot=N_BOOT, seed=seed
    )
    return [
        Row(
            "alibi_block0_score_r2",
            "untrained ALiBi (d_model 32, 4 heads), random tokens",
            "block 0 score read R² (layer 1)",
            1.0,
            _linear(table, "r2", features="score")[1],
            ">=",
            0.01,
            "score = content (~1e-3) - m_h (i - j)",
        )
    ]


def check_rope_constant(seed: int = SEED) -> list[Row]:
    """RoPE with constant content: the content-only q·k read gives i - j with R² 1.

    With one token, q_i = R_i q and k_j = R_j k. The outer product of the rotated pairs holds
    cos((i - j) theta_r) and sin((i - j) theta_r) for every frequency; the lowest, theta = 10000^(-3/4)
    for d_head 8, keeps (i - j) theta <= 0.015, where sin is linear to 4e-5 relative, so i - j is
    a linear function of the features up to far less than the ridge penalty: R² = 1.
    """
    model = small_decoder(seed, position="rope")
    sites = ("blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k")
    acts = collect(model, torch.full((N_SEQUENCES, LENGTH), 3, dtype=torch.long), list(sites))
    table = probe_relative_distance(
        acts, sites=[], attention=[sites], tasks=("regression",), controls=False, n_boot=N_BOOT, seed=seed
    )
    return [
        Row(
            "rope_constant_content_qk_r2",
            "untrained RoPE, constant content",
            "block 0 content-only q·k read R² (layer 1)",
            1.0,
            _linear(table, "r2", features="bilinear_outer")[1],
            "==",
            EXACT,
            "rotated q_i k_j holds sin/cos of (i - j) theta",
        )
    ]


def sink_model():
    """A hand-set one-layer NoPE decoder: head 0 puts all its mass on token 0 (BOS), head 1 is uniform.

    Embedding: dim 0 is 1 for BOS (token 0), dim 1 for every other token. Head 0's query is the
    constant b_Q = (200, 0) and its key reads dim 0, so its score is 200/sqrt(2) for BOS and 0
    otherwise: e^-141 underflows in float32 and the whole mass lands on token 0. Head 1 has zero
    weights: every score 0, uniform attention.
    """
    cfg = DecoderConfig(
        d_vocab=4, n_ctx=LENGTH, n_layers=1, d_model=4, n_heads=2, d_mlp=0, normalization="none", position="nope"
    )
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
    tokens = random_tokens(N_SEQUENCES, LENGTH, 1, 4, seed)
    tokens[:, 0] = 0
    acts = collect(sink_model(), tokens, ["blocks.0.attn.hook_pattern"])
    scores = sink_table(acts, n_tokens=LENGTH).set_index("head")["sink_score"]
    harmonic = float(sum(Fraction(1, i) for i in range(1, LENGTH + 1)) / LENGTH)
    label = "hand-set one-layer NoPE, 2 heads"
    return [
        Row(
            "sink_all_mass_on_token0",
            label,
            f"sink score of head 0 (T = {LENGTH})",
            1.0,
            scores[0],
            "==",
            1e-6,
            "every query puts weight 1 on token 0",
        ),
        Row(
            "sink_uniform_head",
            label,
            f"sink score of head 1 (T = {LENGTH})",
            harmonic,
            scores[1],
            "==",
            1e-6,
            "uniform: H_T / T",
        ),
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
    model = small_decoder(seed, d_vocab=64, position="nope")
    acts = collect(model, random_tokens(n_sequences, LENGTH, 0, 64, seed), [site])
    slope = float(variance_slopes(attention_variance(acts))["slope"].iloc[0])
    rng = np.random.default_rng(seed)
    by_sequence = acts.acts[site].reshape(n_sequences, LENGTH, -1)
    boot = []
    for _ in range(n_boot):
        draw = by_sequence[rng.integers(0, n_sequences, n_sequences)]
        resampled = Activations(
            acts={site: draw.reshape(n_sequences * LENGTH, -1)},
            sequence_id=np.repeat(np.arange(n_sequences), LENGTH),
            position=np.tile(np.arange(LENGTH), n_sequences),
            token=np.zeros(n_sequences * LENGTH, dtype=np.int64),
        )
        boot.append(float(variance_slopes(attention_variance(resampled))["slope"].iloc[0]))
    error = float(np.std(boot, ddof=1))
    return [
        Row(
            "nope_block0_variance_slope",
            f"untrained NoPE, {n_sequences} random sequences",
            "log-log slope of block 0 attention-output variance vs position + 1",
            -1.0,
            slope,
            "==",
            3 * error,
            f"Var(z_i) = Var(v)/(i + 1); tolerance 3 bootstrap SE (SE {error:.3f})",
        )
    ]


def check_repeated_tokens(seed: int = SEED) -> list[Row]:
    """NoPE on one repeated token: every key is the same vector, so every score of a row is equal
    and the attention is exactly uniform, 1/(i + 1) (Gu et al. 2025, "When attention sink emerges",
    Prop. 1); Gu's score of token 0 is then H_T/T = 0.211 for T = 16 < 0.3, so the sink rate is 0.
    Measured on a 2-layer random NoPE Decoder (every layer sees equal inputs, so both are uniform).
    """
    model = small_decoder(seed, n_layers=2, position="nope", init_std=0.3)
    tokens = torch.full((4, LENGTH), 5, dtype=torch.long)
    sites = act_names("pattern", 2)
    acts = collect(model, tokens, sites)
    uniform = np.tril(np.ones((LENGTH, LENGTH))) / np.arange(1, LENGTH + 1)[:, None]
    deviation = max(float(np.abs(p - uniform[None]).max()) for site in sites for p in acts.patterns[site])
    rate = sink_rate(sink_table(acts, n_tokens=LENGTH))
    label = "random 2-layer NoPE, one repeated token, no BOS"
    return [
        Row(
            "nope_repeated_tokens_uniform",
            label,
            "max |pattern - 1/(i + 1)| at allowed keys",
            0.0,
            deviation,
            "==",
            1e-6,
            "equal keys give equal scores: uniform attention (Gu et al. Prop. 1)",
        ),
        Row(
            "nope_repeated_tokens_sink_rate",
            label,
            "Gu sink rate (eps 0.3)",
            0.0,
            rate,
            "==",
            0.0,
            f"uniform gives token 0 the score H_T/T = {float(uniform[:, 0].mean()):.3f} < 0.3",
        ),
    ]
