"""Benchmarks behind `pagellm bench {throughput,latency,serve}`: synthetic workloads in,
timings and token counts out (printed, and as JSON). Knows the engine only through its
public API (`LLM`, `SamplingParams`) and servers only through OpenAI-compatible HTTP."""
