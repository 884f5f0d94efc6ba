"""L5: the model runner (batch preparation, KV tensors, forward, sampling)."""
