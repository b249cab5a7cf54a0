"""Extreme-token measurements (Guo et al. 2024) on hand-set patterns and states with known answers,
and the `nopelens extreme-tokens` command."""

import numpy as np
import pytest

from nopelens.analyses.cli import main
from nopelens.probes.collect import Activations
from nopelens.probes.extreme_tokens import FIRST_QUERY, active_dormant_table, first_token_norms, ratio_ci

pytestmark = pytest.mark.usefixtures("one_thread")
N = 12


def active_dormant_pattern(trigger: np.ndarray, sink: float = 0.9) -> np.ndarray:
    """Head 0: on a trigger query all attention on the previous key; elsewhere ``sink`` on key 0 and the
    rest spread over the other visible keys. Head 1: uniform causal attention."""
    p = np.zeros((2, N, N))
    p[1] = np.tril(np.ones((N, N))) / np.arange(1, N + 1)[:, None]
    p[0, 0, 0] = 1.0
    for i in range(1, N):
        if trigger[i]:
            p[0, i, i - 1] = 1.0
        else:
            p[0, i, 0] = sink
            p[0, i, 1 : i + 1] = (1 - sink) / i
    return p


@pytest.fixture
def hand_set():
    rng = np.random.default_rng(0)
    flags = [rng.random(N) < 0.3 for _ in range(6)]
    for f in flags:
        f[:2] = False
        f[5] = True  # every sequence has a trigger query
    patterns = [active_dormant_pattern(f) for f in flags]
    acts = Activations({}, np.zeros(0), np.zeros(0), np.zeros(0), patterns={"blocks.0.attn.hook_pattern": patterns})
    return acts, flags


def test_an_active_dormant_head_reads_as_one_and_uniform_attention_as_neither(hand_set):
    acts, flags = hand_set
    table = active_dormant_table(acts, flags, n_boot=50).set_index(["head", "query_class"])
    head0_trigger, head0_other = table.loc[(0, "trigger")], table.loc[(0, "non_trigger")]
    assert head0_trigger["previous_mass"] == pytest.approx(1.0) and head0_trigger["first_mass"] == pytest.approx(0.0)
    assert head0_other["first_mass"] == pytest.approx(0.9) and head0_trigger["active"] and head0_other["dormant"]
    assert not head0_other["active"] and not head0_trigger["dormant"]
    # uniform attention: 1 / (i + 1) on key 0 and on key i - 1, averaged over the class's queries (i >= 2)
    expected = {
        name: np.mean([1 / (i + 1) for f in flags for i in range(FIRST_QUERY, N) if f[i] == flag])
        for name, flag in (("trigger", True), ("non_trigger", False))
    }
    for name, value in expected.items():
        row = table.loc[(1, name)]
        assert row["first_mass"] == pytest.approx(value) == pytest.approx(row["previous_mass"])
        assert not row["dormant"] and not row["active"]
        assert row["first_mass_ci_low"] <= row["first_mass"] <= row["first_mass_ci_high"]


def test_query_flags_must_match_the_patterns(hand_set):
    acts, flags = hand_set
    with pytest.raises(ValueError, match="query-class arrays"):
        active_dormant_table(acts, flags[:-1])
    with pytest.raises(ValueError, match="query flags"):
        active_dormant_table(acts, [f[:-1] for f in flags])


def test_first_token_norms_find_a_drain_and_a_peak():
    position = np.tile(np.arange(5), 4)
    value = np.ones((20, 2, 3))
    value[position == 0, 0] *= 0.1  # head 0's first value is a tenth of the others: a drain
    resid = np.ones((20, 4))
    resid[position == 0] *= 10.0  # the first residual state is ten times the others: a peak
    acts = Activations(
        {"blocks.0.attn.hook_v": value, "blocks.0.hook_resid_post": resid},
        np.repeat(np.arange(4), 5),
        position,
        np.zeros(20, dtype=int),
    )
    table = first_token_norms(acts, ["blocks.0.attn.hook_v", "blocks.0.hook_resid_post"])
    assert table["ratio"].round(6).tolist() == [0.1, 1.0, 10.0]
    assert table["head"].tolist() == [0, 1, -1] and table["layer"].iloc[-1] == 1
    with pytest.raises(KeyError, match="not collected"):
        first_token_norms(acts, ["blocks.1.attn.hook_v"])


def test_ratio_ci():
    value, low, high = ratio_ci(np.array([1.0, 2.0, 3.0, 4.0]), np.array([2.0, 2.0, 2.0, 2.0]), n_boot=100)
    assert value == 1.25 and low < value < high
    with pytest.raises(ValueError, match="no query"):
        ratio_ci(np.zeros(3), np.zeros(3))


def test_cli_on_a_quick_backcopy_model_and_a_text_model(tmp_path, capsys):
    assert (
        main(
            [
                "extreme-tokens",
                "bb-rope-2l",
                "--quick",
                "--n-sequences",
                "8",
                "--n-boot",
                "10",
                "--out",
                str(tmp_path / "bb"),
                "--quiet",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "non_trigger" in out and "remove_key, block 1" in out and "floor" in out
    assert "NaN" not in out and "n/a" in out  # the floor is a loss only: its accuracy reads n/a
    assert all((tmp_path / "bb" / f"{name}.csv").is_file() for name in ("heads", "norms", "ablation"))
    assert (
        main(
            [
                "extreme-tokens",
                "circuit",
                "--n-sequences",
                "8",
                "--n-boot",
                "10",
                "--out",
                str(tmp_path / "c"),
                "--quiet",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert " all " in out and "NaN" not in out
    assert "ratio n/a at blocks.0.attn.hook_v" in out  # the circuit's other values are all zero


def test_the_command_refuses_options_it_would_ignore_or_misread(tmp_path, capsys):
    from nopelens.analyses.cli import main
    from nopelens.analyses.runs import claim

    for option, value, message in (
        ("--n-boot", "-1", "--n-boot must be a positive integer"),
        ("--seq-len", "1000", "--seq-len does not apply: bb-rope-2l is a bigram_backcopy"),
    ):
        assert main(["extreme-tokens", "bb-rope-2l", "--quick", option, value, "--out", str(tmp_path / "e")]) == 2
        assert message in capsys.readouterr().err
    claim(tmp_path / "run", "lengthgen", {"steps": 1})
    assert main(["extreme-tokens", "bb-rope-2l", "--quick", "--out", str(tmp_path / "run")]) == 2
    assert "holds a run of nopelens lengthgen" in capsys.readouterr().err
    assert not (tmp_path / "run" / "heads.csv").exists()


def _saved(tmp_path, family: str, **edits) -> str:
    """A tiny HF model of ``family`` (tests/hf_families.py) saved to ``tmp_path``, ``edits`` written
    into its config.json."""
    import json

    from hf_families import DESIGNS, build, build_design

    folder = tmp_path / family
    (build_design(family) if family in DESIGNS else build(family)).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edits}))
    return str(folder)


def _extreme_tokens(folder: str, capsys) -> str:
    capsys.readouterr()
    assert (
        main(
            [
                "extreme-tokens",
                f"hf:{folder}",
                "--seq-len",
                "8",
                "--n-sequences",
                "2",
                "--n-boot",
                "2",
                "--out",
                f"{folder}-out",
                "--quiet",
            ]
        )
        == 0
    )
    return capsys.readouterr().out


def test_a_hybrid_is_measured_on_its_attention_blocks_and_mla_values_per_head(tmp_path, capsys):
    """Zamba2's blocks 0 and 2 are Mamba (was: "unknown sites ['blocks.0.attn.hook_pattern', ...]"); the bridge hands
    DeepSeek-V3's MLA values [batch, head, pos, d_head] (was: "collect needs [batch, pos, ...]")."""
    import pandas as pd

    out = _extreme_tokens(_saved(tmp_path, "zamba2"), capsys)
    assert "not applicable: attention (hook_pattern) on blocks [0, 2]: ssm (no attention)" in out
    heads = pd.read_csv(tmp_path / "zamba2-out" / "heads.csv")
    assert sorted(set(heads[heads["status"] == "measured"]["block"])) == [1, 3]
    out = _extreme_tokens(_saved(tmp_path, "deepseek_v3"), capsys)
    norms = pd.read_csv(tmp_path / "deepseek_v3-out" / "norms.csv")
    values = norms[norms["site"] == "blocks.0.attn.hook_v"]
    assert list(values["head"]) == [0, 1, 2, 3] and values["first_norm"].gt(0).all()  # one row per head of 4
    assert "not applicable: attention" not in out and "not applicable: value" not in out


def test_a_run_without_bos_does_not_call_its_first_token_bos(tmp_path, capsys):
    """A config and generation config without bos_token_id: random tokens with no BOS first (was labelled "(BOS)")."""
    folder = _saved(tmp_path, "llama", bos_token_id=None)
    (tmp_path / "llama" / "generation_config.json").unlink()
    out = _extreme_tokens(folder, capsys)
    assert "the first token (no BOS: the sequences start with an ordinary token)" in out and "(BOS)" not in out
