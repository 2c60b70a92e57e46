"""Engine-core side: protocol, engine core, scheduler, KV cache."""
