"""The README's promises: its Python example runs, and CI runs its test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def python_block(after_heading: str) -> str:
    section = README[README.index(after_heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_hf_example_prints_a_per_layer_probe_curve(capsys):
    code = python_block("## Hook a model nopelens did not build")
    assert len(code.strip().splitlines()) <= 15
    exec(compile(code, "README.md", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["layer", "value", "ci_low", "ci_high", "selectivity"]
    layers = [float(line.split()[0]) for line in lines[1:]]
    assert layers == [0.0, 1.0, 2.0]


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"^pip install torch==2\.13\.0 .*$", README, re.M)
    assert len(commands) == 2, "exactly two set-up commands"
    assert "nopelens sweep" in commands[0]
    assert commands[1] in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_decoder_example_runs(capsys):
    exec(compile(python_block("## The decoder"), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "torch.Size([2, 16, 4, 32])"


def test_streamed_probe_example_runs_at_512_tokens(capsys):
    code = python_block("### Probe in bounded memory")
    assert len(code.strip().splitlines()) <= 16
    exec(compile(code, "README.md", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["target", "metric", "value"]
    assert {line.split()[0] for line in lines[1:]} == {"absolute_index//8", "absolute_index"}
