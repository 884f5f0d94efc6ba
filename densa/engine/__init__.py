"""L6: the engine loop (schedule -> execute -> update), the offline LLM API, the async wrapper."""
