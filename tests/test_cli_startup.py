"""The CLI imports only what the command it runs needs; `nopelens --help` imports no torch."""

import argparse
import importlib
import subprocess
import sys

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
    code = ("import sys\nfrom nopelens.analyses.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'pandas', 'transformer_lens') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "sweep" in result.stdout and result.stdout.strip().endswith("[]")
