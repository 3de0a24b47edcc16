"""The ``tokend`` command: one module per command (serve, reload, issue, events, connect,
revoke, sessions, keys), each with its ``SETTINGS``, its ``add_parser`` and its ``run``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from tokend import config
from tokend.cli import connect, events, issue, keys, reload, revoke, serve, sessions
from tokend.config import ConfigError, Settings

COMMANDS = (serve, issue, events, connect, revoke, sessions, keys, reload)
# The settings each command reads; its --help shows these alone. serve reads them all.
COMMAND_SETTINGS: dict[str, tuple[str, ...]] = {
    module.__name__.rpartition(".")[2]: module.SETTINGS for module in COMMANDS
}


class _Parser(argparse.ArgumentParser):
    """Answers a wrong command line with one line, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _add_settings(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument(
        "--config",
        help="TOML file of settings (TOKEND_CONFIG); a flag below beats its TOKEND_<NAME> "
        "variable, which beats the file",
    )
    names = COMMAND_SETTINGS[command]
    for group in config.Group:
        members = [
            name for name in config.FIELDS if name in names and config.declared(name).group is group
        ]
        if not members:
            continue
        section = parser.add_argument_group(f"{group} settings", config.GROUP_MEANINGS[group])
        for name in members:
            section.add_argument(
                "--" + name.replace("_", "-"),
                dest=name,
                metavar=_metavar(name),
                help=config.help_text(name),
            )


def _metavar(name: str) -> str:
    unit = config.declared(name).unit
    return (
        unit.upper()
        if unit
        else {"int": "INT", "float": "NUMBER"}.get(str(config.FIELDS[name].type), "TEXT")
    )


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {name: getattr(args, name, None) for name in config.FIELDS}
    overrides["config"] = args.config
    return config.load(overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tokend",
        description="WebSocket session server for short-lived signed tokens.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(commands)
    for command, sub in commands.choices.items():
        _add_settings(sub, command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = _settings(args)
    except ConfigError as exc:
        print(f"tokend: configuration error: {exc}", file=sys.stderr)
        return 2
    from tokend import logs

    logs.configure(settings.log_format, settings.log_level)
    try:
        return int(args.func(settings, args))
    except ConfigError as exc:  # found on use, e.g. a redis_url that cannot be parsed
        print(f"tokend: configuration error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from tokend.ops.activation import ActivationError
        from tokend.ops.embedded import EmbeddedError

        if isinstance(exc, (EmbeddedError, OSError, ActivationError)):
            print(f"tokend: {exc}", file=sys.stderr)
            return 1
        raise
