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

The checks on nopelens decoders, with :class:`Row`, are in :mod:`nopelens.analyses.validate_decoders`;
those on tiny Hugging Face models (the last three) in :mod:`nopelens.analyses.validate_hf`.
``nopelens validate`` (:mod:`nopelens.analyses.cli.validate`) prints the rows and writes
``docs/known_answers.md``; the tests assert each row.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable

import pandas as pd
import torch

from nopelens.analyses.validate_decoders import (
    CONSTANT_METHODS,
    EXACT,
    LENGTH,
    N_BOOT,
    N_SEQUENCES,
    SEED,
    Row,
    check_alibi,
    check_bos_constant,
    check_circuit,
    check_constant,
    check_learned,
    check_repeated_tokens,
    check_rope_constant,
    check_sinks,
    check_sinusoidal,
    check_variance,
    sink_model,
)
from nopelens.analyses.validate_hf import (
    TINY_SPECIAL,
    _hf_model,
    check_detector,
    check_learned_sinks,
    check_query_temperatures,
)
from nopelens.models.threads import one_thread

__all__ = [  # the checks and their constants live in validate_decoders and validate_hf; they stay importable here
    "CHECKS",
    "CONSTANT_METHODS",
    "EXACT",
    "LENGTH",
    "N_BOOT",
    "N_SEQUENCES",
    "ROW_NAMES",
    "SEED",
    "TINY_SPECIAL",
    "Row",
    "_hf_model",
    "check_alibi",
    "check_bos_constant",
    "check_circuit",
    "check_constant",
    "check_detector",
    "check_learned",
    "check_learned_sinks",
    "check_query_temperatures",
    "check_repeated_tokens",
    "check_rope_constant",
    "check_sinks",
    "check_sinusoidal",
    "check_variance",
    "report_markdown",
    "run_suite",
    "sink_model",
]


CHECKS: tuple[Callable[[int], list[Row]], ...] = (
    check_learned,
    check_sinusoidal,
    check_constant,
    check_bos_constant,
    check_circuit,
    check_alibi,
    check_rope_constant,
    check_sinks,
    check_variance,
    check_repeated_tokens,
    check_query_temperatures,
    check_detector,
    check_learned_sinks,
)

ROW_NAMES = (
    "learned_layer0_accuracy",
    "sinusoidal_layer0_r2",
    *(f"constant_{name}_{what}" for name in CONSTANT_METHODS for what in ("max_r2", "max_accuracy")),
    "bos_constant_layer0_r2",
    "bos_constant_layer0_accuracy",
    "bos_constant_layer0_mad",
    "mean_predictor_mad_over_chance",
    "circuit_layer0_r2",
    "circuit_layer0_accuracy",
    "circuit_layer1_r2",
    "circuit_layer1_accuracy",
    "circuit_block0_score_r2",
    "circuit_block1_score_r2",
    "alibi_block0_score_r2",
    "rope_constant_content_qk_r2",
    "sink_all_mass_on_token0",
    "sink_uniform_head",
    "nope_block0_variance_slope",
    "nope_repeated_tokens_uniform",
    "nope_repeated_tokens_sink_rate",
    "llama4_query_temperature",
    "beam_query_temperature",
    "detector_decoder_hybrid",
    "detector_smollm3",
    "flint_sink_mass",
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
    return pd.DataFrame([{**asdict(row), "passed": row.passed} for row in rows])


def report_markdown(table: pd.DataFrame, command: str = "nopelens validate") -> str:
    """``docs/known_answers.md``: the rows, expected against measured, and how each value is derived."""
    shown = table.assign(
        expected=table["expected"].map(lambda v: f"{v:.6g}"),
        measured=table["measured"].map(lambda v: f"{v:.6g}"),
        tolerance=table["tolerance"].map(lambda v: f"{v:.3g}"),
        passed=table["passed"].map({True: "pass", False: "FAIL"}),
    )
    columns = {
        "name": "row",
        "model": "model",
        "quantity": "quantity",
        "expected": "expected",
        "comparison": "test",
        "measured": "measured",
        "tolerance": "tolerance",
        "passed": "result",
        "derivation": "why",
    }
    n_failed = int((~table["passed"]).sum())
    verdict = "every row passes" if n_failed == 0 else f"{n_failed} of {len(table)} rows FAIL"
    return "\n".join(
        [
            "# Known answers",
            "",
            "Models where theory fixes the number, built by nopelens and probed with the functions the sweep "
            "uses (`collect`, `probe_absolute_index`, `probe_relative_distance`, `sink_table`, "
            "`attention_variance`). Each expected value is derived in the docstring of its check in "
            "`analyses/validate_decoders.py` or `analyses/validate_hf.py` (run by `nopelens.analyses.validate`). "
            "A row passes when the measured value is within the tolerance: `==` both ways, `<=` at most expected + "
            "tolerance, `>=` at least expected − "
            f"tolerance. L = {LENGTH} positions per sequence, {N_SEQUENCES} sequences per model, float32.",
            "",
            f"Result: {verdict}.",
            "",
            shown[list(columns)].rename(columns=columns).to_markdown(index=False),
            "",
            f"Written by `{command}`.",
            "",
        ]
    )
