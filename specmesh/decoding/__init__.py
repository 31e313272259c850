"""The decoding math, free of models and of the network: the warpers (temperature, top-k, top-p) shared by drafter and
verifier, sampling and the sparse distributions the drafter sends, and the accept/reject rule of speculative
sampling (greedy prefix matching, or Leviathan et al.'s min(1, p/q) test with the residual distribution) that keeps
the output exactly the target's."""
