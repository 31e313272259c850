"""Operating any specmesh process: Prometheus metrics and their HTTP endpoint, logging (text or JSON lines), and flags
read from a TOML file and SPECMESH_* environment variables."""
