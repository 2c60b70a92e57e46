"""Building blocks shared by the model families: norms, rotary embeddings, activations,
fused linear layers and the paged attention layer. Layers know tensors and configs,
never requests or the scheduler."""
