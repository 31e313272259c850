"""The benchmarks, outside the product: the commands `coordinator bench`, `coordinator bench-serve` and
`coordinator bench-concurrency` (coordinator/cli.py hands them here; also `python scripts/bench.py` and
`python scripts/bench_concurrency.py`). Unlike coordinator/, this package may import engines: its baselines run
llama.cpp, ik_llama.cpp and HF transformers in-process (docs/architecture.md#source-layout).

    bench.py               the side-by-side benchmark command: flags, the sides' order, reports written
    modes.py               what a mode is (specmesh, HF or llama.cpp; drafter; k; policy) and which can run
    prompts.py             the prompt set (prompts.json: code, prose, and prompts that quote their input)
    engines.py             the engine each side asks for and what "auto" resolves to
    machine.py             what a run ran on (CPU model, flags, cores) and its record: command, date, revision
    measure.py             a side's runner, best of N timed runs, the sides taking turns prompt by prompt
    interleave.py          whether the baselines fit in memory beside the workers (interleaved order)
    specmesh_runs.py       the specmesh side: its modes over gRPC on local or given workers
    hf_baseline.py         the HF side: Hugging Face transformers in-process
    llamacpp_baseline.py   the llama.cpp side: llama-cpp-python's own loop in-process
    analysis.py            speedups, divergence, per-class summaries, the analytic speedup bound
    reports.py             markdown tables, the PNG plot, results pages (docs/benchmarks.md after its marker)
    concurrency.py         the bench-concurrency command: aggregate tokens/s with batching off and on
    soak.py                leak sampling for long runs (scripts/chaos.py --serve, scripts/fuzz.py): RSS, fds, threads,
                           worker sessions, and the drain of sessions after the load stops
    split.py               bench --topology split: workers on namespaced "hosts", pinned cores, link delays swept
    netns.py               network namespaces on a bridge, netem link delays (also the multi-host chaos test's)
    delay_relay.py         a TCP relay that delays every byte: link latency where the kernel has no netem
"""
