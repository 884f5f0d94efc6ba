"""Tool calls and structured output at the HTTP front: request models, how tool definitions and
calls are written into a prompt, how calls are read back out of generated text (per model
family: the dialects in formats.py's registry), the grammars that constrain `tool_choice`
required / named, and which JSON-schema features the grammar engine supports.

    formats.py    the registry, and the choice from a chat template
    base.py       what a dialect provides; events.py what its parser reports
    json_calls.py hermes, llama3_json       marked.py   the parser of marker-wrapped dialects
    kimi_k2.py, deepseek.py, xml_args.py (glm, qwen3_coder), mistral.py
    lark.py       grammar literals, marker tokens matched as tokens
    plan.py, render.py, models.py, schema_check.py, parser.py, deltas.py

Nothing here imports torch or the grammar engine: the front only builds plain-text constraints
(`StructuredOutput`), which the engine compiles (densa/worker/grammar.py).
"""
