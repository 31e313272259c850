"""Operating any specmesh process: Prometheus metrics and their HTTP endpoint, logging (text or JSON lines), flags
read from a TOML file and SPECMESH_* environment variables (config.py), and the flags every command shares, declared
once with a help formatter that shows each default (flags.py)."""
