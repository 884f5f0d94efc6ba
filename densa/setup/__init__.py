"""Engine construction, apart from the loop (engine/): options (`EngineArgs`, the command line's
engine group) -> a frozen `EngineConfig` with one sub-config per part -> the parts (model,
tokenizer, sized KV cache, model runner, proposer) that `LLMEngine` is made of."""
