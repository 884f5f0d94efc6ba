"""Tool calls and structured output at the HTTP front: request models, how tool definitions and
calls are written into a prompt, how calls are read back out of generated text (per model
family, in a registry), the grammars that constrain `tool_choice` required / named, and which
JSON-schema features the grammar engine supports.

Nothing here imports torch or the grammar engine: the front only builds plain-text constraints
(`StructuredOutput`), which the engine compiles (densa/worker/grammar.py).
"""
