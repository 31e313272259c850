"""Every command-line flag also comes from the environment (SPECMESH_<FLAG>, e.g. SPECMESH_MAX_NEW_TOKENS) and from
a TOML file (--config FILE). Precedence: command line > environment > config file > built-in default.

The TOML file holds flag names as keys (dashes or underscores), at the top level for every command and in a table
per command to override them: [generate], [serve], [drafter], [verifier].
"""

from __future__ import annotations

import argparse
import os
import tomllib

ENV_PREFIX = "SPECMESH_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def env_name(action: argparse.Action) -> str:
    return ENV_PREFIX + action.dest.upper()


def _convert(action: argparse.Action, raw, source: str):
    try:
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                               argparse.BooleanOptionalAction)):
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text not in _TRUE | _FALSE:
                raise ValueError(f"expected true or false, got {raw!r}")
            # A store_true or store_false flag's variable says whether the flag is given; --x/--no-x's, the value of x.
            return (text in _TRUE) != isinstance(action, argparse._StoreFalseAction)
        if isinstance(action, argparse._AppendAction):
            items = raw if isinstance(raw, list) else [s for s in str(raw).split(",") if s]
            return [action.type(i) if action.type else str(i) for i in items]
        value = action.type(raw) if action.type and not isinstance(raw, action.type) else raw
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"expected one of {', '.join(map(str, action.choices))}, got {value!r}")
        return value
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: {source} for --{action.dest.replace('_', '-')}: {e}") from None


def apply(parser: argparse.ArgumentParser, command: str, config: dict | None) -> None:
    """Set `parser`'s defaults from the config file's values for `command`, then from the environment."""
    values = {k.replace("-", "_"): v for k, v in (config or {}).items() if not isinstance(v, dict)}
    values.update({k.replace("-", "_"): v for k, v in (config or {}).get(command, {}).items()})
    defaults = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        if action.dest in values:
            defaults[action.dest] = _convert(action, values.pop(action.dest), "config file")
        if env_name(action) in os.environ:
            defaults[action.dest] = _convert(action, os.environ[env_name(action)], f"${env_name(action)}")
    unknown = sorted(k for k in values if k in (config or {}).get(command, {}))
    if unknown:
        raise SystemExit(f"error: config file: unknown option(s) for {command}: {', '.join(unknown)}")
    parser.set_defaults(**defaults)


def load(path: str | None) -> dict | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise SystemExit(f"error: cannot read config file {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise SystemExit(f"error: config file {path!r}: {e}") from None


def config_file(argv: list[str]) -> str | None:
    """The --config given on a command line (else $SPECMESH_CONFIG), read before the command's parser runs: its
    defaults, and so its --help, then include the file's and the environment's values."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_config_argument(parser)
    return parser.parse_known_args(argv)[0].config


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=os.environ.get(ENV_PREFIX + "CONFIG"),
                        help="TOML file with flag values (default: $SPECMESH_CONFIG); command line and SPECMESH_* "
                        "environment variables take precedence")
