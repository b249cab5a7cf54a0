"""The CLI imports only what the command it runs needs; `nopelens --help` imports no torch."""

import argparse
import importlib
import subprocess
import sys

import pytest

from nopelens.analyses.cli import COMMAND_MODULES, COMMANDS, build_parser


def test_command_table_matches_what_the_modules_register():
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    registered = {action.dest: action.help for action in subparsers._choices_actions}
    assert registered == {name: text for name, (_, text) in COMMANDS.items()}
    for name, (module, _) in COMMANDS.items():
        assert module in COMMAND_MODULES, name


def test_a_command_gets_its_full_parser_alone():
    args = build_parser(["probe", "circuit", "--seeds", "0,1"]).parse_args(["probe", "circuit", "--seeds", "0,1"])
    assert (args.command, args.model, args.seeds) == ("probe", "circuit", (0, 1))


def test_top_level_help_imports_neither_torch_nor_pandas():
    code = (
        "import sys\nfrom nopelens.analyses.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'pandas', 'transformer_lens') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "sweep" in result.stdout and result.stdout.strip().endswith("[]")


def test_every_command_spells_seeds_and_the_progress_switch_one_way(capsys):
    for argv in (["sweep"], ["probe", "circuit"], ["train", "--zoo", "copy-nope-3l"], ["lengthgen"]):
        args = build_parser(argv).parse_args([*argv, "--seeds", "0,2", "--quiet"])
        assert args.seeds == (0, 2) and args.quiet, argv
        assert build_parser(argv).parse_args([*argv, "--no-progress"]).quiet, "the former name still works"
    assert build_parser(["lengthgen"]).parse_args(["lengthgen"]).seeds == (0, 1, 2, 3, 4)
    assert build_parser(["sweep"]).parse_args(["sweep"]).seeds is None
    for argv in (["sinks", "circuit"], ["intervene", "circuit"]):
        assert build_parser(argv).parse_args([*argv, "--quiet"]).quiet
    for bad in ("0 1", "a,b", ","):
        try:
            build_parser(["sweep"]).parse_args(["sweep", "--seeds", bad])
        except SystemExit as exit_info:
            assert exit_info.code == 2
        else:
            raise AssertionError(f"--seeds {bad!r} was accepted")
    assert "--seeds" in capsys.readouterr().err


def _options_without_help(parser: argparse.ArgumentParser, command: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from _options_without_help(subparser, f"{command} {name}")
        elif not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            yield f"{command} {'/'.join(action.option_strings) or action.dest}"


def test_every_option_of_every_command_has_help_text():
    """`nopelens train --help` showed --position, --layers, --d-model and --task without a word (issue 49)."""
    parser = build_parser()  # every command module registered
    assert len(parser._subparsers._group_actions[0].choices) == len(COMMANDS)
    assert list(_options_without_help(parser, "nopelens")) == []
    bare = argparse.ArgumentParser(prog="x")
    bare.add_argument("--layers", type=int)
    assert list(_options_without_help(bare, "x")) == ["x --layers"]  # the walk sees a missing text


def test_one_model_spec_help_for_every_command_that_takes_a_model():
    from nopelens.analyses.cli.options import MODEL_HELP

    for command in ("probe", "sinks", "intervene"):
        parser = build_parser([command, "circuit"])
        subparser = parser._subparsers._group_actions[0].choices[command]
        model = next(action for action in subparser._actions if action.dest == "model")
        assert model.help == MODEL_HELP, command


def test_an_interrupt_while_the_command_starts_is_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C while the parser imports the command's modules printed a traceback of the imports."""
    from nopelens.analyses import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["sweep"]) == 130
    assert capsys.readouterr().err.splitlines() == [
        "nopelens: interrupted before the command started; nothing was written"
    ]


@pytest.mark.parametrize(
    "argv", [["validate", "--seed", "-1"], ["probe", "circuit", "--seed", str(2**64)], ["sweep", "--seeds", "0,-1"]]
)
def test_a_seed_out_of_range_names_the_option(argv, capsys):
    """``--seed -1`` said only "expected non-negative integer" (torch's words), 2**64 "Overflow when unpacking"."""
    from nopelens.analyses.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and f"0..{2**63 - 1}" in err[0] and "seed" in err[0], err


def test_a_seed_listed_twice_is_refused():
    """``train --seeds 0,0`` trained seed 0 twice into one folder."""
    from nopelens.analyses.cli.options import parse_seeds

    with pytest.raises(ValueError, match="--seeds lists a seed twice: '0,1,0'"):
        parse_seeds("0,1,0")


def _helps(parser: argparse.ArgumentParser, command: str):
    yield command, parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from _helps(subparser, f"{command} {name}")


def test_every_help_screen_fits_100_columns(monkeypatch):
    """`nopelens --help` printed its command list as one 121-column line, lengthgen its choices (issue 49)."""
    monkeypatch.setenv("COLUMNS", "100")
    wide = [
        f"{command}: {len(line)} columns: {line.strip()[:60]}"
        for command, text in _helps(build_parser(), "nopelens")
        for line in text.splitlines()
        if len(line) > 100
    ]
    assert wide == []
