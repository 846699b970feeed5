"""The command line's --help is written for a user: every option of every command says what it
does, the SP modes are explained, and no help text describes code internals."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location("cli_under_test", REPO / "minimax_h3_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def commands(top: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_of_every_command_has_help():
    missing = []
    for name, command in commands(parser()).items():
        for action in command._actions:
            if action.option_strings and not (action.help or "").strip():
                missing.append(f"{name} {action.option_strings[0]}")
    assert not missing, f"options without help text: {missing}"


def test_the_sp_modes_are_explained():
    run = commands(parser())["run"]
    sp_mode = next(a for a in run._actions if "--sp-mode" in a.option_strings)
    for choice in sp_mode.choices:
        assert f"{choice} =" in sp_mode.help, choice


def test_help_texts_say_what_a_user_gets_not_how_the_code_is_built():
    top = parser()
    texts = [top.format_help()] + [c.format_help() for c in commands(top).values()]
    for text in texts:
        assert "add_" not in text and "comfy/multidevice" not in text, text[:300]
    for name, command in commands(top).items():
        assert "Exit status" in command.format_help(), name
