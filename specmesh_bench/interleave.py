"""Whether the baselines can run interleaved with the specmesh modes: their models loaded in this process while the
workers hold theirs. Interleaving is the fair comparison on a machine whose speed drifts (each prompt runs every mode
back to back), but it needs memory for every side's weights at once; without it the sides run one after the other."""

from __future__ import annotations

from specmesh_bench.modes import Mode

# HF loads a llama.cpp worker's GGUF dequantized (float32 on CPU): up to 8x the quantized size (4-bit weights).
DEQUANTIZED_GROWTH = 8
HEADROOM_BYTES = 1 << 30  # left free for activations, KV caches and the allocator


def available_memory_bytes() -> int | None:
    """MemAvailable (what the kernel can hand out without swapping), None where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def baseline_bytes(args, modes: list[Mode], worker_weights: dict) -> int:
    """Estimated memory of the baselines' models: HF loads the workers' models again (as many bytes, or their GGUF
    dequantized), llama.cpp reads the target's GGUF once per mode."""
    def hf_model(role: str) -> int:
        worker = worker_weights.get(role) or worker_weights["verifier"]  # no drafter started: assume target-sized
        return worker["bytes"] * (1 if worker["engine"] == "transformers" else DEQUANTIZED_GROWTH)

    hf_modes = [m for m in modes if m.kind == "hf"]
    total = hf_model("verifier") if hf_modes else 0
    if any(m.drafter == "model" for m in hf_modes):
        total += hf_model("drafter")
    llama_modes = [m for m in modes if m.kind in ("llamacpp", "ik")]
    if llama_modes:
        from specmesh.runtime.gguf_files import gguf_file

        total += len(llama_modes) * gguf_file(args.target_model, progress=False).stat().st_size
    return total


def cannot_interleave(args, modes: list[Mode], info: dict, available: int | None = None) -> str | None:
    """Why the baselines must run after the specmesh modes instead of between them; None when they can interleave."""
    if args.baseline_cpus:
        return "--baseline-cpus pins the baselines to other CPUs than the workers'"
    needed = baseline_bytes(args, modes, info["worker_weights"])
    if not needed:
        return None
    available = available_memory_bytes() if available is None else available
    if available is not None and available < needed + HEADROOM_BYTES:
        return (f"the baselines' models need about {needed / 2**30:.1f} GiB besides the workers' and "
                f"{available / 2**30:.1f} GiB is available")
    return None
