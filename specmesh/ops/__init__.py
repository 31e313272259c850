"""Operating any specmesh process: Prometheus metrics and their HTTP endpoint (metrics.py), logging, text or JSON
lines (logs.py), flags read from a TOML file and SPECMESH_* environment variables (config.py), the flags every command
shares, declared once with a help formatter that shows each default (flags.py), and the checks that turn a command
line's mistakes (a port in use, a TLS or token file that cannot be read) into one line naming the cause and the fix,
before the command starts its work (preflight.py)."""
