"""The one greedy threshold, in a module of its own so that the request schemas and the logprobs can read it
without importing the acceptance code (and transformers with it)."""

#: A temperature at or below it decodes greedily (no sampler, no logits processors).
GREEDY_TEMPERATURE = 1e-5
