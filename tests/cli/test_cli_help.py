"""Every command's --help states every option's default (issue #19: a newcomer should not have
to read the code to learn what an omitted option means). Flags (on/off) default to off."""

from __future__ import annotations

import argparse

import pytest

from autosbp.cli import COMMANDS, build_parser


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", [name for name, _, _ in COMMANDS])
def test_every_option_states_its_default(command: str) -> None:
    parser = subparsers()[command]
    silent = [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings
        and not isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction))
        and action.required is False
        and "default" not in (action.help or "")
    ]
    assert not silent, f"autosbp {command}: options whose help states no default: {silent}"
