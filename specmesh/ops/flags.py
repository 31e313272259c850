"""Flags that several commands share, declared once: logging, the Prometheus endpoint, TLS and tokens (a worker
serves with a certificate, a client checks one: two declarations side by side), and the help formatter every
specmesh command uses, which shows each option's default. The add_* functions take a parser or one of its argument
groups."""

from __future__ import annotations

import argparse
from specmesh.ops.logs import LOG_FORMATS


def default_text(value) -> str:
    """A default as a user would type it: 600 not 600.0, code,prose not ['code', 'prose']."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def has_default_to_show(action: argparse.Action) -> bool:
    """Whether an option has a default value worth printing: not None (the help says what happens instead), not a
    flag's False, not an empty list, not argparse's SUPPRESS."""
    value = action.default
    if value is None or value is False or value is argparse.SUPPRESS:
        return False
    return not (isinstance(value, (list, tuple)) and not value)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Ends an option's help with "(default: VALUE)" unless the help already says "default:" itself (a default that
    needs words, e.g. "default: start one locally"). The value is the one in effect when --help is printed, after
    SPECMESH_* variables and --config (specmesh/ops/config.py) have changed it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default:" in text or not has_default_to_show(action):
            return text
        shown = default_text(action.default).replace("%", "%%")  # the help text is %-formatted next
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


class DefaultsRawDescriptionHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """DefaultsHelpFormatter that prints the description as written (a module docstring with its own layout)."""


def add_logging_flags(parser: argparse.ArgumentParser, level: str = "INFO") -> None:
    """--log-format and --log-level; `level` is the command's default level."""
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="auto",
                        help="auto: JSON lines unless stderr is a terminal")
    parser.add_argument("--log-level", default=level, help="DEBUG, INFO, WARNING or ERROR")


def add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this port; 0 picks a free one (default: off)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port")


def add_server_security_flags(parser: argparse.ArgumentParser) -> None:
    """A worker's TLS certificate, the client CA it requires (mutual TLS) and the token it demands."""
    parser.add_argument("--tls-cert", help="PEM server certificate (enables TLS)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", help="PEM CA bundle: require client certificates signed by it (mutual TLS)")
    parser.add_argument("--token-file", help="file holding the bearer token every RPC must carry "
                        "(default: $SPECMESH_TOKEN_FILE, else $SPECMESH_TOKEN, else no token)")


def add_client_security_flags(parser: argparse.ArgumentParser) -> None:
    """The CA a client checks workers' certificates with, its own certificate (mutual TLS) and the token it sends."""
    parser.add_argument("--tls-ca", help="PEM CA bundle to verify workers' certificates (enables TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate for mutual TLS")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", help="name to expect in the workers' certificates (default: the host)")
    parser.add_argument("--token-file", help="bearer token for the workers (default: $SPECMESH_TOKEN_FILE, else "
                        "$SPECMESH_TOKEN)")
