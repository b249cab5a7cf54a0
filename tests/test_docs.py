"""The docs/ pages' promises (issue 39): every page is linked from the README, its links resolve,
every `nopelens` command on it parses with the CLI's own parser, its Python blocks run and print
what the page says, and each page's commands run (on small settings where the page's would take
minutes; the longest are marked slow)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys

import pandas as pd
import pytest
import yaml
from docs_pages import DOCS, ROOT, block_after, blocks, broken_links, commands, text

from nopelens.analyses.cli import build_parser, main
from nopelens.analyses.sweep.parallel import dask_security
from nopelens.models import zoo
from nopelens.models.methods import METHODS

TOPIC_PAGES = (
    "probing.md",
    "circuits.md",
    "hooking.md",
    "audit.md",
    "zoo.md",
    "decoder.md",
    "dask.md",
    "schema.md",
    "results.md",
    "development.md",
)
ALL_PAGES = ["README.md"] + sorted(f"docs/{page.name}" for page in DOCS.glob("*.md"))


def run_python(code: str, where: str) -> None:
    exec(compile(code, where, "exec"), {"__name__": "docs_example"})


def nopelens(argv: list[str], capsys) -> tuple[int, str]:
    """Run one CLI command in this process; its exit code and stdout (stderr stays in ``capsys``)."""
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    sys.stderr.write(captured.err)
    return code, captured.out


def with_option(argv: list, option: str, value) -> list:
    """``argv`` with ``option`` set to ``value`` (replaced where given, else appended)."""
    argv = list(argv)
    if option in argv:
        argv[argv.index(option) + 1] = value
        return argv
    return argv + [option, value]


@contextlib.contextmanager
def working_directory(path):
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


# ---- every page -------------------------------------------------------------------------------


def test_every_topic_page_exists_and_is_linked_from_the_readme():
    readme = text("README.md")
    for page in TOPIC_PAGES:
        assert (DOCS / page).is_file(), page
        assert f"](docs/{page})" in readme, f"README does not link docs/{page}"


def test_the_readme_is_at_most_300_lines():
    assert len(text("README.md").splitlines()) <= 300


@pytest.mark.parametrize("page", ALL_PAGES)
def test_links_resolve(page):
    assert broken_links(page) == [], f"{page}: links to missing files or headings"


@pytest.mark.parametrize("page", [f"docs/{page}" for page in TOPIC_PAGES])
def test_every_command_on_the_page_parses(page, capsys):
    for argv in commands(page):
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page}: `nopelens {' '.join(argv)}` does not parse: {capsys.readouterr().err.strip()}")


def test_the_command_reader_finds_commands_and_rejects_a_stale_flag(capsys):
    assert ["sweep", "--quick"] in commands("docs/probing.md")
    with pytest.raises(SystemExit):
        build_parser(["sweep", "--no-such-flag"]).parse_args(["sweep", "--no-such-flag"])


# ---- probing.md and schema.md: a real run folder ----------------------------------------------


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    """``runs/sweep`` of a small sweep of text-rope-4l (shipped), made by the CLI."""
    root = tmp_path_factory.mktemp("docs_run")
    argv = [
        "sweep",
        "--models",
        "text-rope-4l",
        "--no-controls",
        "--n-sequences",
        "12",
        "--seq-len",
        "16",
        "--no-figures",
        "--quiet",
        "--out",
        str(root / "runs" / "sweep"),
    ]
    assert main(argv) == 0
    return root


@pytest.mark.slow
def test_probing_load_run_example_runs_on_a_run_folder(run_root, capsys):
    code = block_after("docs/probing.md", "## What it prints and writes")
    assert 'load_run("runs/sweep")' in code
    with working_directory(run_root):
        run_python(code + "\nprint(run.curve('absolute_r2', 'text-rope-4l').loc[3]['value'])\n", "probing.md")
    value = float(capsys.readouterr().out.split()[-1])
    assert -1 <= value <= 1


def test_probing_load_run_comment_is_the_shipped_sweeps_number():
    """The example's comment quotes docs/sweep/layers.csv (the default sweep's curves)."""
    code = block_after("docs/probing.md", "## What it prints and writes")
    quoted = re.search(r"# value ([\d.]+), ci_low ([\d.]+), ci_high ([\d.]+)", code).groups()
    layers = pd.read_csv(DOCS / "sweep" / "layers.csv")
    row = layers.query("model == 'text-rope-4l' and curve == 'absolute_r2' and layer == 3").iloc[0]
    assert [f"{row[c]:.2f}" for c in ("value", "ci_low", "ci_high")] == list(quoted)


@pytest.mark.slow
def test_schema_examples_run_on_a_run_folder(run_root, capsys):
    first, second = blocks("docs/schema.md", "python")
    with working_directory(run_root):
        run_python(first, "schema.md")
        printed = capsys.readouterr().out.splitlines()
        assert printed[0].split() == ["layer", "value", "ci_low", "ci_high"] and len(printed) == 1 + 5
        run_python(second + "\nprint(sorted(run.tables))\n", "schema.md")
    tables = capsys.readouterr().out
    assert "'probes'" in tables and "'sinks'" in tables and "'layers'" in tables


def test_probing_streamed_example_runs_at_512_tokens(capsys):
    code = block_after("docs/probing.md", "## Probe in bounded memory")
    assert len(code.strip().splitlines()) <= 16
    run_python(code, "probing.md")
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["target", "metric", "value"]
    assert {line.split()[0] for line in lines[1:]} == {"absolute_index//8", "absolute_index"}


def test_probing_sinks_command_finds_the_active_dormant_sink(capsys):
    assert ["sinks", "bb-rope-2l"] in commands("docs/probing.md")
    code, out = nopelens(["sinks", "bb-rope-2l", "--quiet"], capsys)
    assert code == 0
    with_bos = next(line for line in out.splitlines() if line.startswith("bb-rope-2l, with bos"))
    assert "sink rate 0.500" in with_bos  # block 0 of 2, as docs/results.md says


@pytest.mark.slow
def test_probing_intervene_command_gives_the_circuits_known_answer(tmp_path, capsys):
    assert ["intervene", "circuit"] in commands("docs/probing.md")
    code, _ = nopelens(["intervene", "circuit", "--quiet", "--out", tmp_path], capsys)
    assert code == 0
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert len(summary)


# ---- circuits.md ------------------------------------------------------------------------------


def test_circuits_example_prints_the_exact_checks(capsys):
    run_python(blocks("docs/circuits.md", "python")[0], "circuits.md")
    out = capsys.readouterr().out
    assert "'position_max_error': 0.0" in out and "'no_bos_counter_max_abs': 0.0" in out
    assert "'pattern_max_error': 0.0" in out and "'alibi_head': 4" in out
    assert out.splitlines()[2].split() == [
        "position",
        "counter",
        "expected_counter",
        "position_value",
        "position_error",
    ]


def test_circuits_commands_pass_their_checks(tmp_path, capsys):
    circuit_commands = [argv for argv in commands("docs/circuits.md") if argv[0] == "circuit"]
    assert {argv[1] for argv in circuit_commands} == {
        "counter",
        "distance",
        "previous-token",
        "equivariance",
        "mask-table",
    }
    for argv in circuit_commands:
        argv = with_option(with_option(argv, "--n-ctx", 16), "--out", tmp_path)  # smaller circuits, same checks
        code, out = nopelens(argv, capsys)
        assert code == 0 and "FAIL" not in out, (argv, out)
        assert (tmp_path / f"{argv[1].replace('-', '_')}_checks.csv").is_file()


@pytest.mark.slow
def test_circuits_demo_script_runs(tmp_path):
    line = next(line for line in blocks("docs/circuits.md", "bash")[1].splitlines() if line.startswith("python "))
    argv = line.split()[1:]
    argv[argv.index("--out") + 1] = str(tmp_path)
    subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, capture_output=True)
    assert (tmp_path / "circuit_demo.csv").is_file()


# ---- hooking.md -------------------------------------------------------------------------------


def test_hooking_hf_example_prints_a_per_layer_probe_curve(capsys):
    run_python(block_after("docs/hooking.md", "## An HF model in Python"), "hooking.md")
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["layer", "value", "ci_low", "ci_high", "selectivity"]
    assert [float(line.split()[0]) for line in lines[1:]] == [0.0, 1.0, 2.0]


def test_hooking_any_module_example_collects_every_named_site(capsys):
    run_python(block_after("docs/hooking.md", "## A hand-written map (the fallback)"), "hooking.md")
    printed = capsys.readouterr().out.strip()
    assert printed == str(
        {
            site: (4 * 16, 32)
            for site in ("blocks.0.hook_resid_pre", "blocks.0.hook_resid_post", "blocks.1.hook_resid_post")
        }
    )


def test_hooking_one_call_example_reads_both_blocks_sinks(capsys):
    run_python(block_after("docs/hooking.md", "## Any torch model in one call"), "hooking.md")
    captured = capsys.readouterr()
    masses = eval(captured.out.strip())  # {block: mean sink mass}
    assert sorted(masses) == [0, 1] and all(0 < mass < 1 for mass in masses.values())
    assert "blocks.0.hook_resid_pre <- blocks.0:input" in captured.err


def _session():
    """The `$ command` lines of hooking.md's session and what each printed, in order."""
    session = blocks("docs/hooking.md", "text")[0].splitlines()
    steps, current = [], None
    for line in session:
        if line.startswith("$ "):
            current = [line[2:], []]
            steps.append(current)
        else:
            current[1].append(line)
    return steps


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The small HF model of hooking.md's session, made by its first command."""
    (make, said), *_ = _session()
    out = tmp_path_factory.mktemp("smol") / "smol"
    argv = make.split()
    argv[argv.index("--out") + 1] = str(out)
    done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, check=True, capture_output=True, text=True)
    assert done.stdout.splitlines()[0] == said[0].replace("runs/smol", str(out))
    return out


@pytest.mark.slow
def test_hooking_session_plan_is_what_the_page_shows(smol, capsys):
    _, (plan, said), _ = _session()
    argv = plan.split()[1:]
    argv[1] = f"hf:{smol}"
    assert argv[0] == "probe"
    code, out = nopelens(argv, capsys)
    assert code == 0
    fixed = said[0].split(" in batches")[0]  # the ETA after it is measured here
    assert out.splitlines()[0].split(" in batches")[0] == fixed


@pytest.mark.slow
def test_hooking_session_repeated_input_is_the_known_answer(smol, tmp_path, capsys):
    *_, (repeated, said) = _session()
    argv = repeated.split()[1:]
    argv[1] = f"hf:{smol}"
    argv = with_option(argv, "--out", tmp_path / "repeated")
    code, _ = nopelens(argv, capsys)
    assert code == 0
    err = capsys.readouterr().err
    promised = next(line for line in said if "known answer" in line).split("(sink mass")[0]
    assert promised.replace("nopelens: ", "") in err


# ---- audit.md ---------------------------------------------------------------------------------


def test_audit_example_reads_a_fresh_rope_decoder(capsys):
    run_python(blocks("docs/audit.md", "python")[0], "audit.md")
    out = capsys.readouterr().out
    assert "measured per layer (input held fixed, positions re-spaced): relative, relative" in out
    passed = {int(m) for m in re.findall(r"\[PASS\]\s+(\d+)\.", out)}
    not_applicable = {int(m) for m in re.findall(r"\[n/a \]\s+!?\s*(\d+)\.", out)}
    assert passed == {1, 2, 3, 5, 6, 7, 8, 9} and not_applicable == {4, 10}  # as the page says


def test_audit_command_on_a_fresh_decoder_passes(tmp_path, capsys):
    assert ["audit", "--position", "rope", "--out", "runs/audit-rope"] in commands("docs/audit.md")
    code, out = nopelens(["audit", "--position", "rope", "--out", tmp_path], capsys)
    assert code == 0 and "no step failed" in out


@pytest.mark.slow
def test_audit_of_a_checkpoint_just_trained(tmp_path, capsys):
    train = next(argv for argv in commands("docs/audit.md") if argv[0] == "train")
    train = with_option(with_option(train, "--steps", 30), "--out", tmp_path / "copy-rope") + ["--quiet"]
    assert nopelens(train, capsys)[0] == 0
    code, out = nopelens(["audit", "--checkpoint", tmp_path / "copy-rope"], capsys)
    assert code == 0 and "no step failed" in out


# ---- zoo.md -----------------------------------------------------------------------------------


def test_zoo_example_loads_the_shipped_model(capsys):
    run_python(blocks("docs/zoo.md", "python")[0], "zoo.md")
    shape, names = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"torch\.Size\(\[1, \d+, 128\]\)", shape)
    table = [row.split("|")[1].strip(" `") for row in text("docs/zoo.md").splitlines() if row.startswith("| `")]
    assert set(table) == set(zoo.names()), "the page's model table is the zoo"
    assert names == str(zoo.names())


def test_zoo_list_and_a_short_training_run(tmp_path, capsys):
    assert ["train", "--list"] in commands("docs/zoo.md")
    code, listed = nopelens(["train", "--list"], capsys)
    assert code == 0 and "text-nope-4l" in listed
    train = next(argv for argv in commands("docs/zoo.md") if argv[:2] == ["train", "--task"])
    train = with_option(with_option(train, "--steps", 20), "--out", tmp_path) + ["--quiet"]
    assert nopelens(train, capsys)[0] == 0
    assert (tmp_path / "loss_curve.csv").is_file()


@pytest.mark.slow
def test_zoo_lengthgen_smoke_test(tmp_path, capsys):
    argv = next(argv for argv in commands("docs/zoo.md") if argv[0] == "lengthgen")
    argv = with_option(argv, "--out", tmp_path) + ["--methods", "nope", "--tasks", "repeat", "--seeds", "0", "--quiet"]
    assert nopelens(argv, capsys)[0] == 0
    table = pd.read_csv(tmp_path / "lengthgen.csv")
    assert set(table["method"]) == {"nope"} and set(table["task"]) == {"repeat"}


# ---- decoder.md -------------------------------------------------------------------------------


def test_decoder_example_runs(capsys):
    run_python(blocks("docs/decoder.md", "python")[0], "decoder.md")
    assert capsys.readouterr().out.strip() == "torch.Size([2, 16, 4, 32])"


def test_decoder_methods_table_is_the_registry_and_demo_builds_each(capsys):
    page = text("docs/decoder.md")
    table = page[page.index("| method | `position` |") :]
    listed = re.findall(r"^\| [^|]+ \| `(\w+)` \|", table, re.M)[1:]  # after the header row
    assert set(listed) == set(METHODS)
    code, out = nopelens(["demo"], capsys)
    assert code == 0
    assert {line.split(":")[0].strip() for line in out.splitlines() if "hooks, logits" in line} == set(METHODS)


# ---- dask.md ----------------------------------------------------------------------------------


def test_dask_certificates_and_security_file_work(tmp_path):
    """The page's openssl lines make a CA and a certificate; its YAML, pointed at them, is what
    --dask-security reads (distributed's own configuration format)."""
    openssl = [line for line in blocks("docs/dask.md", "bash")[0].splitlines() if line.startswith("openssl ")]
    assert len(openssl) == 3
    for line in openssl:
        subprocess.run(line, shell=True, cwd=tmp_path, check=True, capture_output=True)
    config = blocks("docs/dask.md", "yaml")[0].replace("/home/me/tls/", f"{tmp_path}/")
    (tmp_path / "dask-tls.yaml").write_text(config)
    assert yaml.safe_load(config)["distributed"]["comm"]["require-encryption"] is True
    security = dask_security(tmp_path / "dask-tls.yaml")
    assert security.require_encryption and security.tls_ca_file == str(tmp_path / "ca.pem")
    assert security.tls_client_cert == str(tmp_path / "node.pem")


# ---- results.md and the README: the default sweep's tables -------------------------------------


def _markdown_tables(page: str, heading: str) -> list[pd.DataFrame]:
    """The tables of one section of ``page``: from ``heading`` to the next heading of its level."""
    section = text(page).split(heading + "\n", 1)[1].split("\n" + heading.split()[0] + " ", 1)[0]
    found, rows = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            if len(rows) > 2:
                found.append(pd.DataFrame(rows[2:], columns=rows[0]))
            rows = []
    return found


FIRST_LAYER = {
    "abs. index acc ≥ 0.9": "absolute_acc",
    "abs. index R² ≥ 0.9": "absolute_r2",
    "rel. dist. pairs R² ≥ 0.9": "relative_pairs_r2",
    "rel. dist. head scores R² ≥ 0.9": "relative_score_r2",
    "rel. dist. content q·k R² ≥ 0.9": "relative_content_qk_r2",
}


@pytest.mark.parametrize(
    "page, heading", [("README.md", "## What the sweep finds"), ("docs/results.md", "## The default sweep")]
)
def test_the_default_sweep_tables_are_docs_sweep_summary(page, heading):
    summary = pd.read_csv(DOCS / "sweep" / "summary.csv").set_index("model")
    checked = 0
    for table in _markdown_tables(page, heading):
        if "model" not in table.columns or not set(table["model"]) <= set(summary.index):
            continue
        for column in table.columns:
            if column in FIRST_LAYER:
                expected = summary[FIRST_LAYER[column]].map(lambda layer: "none" if layer == -1 else str(layer))
                assert table.set_index("model")[column].to_dict() == expected[table["model"]].to_dict(), column
                checked += 1
            elif column == "sink rate":
                shown = table.set_index("model")[column].astype(float)
                assert (shown - summary.loc[shown.index, "sink_rate"]).abs().max() < 5e-4
                checked += 1
            elif column == "best abs. R²":
                shown = table.set_index("model")[column].astype(float)
                assert (shown - summary.loc[shown.index, "best_absolute_r2"]).abs().max() < 5e-4
                checked += 1
    assert checked >= 3, f"{page} lost the default sweep's tables"


def test_results_keeps_current_figures_without_the_dated_logs():
    page = text("docs/results.md")
    assert len(page.splitlines()) < 1100  # three records added in issues 45, 46, 48; dated logs stay out
    assert "Rerun 2026-12-01 16:10-16:40" not in page  # a superseded run of the streamed-probe log


def test_results_length_generalization_table_is_the_shipped_run():
    """Each mean, CI, per-seed list and released number of results.md's lengthgen table is the one in
    docs/lengthgen/summary.csv, the command's own output of that run."""
    page = text("docs/results.md")
    section = page[page.index("## Length generalization") :]
    rows = re.findall(
        r"^\| (\w+) \((\w+)\) \| (\w+) \| ([\d.]+) (?:\[([-\d.]+), ([-\d.]+)\]|\(one seed\)) \| ([\d. ]+) \|"
        r" ([\d.]+) \| ([\d.]+|n/a) \|",
        section,
        re.M,
    )
    summary = pd.read_csv(DOCS / "lengthgen" / "summary.csv").set_index(["task", "method"])
    assert len(rows) == len(summary) == 32
    for task, paper_task, method, mean, low, high, per_seed, inside, released in rows:
        row = summary.loc[(task, method)]
        assert row["paper_task"] == paper_task and row["per_seed"] == per_seed.strip()
        assert (mean, inside) == (f"{row['exact_match_longer']:.3f}", f"{row['exact_match_in_distribution']:.3f}")
        assert (low, high) == ((f"{row['ci_low']:.3f}", f"{row['ci_high']:.3f}") if row["seeds"] > 1 else ("", ""))
        assert released == ("n/a" if pd.isna(row["released"]) else f"{row['released']:.3f}")


# ---- development.md ---------------------------------------------------------------------------


def test_development_paths_exist():
    page = text("docs/development.md")
    named = set(re.findall(r"`(?:python )?((?:benchmarks|examples|tests|nopelens)/[\w/.]+\.py)`", page))
    assert len(named) >= 8
    for path in named:
        local = path.replace("nopelens/", "", 1) if path.startswith("nopelens/") else path
        assert (ROOT / path).is_file() or (ROOT / local).is_file(), path
