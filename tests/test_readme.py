"""The README's promises: at most 300 lines, exactly two set-up commands (the second is what CI
runs), a test section naming the full run and the fast lane, and the three uses' examples run and
print what the README says. The docs/ pages are checked in tests/test_docs.py."""

import re

from docs_pages import ROOT, block_after, blocks, broken_links, text

README = text("README.md")


def run_python(code: str) -> None:
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})


def test_readme_is_at_most_300_lines_and_its_links_resolve():
    assert len(README.splitlines()) <= 300
    assert broken_links("README.md") == []


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"^pip install torch==2\.13\.0 .*$", README, re.M)
    assert len(commands) == 2, "exactly two set-up commands"
    assert commands[0] == "pip install torch==2.13.0 && pip install . && nopelens sweep"
    assert commands[1] == 'pip install torch==2.13.0 && pip install ".[test]" && python -m pytest -n 2 --dist loadfile'
    assert commands[1] in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_the_test_section_names_the_full_run_and_the_fast_lane():
    shell = "\n".join(blocks("README.md", "bash"))
    assert re.search(r"^python -m pytest -m \"not slow\" .*about 3 minutes", shell, re.M)
    section = README[README.index("**Tests.**") : README.index("## What the sweep finds")]
    assert "`python -m pytest` runs everything" in section and "CI" in section
    markers = re.search(r"^markers = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    assert markers and '"slow:' in markers.group(1), "the marker the fast lane deselects is registered"


def test_use_1_probes_the_shipped_nope_model(capsys):
    code = block_after("README.md", "### 1. Probe decoders built here")
    assert len(code.strip().splitlines()) <= 10
    run_python(code)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["layer", "value", "ci_low", "ci_high"]
    r2 = {int(line.split()[0]): float(line.split()[1]) for line in lines[1:]}
    assert sorted(r2) == [0, 1, 2, 3, 4]
    assert r2[0] < 0.1 and r2[1] > 0.9  # as the README says: about 0.03, then 0.95 after block 0


def test_use_2_circuit_checks_are_exact(capsys):
    code = block_after("README.md", "### 2. Circuits with known answers")
    assert len(code.strip().splitlines()) <= 6
    run_python(code)
    assert capsys.readouterr().out.split() == ["0.0", "0.0"]


def test_use_3_hf_example_prints_a_per_layer_probe_curve(capsys):
    code = block_after("README.md", "### 3. Hook models built elsewhere")
    assert len(code.strip().splitlines()) <= 15
    run_python(code)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["layer", "value", "ci_low", "ci_high", "selectivity"]
    layers = [float(line.split()[0]) for line in lines[1:]]
    assert layers == [0.0, 1.0, 2.0]
