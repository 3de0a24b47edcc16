"""Unit tests of settings loading (tokend/config.py) and of config/tokend.toml."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from testkit.tokend_process import serve_refused
from tokend import config
from tokend.config import ConfigError, Settings

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILE = ROOT / "config" / "tokend.toml"
SETTINGS_PAGE = ROOT / "docs" / "settings.md"


def write_toml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def config_error(overrides: dict[str, Any] | None = None, **environ: str) -> str:
    with pytest.raises(ConfigError) as info:
        config.load(overrides, environ=environ)
    return str(info.value)


# --- defaults and sources ---------------------------------------------------------------------


def test_defaults_with_an_empty_environment() -> None:
    settings = config.load(environ={})
    assert settings == Settings()
    assert settings.port == 8765
    assert settings.warn_after == 90.0
    assert settings.expire_after == 120.0
    assert settings.token_ttl_s == 900
    assert settings.algorithm_list == ["EdDSA"]


def test_load_with_none_overrides_and_empty_mapping() -> None:
    assert config.load(None, environ={}) == config.load({}, environ={}) == Settings()


def test_env_overrides() -> None:
    settings = config.load(
        environ={
            "TOKEND_PORT": "9000",
            "TOKEND_WARN_AFTER": "60.5",
            "TOKEND_HOST": "0.0.0.0",
            "TOKEND_ALGORITHMS": "EdDSA, ES256",
            "TOKEND_LOG_FORMAT": "console",
            "TOKEND_SWEEP_INTERVAL": " 0.25 ",
            "UNRELATED": "ignored",
            "TOKEND_": "ignored",
        }
    )
    assert settings.port == 9000
    assert isinstance(settings.port, int)
    assert settings.warn_after == 60.5
    assert settings.host == "0.0.0.0"
    assert settings.algorithm_list == ["EdDSA", "ES256"]
    assert settings.log_format == "console"
    assert settings.sweep_interval == 0.25
    assert settings.ms("warn_after") == 60_500


def test_every_setting_has_an_env_variable() -> None:
    assert config.env_name("warn_after") == "TOKEND_WARN_AFTER"
    for field in fields(Settings):
        assert config.env_name(field.name) == "TOKEND_" + field.name.upper()


def test_overrides_beat_env_beat_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path / "t.toml", 'port = 1111\nhost = "file"\nissuer = "file"\n')
    env = {"TOKEND_CONFIG": str(path), "TOKEND_PORT": "2222", "TOKEND_HOST": "env"}
    settings = config.load({"port": 3333}, environ=env)
    assert (settings.port, settings.host, settings.issuer) == (3333, "env", "file")
    settings = config.load(environ=env)
    assert (settings.port, settings.host, settings.issuer) == (2222, "env", "file")
    settings = config.load(environ={"TOKEND_CONFIG": str(path)})
    assert (settings.port, settings.host, settings.issuer) == (1111, "file", "file")


def test_none_override_does_not_hide_lower_sources() -> None:
    # The CLI passes every flag, unset ones as None.
    settings = config.load({"port": None, "host": None}, environ={"TOKEND_PORT": "2222"})
    assert settings.port == 2222
    assert settings.host == "127.0.0.1"


def test_cli_style_string_overrides_are_coerced() -> None:
    settings = config.load({"port": "7000", "warn_after": "45", "leeway": "0"}, environ={})
    assert settings.port == 7000
    assert settings.warn_after == 45.0
    assert isinstance(settings.warn_after, float)
    assert settings.leeway == 0.0


def test_tokend_config_file_is_read(tmp_path: Path) -> None:
    text = "heartbeat_interval = 20\nwarn_after = 60\nexpire_after = 75.5\nport = 0\n"
    path = write_toml(tmp_path / "t.toml", text)
    settings = config.load(environ={"TOKEND_CONFIG": str(path)})
    assert settings.heartbeat_interval == 20.0
    assert settings.warn_after == 60.0
    assert isinstance(settings.warn_after, float)
    assert settings.expire_after == 75.5
    assert settings.port == 0
    assert settings.host == "127.0.0.1"  # the rest stays at its default


def test_config_override_beats_tokend_config(tmp_path: Path) -> None:
    a = write_toml(tmp_path / "a.toml", "port = 1\n")
    b = write_toml(tmp_path / "b.toml", "port = 2\n")
    assert config.load({"config": str(b)}, environ={"TOKEND_CONFIG": str(a)}).port == 2


def test_missing_config_file(tmp_path: Path) -> None:
    message = config_error(TOKEND_CONFIG=str(tmp_path / "absent.toml"))
    assert "absent.toml" in message


def test_malformed_toml(tmp_path: Path) -> None:
    path = write_toml(tmp_path / "bad.toml", "port = = 1\n")
    assert "bad.toml" in config_error(TOKEND_CONFIG=str(path))


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("bogus = 1\n", "bogus"),
        ("heartbeat = 30\n", "heartbeat"),
        ("[server]\nport = 1\n", "server"),
        ("config = 'x.toml'\n", "config"),
    ],
)
def test_unknown_key_in_file_is_named(tmp_path: Path, text: str, name: str) -> None:
    path = write_toml(tmp_path / "t.toml", text)
    message = config_error(TOKEND_CONFIG=str(path))
    assert re.match(rf"{name}\b", message), message
    assert "unknown" in message


# --- bad types --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ('port = "abc"\n', "port"),
        ("port = 80.5\n", "port"),
        ("port = true\n", "port"),
        ("port = [1]\n", "port"),
        ("port = inf\n", "port"),
        ('warn_after = "soon"\n', "warn_after"),
        ("warn_after = true\n", "warn_after"),
        ("warn_after = [60]\n", "warn_after"),
        ("warn_after = 1979-05-27\n", "warn_after"),
        ("warn_after = { a = 1 }\n", "warn_after"),
        ("leeway = nan\n", "leeway"),
        ("token_ttl = inf\n", "token_ttl"),
        ("host = 5\n", "host"),
        ("issuer = false\n", "issuer"),
        ("algorithms = ['EdDSA']\n", "algorithms"),
    ],
)
def test_bad_type_in_file_is_named(tmp_path: Path, text: str, name: str) -> None:
    path = write_toml(tmp_path / "t.toml", text)
    message = config_error(TOKEND_CONFIG=str(path))
    assert message.startswith(name), message
    assert "t.toml" in message  # and says where


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("TOKEND_PORT", "abc"),
        ("TOKEND_PORT", "80.5"),
        ("TOKEND_PORT", ""),
        ("TOKEND_WARN_AFTER", "soon"),
        ("TOKEND_WARN_AFTER", ""),
        ("TOKEND_LEEWAY", "nan"),
        ("TOKEND_LEEWAY", "inf"),
        ("TOKEND_EXPIRE_AFTER", "inf"),
        ("TOKEND_TOKEN_TTL", "inf"),
        ("TOKEND_TOKEN_TTL", "-inf"),
        ("TOKEND_REDIS_POOL_SIZE", "1e3"),
    ],
)
def test_bad_type_in_env_is_named(var: str, value: str) -> None:
    name = var.removeprefix("TOKEND_").lower()
    message = config_error(None, **{var: value})
    assert message.startswith(name), message
    assert var in message  # and says where


def test_bad_type_in_override_is_named() -> None:
    message = config_error({"port": "http"})
    assert message.startswith("port") and "--port" in message


# --- validation -------------------------------------------------------------------------------

DURATIONS = [
    "heartbeat_interval",
    "warn_after",
    "expire_after",
    "token_ttl",
    "renew_window",
    "hello_timeout",
    "redis_timeout",
    "sweep_interval",
]


@pytest.mark.parametrize("value", ["-1", "0", "-0.5"])
@pytest.mark.parametrize("name", DURATIONS)
def test_non_positive_duration_is_named(name: str, value: str) -> None:
    message = config_error({name: value})
    assert message.startswith(name), message


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"warn_after": 120}, "warn_after"),
        ({"warn_after": 200}, "warn_after"),
        ({"warn_after": 10, "expire_after": 9.5}, "warn_after"),
        ({"heartbeat_interval": 90}, "heartbeat_interval"),
        ({"renew_window": 900}, "renew_window"),
        ({"renew_window": 1000}, "renew_window"),
        ({"token_ttl": 60}, "renew_window"),  # default renew_window 300 >= 60
        ({"token_ttl": 900.5}, "token_ttl"),
        ({"token_ttl": "600.25", "renew_window": 1}, "token_ttl"),
        ({"token_ttl": 0.4, "renew_window": 0.1}, "token_ttl"),
        ({"log_format": "xml"}, "log_format"),
        ({"log_format": "JSON"}, "log_format"),
        ({"log_level": "trace"}, "log_level"),
        ({"port": 65536}, "port"),
        ({"port": -1}, "port"),
        ({"key_prefix": ""}, "key_prefix"),
        ({"key_prefix": "a:b"}, "key_prefix"),
        ({"key_prefix": "{x}"}, "key_prefix"),
        ({"leeway": -1}, "leeway"),
        ({"algorithms": " , "}, "algorithms"),
        ({"max_message_size": 1023}, "max_message_size"),
        ({"max_message_size": (1 << 20) + 1}, "max_message_size"),
        ({"redis_pool_size": 3}, "redis_pool_size"),
        ({"stream_maxlen": 0}, "stream_maxlen"),
        ({"jwks_max_age": 900}, "jwks_max_age"),
        ({"key_publish_delay": 10, "jwks_max_age": 10}, "jwks_max_age"),
        ({"key_publish_delay": 10, "jwks_max_age": 9.5}, "jwks_max_age"),  # refresh: 1 s
        ({"jwks_max_age": -1}, "jwks_max_age"),
        ({"key_publish_delay": 0}, "key_publish_delay"),
        ({"admin_max_connections": 0}, "admin_max_connections"),
    ],
)
def test_invalid_setting_is_named(overrides: dict[str, Any], name: str) -> None:
    message = config_error(overrides)
    assert message.startswith(name), message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"token_ttl": "600.0"}, {"token_ttl": 600.0}),
        ({"token_ttl": 2, "renew_window": 1}, {"token_ttl": 2.0, "renew_window": 1.0}),
        ({"warn_after": 119.999}, {"warn_after": 119.999}),
        ({"port": 0}, {"port": 0}),
        ({"port": "65535"}, {"port": 65535}),
        ({"leeway": 0}, {"leeway": 0.0}),
        ({"max_message_size": 1024}, {"max_message_size": 1024}),
        ({"key_publish_delay": 10, "jwks_max_age": 9}, {"jwks_max_age": 9.0}),
        ({"log_format": "console", "log_level": "debug"}, {"log_format": "console"}),
    ],
    ids=repr,
)
def test_edge_values_are_accepted(overrides: dict[str, Any], expected: dict[str, Any]) -> None:
    settings = config.load(overrides, environ={})
    for name, value in expected.items():
        assert getattr(settings, name) == value
        assert type(getattr(settings, name)) is type(value)


def test_derived_values(tmp_path: Path) -> None:
    settings = config.load(
        {"data_dir": str(tmp_path), "node_name": "node-a", "token_ttl": "600"}, environ={}
    )
    assert settings.resolved_data_dir == tmp_path
    assert settings.resolved_keys_dir == tmp_path / "keys"
    assert settings.resolved_node_name == "node-a"
    assert settings.token_ttl_s == 600
    assert isinstance(settings.token_ttl_s, int)
    assert settings.ms("redis_timeout") == 2500
    assert settings.ms("sweep_interval") == 100
    explicit = config.load({"keys_dir": str(tmp_path / "k")}, environ={})
    assert explicit.resolved_keys_dir == tmp_path / "k"
    assert Settings().resolved_node_name.endswith(f"-{os.getpid()}")


# --- the CLI refuses a bad setting cleanly ----------------------------------------------------


def test_cli_exits_2_naming_the_bad_setting(tmp_path: Path) -> None:
    # Should it get that far, it stays in tmp_path.
    result = serve_refused({"XDG_DATA_HOME": str(tmp_path)}, "--warn-after", "200")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "warn_after" in lines[0]
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "token",
    [
        "s3cret-admin-token",  # 18 characters
        "x" * 64,  # one character
        "changeme" * 4,  # 7 different characters
        "0123456789abcdef" * 2 + "\n",  # not printable
        " " + secrets.token_urlsafe(32),  # a space around it, lost in the header
    ],
)
def test_a_weak_admin_token_is_refused_naming_how_to_make_one(token: str) -> None:
    message = config_error({"admin_token": token})
    assert message.startswith("admin_token: must be at least 32 characters"), message
    assert "python -c 'import secrets; print(secrets.token_urlsafe(32))'" in message
    assert token.strip() not in message  # never the token itself


@pytest.mark.parametrize(
    "token", ["", secrets.token_urlsafe(32), secrets.token_hex(16), secrets.token_urlsafe(24)]
)
def test_strong_admin_tokens_are_accepted(token: str) -> None:
    assert config.load({"admin_token": token}, environ={}).admin_token == token


def test_tokend_serve_refuses_a_short_admin_token_in_one_line(tmp_path: Path) -> None:
    env = {"XDG_DATA_HOME": str(tmp_path), "TOKEND_ADMIN_TOKEN": "hunter2"}
    result = serve_refused(env, "--port", "0", "--admin-port", "0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "tokend: configuration error: admin_token: must be at least 32 characters, 8 of them "
        "different, printable, no spaces around them, as python -c 'import secrets; "
        "print(secrets.token_urlsafe(32))' makes"
    ]


# --- config/tokend.toml and docs/settings.md, written from the declarations ------------

TABLES_START = "<!-- settings: written from tokend/config.py by python -m tests.test_config -->\n"
TABLES_END = "<!-- end of settings -->\n"
REGENERATE = "out of step with tokend/config.py: python -m tests.test_config writes it again"


def grouped() -> dict[config.Group, list[str]]:
    """Every setting in its group, in declaration order."""
    return {
        group: [name for name in config.FIELDS if config.declared(name).group is group]
        for group in config.Group
    }


def toml_value(value: object) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def default_file() -> str:
    """config/tokend.toml: its own header, then every setting at its default."""
    header = DEFAULT_FILE.read_text().split("\n\n", 1)[0]
    parts = [header]
    for group, names in grouped().items():
        parts.append(f"# --- {group}: {config.GROUP_MEANINGS[group]} ---")
        for name in names:
            spec = config.declared(name)
            values = config.values(name)
            empty = f" Empty: {spec.shown}." if spec.shown else ""
            parts.append(
                f"# {spec.meaning}{f' ({values})' if values else ''}\n"
                f"# Env: {config.env_name(name)}.{empty}\n"
                f"{name} = {toml_value(config.FIELDS[name].default)}"
            )
    return "\n\n".join(parts) + "\n"


def table_default(name: str) -> str:
    shown = config.shown_default(name)
    return (
        shown
        if config.FIELDS[name].default == "" and not config.declared(name).shown
        else f"`{shown}`"
    )


def settings_tables() -> str:
    """docs/settings.md's tables: one per group."""
    lines = [TABLES_START]
    for group, names in grouped().items():
        lines += [
            f"\n## {group.capitalize() if group.islower() else group}\n\n",
            f"{config.GROUP_MEANINGS[group].capitalize()}.\n\n",
            "| variable | default | values | meaning |\n",
            "|---|---|---|---|\n",
        ]
        lines += [
            f"| `{config.env_name(name)}` | {table_default(name)} | {config.values(name)} | "
            f"{config.meaning(name)} |\n"
            for name in names
        ]
    return "".join([*lines, "\n", TABLES_END])


def settings_page_parts() -> tuple[str, str, str]:
    """docs/settings.md before its tables, the tables, and after them."""
    text = SETTINGS_PAGE.read_text()
    before, rest = text.split(TABLES_START, 1)
    tables, after = rest.split(TABLES_END, 1)
    return before, TABLES_START + tables + TABLES_END, after


def test_default_file_is_written_from_the_declarations() -> None:
    assert DEFAULT_FILE.read_text() == default_file(), f"config/tokend.toml {REGENERATE}"


def test_the_settings_page_is_written_from_the_declarations() -> None:
    assert settings_page_parts()[1] == settings_tables(), f"docs/settings.md {REGENERATE}"


def test_default_file_lists_every_field_at_its_default() -> None:
    values = config.read_toml(DEFAULT_FILE)
    names = [field.name for field in fields(Settings)]
    assert set(values) == set(names), set(values) ^ set(names)
    for field in fields(Settings):
        assert values[field.name] == field.default, field.name
        assert type(values[field.name]) is type(field.default), field.name


def test_default_file_writes_values_in_their_own_types() -> None:
    # Written as 30.0, not 30, and "" not missing: the file reads like the dataclass.
    raw = tomllib.loads(DEFAULT_FILE.read_text())
    for field in fields(Settings):
        assert type(raw[field.name]) is type(field.default), field.name
        assert raw[field.name] == field.default, field.name


def test_default_file_loads_as_the_defaults() -> None:
    assert config.load({"config": str(DEFAULT_FILE)}, environ={}) == Settings()


def serve_help() -> str:
    return subprocess.run(
        [sys.executable, "-m", "tokend", "serve", "--help"],
        env={**os.environ, "COLUMNS": "1000"},  # one line per option
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_serve_help_shows_each_setting_in_its_group_with_its_declaration() -> None:
    help_text = serve_help()
    sections = re.split(r"^(\S.*) settings:$", help_text, flags=re.M)
    assert sections[1::2] == [str(group) for group in config.Group]
    for group, section in zip(config.Group, sections[2::2], strict=True):
        assert section.startswith(f"\n  {config.GROUP_MEANINGS[group]}\n"), group
        shown = re.findall(r"^  --([a-z-]+) [A-Z]+\s+(.+)$", section, re.M)
        expected = [(name.replace("_", "-"), config.help_text(name)) for name in grouped()[group]]
        assert shown == expected, group


def test_help_text_says_the_values_each_setting_may_take() -> None:
    assert config.help_text("port") == (
        "TCP port; 0 picks a free one (logged in the listening line) (0..65535; default: 8765)"
    )
    assert config.help_text("warn_after") == (
        "silence before WARN (seconds, more than 0; less than expire_after; default: 90)"
    )
    assert config.values("max_message_size") == "bytes, 1024..1048576"
    assert config.values("log_level") == "debug, info, warning or error"
    assert config.values("host") == ""


def test_each_setting_fails_validation_outside_its_declared_range() -> None:
    """The loop checks every declaration: just outside each bound is refused, naming it."""
    for name in config.FIELDS:
        spec = config.declared(name)
        step = 1 if config.FIELDS[name].type == "int" else 0.5
        outside = {
            spec.at_least: -step,  # just below the least allowed
            spec.more_than: 0,  # the bound itself
            spec.at_most: step,  # just above the most allowed
        }
        for value in (bound + offset for bound, offset in outside.items() if bound is not None):
            message = config_error({name: value})
            assert message.startswith(f"{name}: must be "), (name, value, message)


def test_every_declared_rule_names_a_setting() -> None:
    for rule in config.ACROSS:
        assert rule.name in config.FIELDS
        assert rule.text in config.values(rule.name)


if __name__ == "__main__":
    DEFAULT_FILE.write_text(default_file())
    before, _, after = settings_page_parts()
    SETTINGS_PAGE.write_text(before + settings_tables() + after)
