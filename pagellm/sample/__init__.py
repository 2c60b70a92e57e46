"""Sampling: SamplingMetadata (batched parameters) in, sampled token ids and logprobs out."""

from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import LogprobsTensors, Sampler, SamplerOutput

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata"]
