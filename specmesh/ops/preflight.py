"""Mistakes in a command line, said as one line that names the cause and the fix, before the command starts its
work: a port that is taken (or privileged, or not an address of this machine) and a file a flag names that cannot be
read. The commands print the line as `<command>: error: ...` and exit with status 2, no traceback. (Whether a model
spec names a model is specmesh/runtime/model_spec.py's question; why a worker cannot be reached is
coordinator/fleet/connect_errors.py's.)"""

from __future__ import annotations

import errno
import socket

# How specmesh/wire/security.py names the files it cannot read, and the flag that gave each.
FILE_FLAGS = {
    "certificate": "--tls-cert",
    "private key": "--tls-key",
    "CA bundle": "--tls-ca",
    "token file": "--token-file (or $SPECMESH_TOKEN_FILE)",
}


def one_line(text: object) -> str:
    """`text` on one line: line breaks (a library's multi-line message) become spaces."""
    return " ".join(str(text).split())


def with_fix(error: Exception) -> str:
    """An argument error's message on one line, with the flag to fix when it is about a file a flag names."""
    message = one_line(error)
    for what, flag in FILE_FLAGS.items():
        if message.startswith(f"cannot read {what} "):
            return f"{message}: check the path given with {flag}"
        if what == "token file" and message.startswith("token file ") and message.endswith(" is empty"):
            return f"{message}: write the token into it, or give another with {flag}"
    return message


def bind_problem(host: str, port: int, error: OSError | OverflowError, flag: str = "--port") -> str:
    """Why `host`:`port` cannot be listened on, and what to do instead."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    code, why = getattr(error, "errno", None), one_line(getattr(error, "strerror", None) or error)
    if isinstance(error, OverflowError) or not 0 <= port <= 65535:
        return f"{flag} {port} is not a port: pass 1..65535, or 0 for a free one"
    if code == errno.EADDRINUSE:
        return (f"port {port} is in use ({where}: another process listens there): stop it, or pass another "
                f"{flag} (0 picks a free one)")
    if code == errno.EACCES:
        return f"port {port} needs privileges to listen on ({where}): pass a {flag} above 1023"
    if code == errno.EADDRNOTAVAIL or isinstance(error, socket.gaierror):
        return (f"cannot listen on {host!r}: not an address of this machine ({why}): pass --host 127.0.0.1, 0.0.0.0 "
                "or one of this machine's addresses")
    return f"cannot listen on {where}: {why}: pass another {flag} or --host"


def check_port(host: str, port: int | None, flag: str = "--port") -> None:
    """ValueError (bind_problem's line) when `port` cannot be listened on at `host` right now; nothing for None or 0
    (a free port is picked). A probe: the port is bound and released at once (with SO_REUSEADDR, as servers bind, so
    that a port whose last connections are still closing counts as free)."""
    if not port:
        return
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.create_server((host, port), family=family):
            pass
    except (OSError, OverflowError) as e:  # OverflowError: a port beyond 0..65535
        raise ValueError(bind_problem(host, port, e, flag)) from None


def check_tls_files(cert: str | None = None, key: str | None = None, ca: str | None = None) -> None:
    """ValueError unless the PEM files a TLS flag names hold what the flag says: a CA bundle with at least one
    certificate (--tls-ca), a certificate and the private key that belongs to it (--tls-cert, --tls-key; a key
    protected by a passphrase is refused, gRPC cannot use one). Without this gRPC takes any bytes, logs its own
    complaint and fails later as if the worker could not be reached."""
    import ssl

    if ca:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError, ValueError) as e:
            raise ValueError(f"--tls-ca {ca!r} holds no PEM certificate ({tls_reason(e)}): pass the CA bundle "
                             "(PEM) that signed the other side's certificate") from None
    if cert and key:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
        except (ssl.SSLError, OSError, ValueError) as e:
            raise ValueError(f"--tls-cert {cert!r} and --tls-key {key!r} are no PEM certificate and its private key "
                             f"({tls_reason(e)}): pass a PEM certificate and the unencrypted key that belongs to it"
                             ) from None


def tls_reason(error: Exception) -> str:
    import ssl

    if isinstance(error, ssl.SSLError):
        if error.reason and error.reason != "PEM lib":
            return error.reason.lower().replace("_", " ")
        return "not PEM, or a key protected by a passphrase"
    return one_line(getattr(error, "strerror", None) or error)
