"""Speculative decoding: proposals for a decoding request's next tokens, verified by the
target model in the step that runs them (the scheduler schedules them, the model runner
keeps the longest run the model agrees with; see SpeculativeConfig).

MAX_STEP_ROWS bounds a step's decode rows plus proposals: up to it, GGUF linears
multiply the rows in the int8 decode kernels (quantization.gguf.Q8_MAX_ROWS), whose
weights stream from memory once for all rows, so a verify step costs about one decode
step; past it a step would take other kernels (other numbers, and compute-bound), so
proposals step aside as the batch grows.
"""

from pagellm.spec_decode.ngram_proposer import NgramProposer

MAX_STEP_ROWS = 16

__all__ = ["MAX_STEP_ROWS", "NgramProposer"]
