"""The server's routes, one module per API; what they share is in serve/pipeline.py.

open       /health, /metrics: no key needed
openai     /v1/models, /v1/chat/completions, /v1/completions
messages   Anthropic's /v1/messages and /v1/messages/count_tokens
responses  OpenAI's /v1/responses
tokenize   vLLM's /tokenize and /detokenize
infill     llama.cpp's /infill (fill-in-the-middle)
"""
