"""specmesh's shared core, one subpackage per concern; the folders are the architecture.

    runtime/   loading models and running them: engines (transformers, llama.cpp, ik_llama.cpp), devices, KV caches,
               tokenizers
    decoding/  the math: warpers, sampling, accept/reject
    wire/      what both ends of an RPC agree on: history sync, validation, limits, conversions, TLS and tokens
    worker/    the gRPC worker server the drafter and the verifier run on: sessions, the server, its CLI
    ops/       operating any process: metrics, logs, flags from files and the environment
    v1/        code generated from proto/specmesh/v1 (never edited by hand)

Layers only import downwards: worker/ -> wire/ -> runtime/, decoding/; ops/ is used by all. A client (the
coordinator) needs wire/, decoding/, ops/ and the tokenizer from runtime/, never worker/.
"""
