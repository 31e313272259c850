"""The CPU linear-layer backends a worker can ask for (specmesh/runtime/onednn.py runs them), in a module without torch:
flag parsing and config validation need the names only, not onednn.py's torch import (a second of CPU)."""

BACKENDS = ("auto", "torch", "onednn")
