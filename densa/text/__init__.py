"""Text, torch-free: tokenizer and chat templates, incremental detokenization with stop strings,
and turning a request's token deltas into text deltas (what the HTTP front does per request)."""
