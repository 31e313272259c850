"""Serving: the OpenAI-compatible HTTP service over the coordinator's Python API.

    http_api.py         /v1/completions, /v1/chat/completions, /v1/models, /health (FastAPI)
    http_server.py      uvicorn with a drain on SIGTERM
    admission.py        how many generations run and wait at once; 429 beyond

The top room: it may import the API and the fleet; in coordinator/ only the CLI imports it, for `coordinator serve`
(tests/test_import_cycles.py).
"""
