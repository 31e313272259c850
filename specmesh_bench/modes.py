"""Benchmark modes: specmesh (target-only, speculative with a draft model or n-grams, adaptive or fixed k), in-process
Hugging Face baselines and llama.cpp baselines; and which of them can run for a given target."""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.runtime.engine import ik_available, is_gguf_spec, llamacpp_available
from specmesh.wire.limits import DEFAULT_MAX_DRAFT_TOKENS

DEFAULT_MODES = ("target-only,hybrid,adaptive,adaptive-cost,pipelined,4,ngram,hf-assisted,hf-target,ik-target,llama-target,"
                 "llama-lookup")
BASELINE = "target-only"  # every speedup is relative to specmesh target-only
HF_BASELINE = "hf-target"
LLAMA_BASELINE = "llama-target"
IK_BASELINE = "ik-target"
# The engines' own loops, each a column of speedups: (mode, row key, column title).
ENGINE_BASELINES = ((LLAMA_BASELINE, "speedup_vs_llama_target", "vs llama.cpp target-only"),
                    (IK_BASELINE, "speedup_vs_ik_target", "vs ik_llama.cpp target-only"))


@dataclass(frozen=True)
class Mode:
    name: str  # as shown in tables
    kind: str  # "specmesh", "hf", "llamacpp" or "ik"
    drafter: str | None = None  # specmesh: None (target-only), "model", "ngram", "suffix" or "hybrid" (suffix + model);
    #                             hf: "model", "ngram" or None;
    #                             llamacpp: None (llama-target) or "ngram" (llama-lookup)
    k: int | None = None  # specmesh: draft length, None = adaptive
    policy: str = "heuristic"  # specmesh adaptive k: coordinator/drafting/policies.py
    pipeline: bool = False  # specmesh: draft the next round during this round's verify
    stream_guesses: bool = True  # specmesh: streamed steps check a free guess of the next token (DecodeRequest.guess)

    @property
    def coordinator(self) -> str | None:
        """Which of the bench's coordinators runs it (specmesh modes): one per drafter, and another, with a suffix
        drafter of its own, for the hybrid without guesses (a suffix drafter's trees learn from every generation: a
        shared one would hand the second hybrid mode the first one's answer to the same prompt)."""
        return "hybrid-no-guesses" if self.drafter == "hybrid" and not self.stream_guesses else self.drafter


def parse_mode(text: str) -> Mode:
    t = text.strip().lower()
    if t in ("0", "target-only", "target"):
        return Mode(BASELINE, "specmesh", None, 0)
    if t == "adaptive":
        return Mode("adaptive", "specmesh", "model", None)
    if t in ("pipelined", "adaptive-pipelined"):
        return Mode("pipelined", "specmesh", "model", None, "heuristic", True)
    if t in ("pipelined-cost", "cost-pipelined"):
        return Mode("pipelined-cost", "specmesh", "model", None, "cost", True)
    if t in ("adaptive-cost", "cost"):
        return Mode("adaptive-cost", "specmesh", "model", None, "cost")
    if t == "ngram-cost":
        return Mode("ngram-cost", "specmesh", "ngram", None, "cost")
    if t.isdigit():
        return Mode(f"k={int(t)}", "specmesh", "model", int(t))
    if t.startswith("k=") and t[2:].isdigit():
        return Mode(f"k={int(t[2:])}", "specmesh", "model", int(t[2:]))
    if t == "ngram":
        return Mode("ngram", "specmesh", "ngram", None)
    if t == "suffix":
        return Mode("suffix", "specmesh", "suffix", None)
    if t == "suffix-cost":
        return Mode("suffix-cost", "specmesh", "suffix", None, "cost")
    if t == "hybrid":  # the default: suffix drafts where the match is long, the model's elsewhere (coordinator/drafting/)
        return Mode("hybrid", "specmesh", "hybrid", None, "cost")
    if t == "hybrid-no-guesses":  # the default without the streams' free guesses: what they add, side by side
        return Mode("hybrid-no-guesses", "specmesh", "hybrid", None, "cost", stream_guesses=False)
    if t.startswith(("ngram:", "ngram=", "ngram k=")) and t.rpartition("=" if "=" in t else ":")[2].isdigit():
        k = int(t.rpartition("=" if "=" in t else ":")[2])
        return Mode(f"ngram k={k}", "specmesh", "ngram", k)
    if t in ("hf-target", "hf"):
        return Mode(HF_BASELINE, "hf")
    if t == "hf-assisted":
        return Mode("hf-assisted", "hf", "model")
    if t in ("hf-ngram", "hf-prompt-lookup"):
        return Mode("hf-ngram", "hf", "ngram")
    if t in ("llama-target", "llama", "llamacpp-target", "llamacpp"):
        return Mode(LLAMA_BASELINE, "llamacpp")
    if t in ("llama-lookup", "llama-prompt-lookup", "llamacpp-lookup"):
        return Mode("llama-lookup", "llamacpp", "ngram")
    if t in ("ik-target", "ik"):
        return Mode(IK_BASELINE, "ik")
    raise ValueError(f"unknown mode {text!r}: expected target-only|0, adaptive, adaptive-cost, pipelined, "
                     "pipelined-cost, K, ngram, "
                     "ngram-cost, ngram:K, suffix, suffix-cost, hybrid, hybrid-no-guesses, hf-target, hf-assisted, hf-ngram, ik-target, llama-target or llama-lookup")


def parse_modes(text: str) -> list[Mode]:
    modes: list[Mode] = []
    for part in text.split(","):
        if part.strip():
            mode = parse_mode(part)
            if mode.k is not None and mode.kind == "specmesh" and not 0 <= mode.k <= DEFAULT_MAX_DRAFT_TOKENS:
                raise ValueError(f"draft length must be in 0..{DEFAULT_MAX_DRAFT_TOKENS}, got {mode.k}")
            if mode not in modes:
                modes.append(mode)
    if parse_mode(BASELINE) not in modes:  # every speedup is relative to it
        modes.insert(0, parse_mode(BASELINE))
    return modes


def llama_skip_reason(target_model: str, kind: str = "llamacpp") -> str | None:
    """Why the llama.cpp (or ik_llama.cpp) baselines cannot run for this target (None: they can)."""
    if not is_gguf_spec(target_model):
        return (f"the target {target_model!r} is not a GGUF model (a catalog name or a .gguf path); "
                "the llama.cpp baselines run GGUF files only")
    if kind == "ik" and not ik_available():
        return "ik_llama.cpp does not load here (pip install ik-llama-cpp-python; x86-64 Linux)"
    if kind == "llamacpp" and not llamacpp_available():
        return "llama-cpp-python is not installed (pip install llama-cpp-python, or the project's [llamacpp] extra)"
    return None


def drop_unrunnable(modes: list[Mode], target_model: str) -> tuple[list[Mode], dict[str, str]]:
    """(the modes that can run, {skipped mode: reason}): the engines' own loops need a GGUF target and their package.
    Skipping is not an error: the default mode list holds them, and most test models are not GGUF."""
    skipped = {m.name: reason for m in modes if m.kind in ("llamacpp", "ik")
               and (reason := llama_skip_reason(target_model, m.kind))}
    return [m for m in modes if m.name not in skipped], skipped
