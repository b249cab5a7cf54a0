"""The package's layout holds: hook names come from one helper, imports flow one way
(cli -> analyses -> probes -> models), and no module needs another to be imported first."""

import re
from pathlib import Path

import pytest

from nopelens.models import hooks

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("models", "circuits", "probes", "analyses", "examples", "benchmarks", "src")

HAND_WRITTEN_HOOK = re.compile(r"""f["']blocks\.|["']blocks\.["']\s*\+""")


def source_files():
    for folder in SOURCE_FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_hook_names_are_built_by_the_helper_only():
    """No ``f"blocks.{l}...."`` outside :mod:`nopelens.models.hooks`."""
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in source_files() if path != ROOT / "models" / "hooks.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if HAND_WRITTEN_HOOK.search(line)]
    assert not found, "build hook names with nopelens.models.hooks.act_name:\n" + "\n".join(found)


def test_act_name_gives_transformer_lens_names_and_refuses_unknown_ones():
    assert hooks.act_name("resid_pre", 0) == "blocks.0.hook_resid_pre"
    assert hooks.act_name("hook_rot_k", 3) == "blocks.3.attn.hook_rot_k"
    assert hooks.act_name("post", 1) == "blocks.1.mlp.hook_post"
    import numpy as np

    assert hooks.act_name("pattern", np.int64(2)) == "blocks.2.attn.hook_pattern"
    with pytest.raises(ValueError, match="unknown hook 'resid_pst'.*resid_post"):
        hooks.act_name("resid_pst", 0)
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="block index"):
            hooks.act_name("pattern", bad)


def test_act_name_knows_every_hook_a_decoder_has():
    from nopelens.models import Decoder, DecoderConfig

    cfg = DecoderConfig(d_vocab=8, n_ctx=8, n_layers=2, d_model=16, n_heads=2, position=["alibi", "rope"])
    names = {name for name in Decoder(cfg).hook_dict if name.startswith("blocks.") and ".ln" not in name}
    known = {hooks.act_name(name.rsplit(".", 1)[-1], int(name.split(".")[1])) for name in names}
    assert known == names and "blocks.1.attn.hook_rot_q" in names
