"""The CPU linear-layer backends a worker can ask for (specmesh/runtime/onednn.py runs them), in a module without torch:
flag parsing and config validation import it, and a worker on a GGUF engine never needs torch (its import costs a
second of the start)."""

BACKENDS = ("auto", "torch", "onednn")
