"""The public API's shapes, below both HTTP fronts (serve/ and router/) and the evaluations: what a
request and a response look like, how a request becomes an engine call, and how engine outputs
become response bodies and stream events. No HTTP server, no engine, no torch.

protocol        request / response bodies (pydantic), validated field by field
body, fields    the request body base; annotated field types: what each accepts, how it is published
unknown_fields  request fields the server does not know: dropped, warned about, named in a header
headers         the headers densa adds to the API (session affinity, ignored fields)
errors          OpenAI-style error bodies and the exception handlers
prepare         HTTP request -> engine call: body, prompt tokens, context length, cache scope
templates       what a chat request adds to the chat template (chat_template_kwargs, effort)
responses       engine outputs -> response bodies, stream chunks and logprobs
framing         how a stream is shaped per API: formatter protocol, event framing
fim             fill-in-the-middle prompts from a model's FIM tokens (completions suffix, /infill)
infill          llama.cpp's /infill: its request, its response shape
blocks          a generation as content blocks (text, reasoning, tool calls): Messages, Responses
reasoning       a reasoning model's answer -> reasoning_content and content (--reasoning-parser)
http_protocol   uvicorn's HTTP/1.1 protocol with a deadline on request headers (both fronts)
tools/          tool calls and structured output: models, formats, parser, prompts, schema checks
anthropic_api/  Anthropic Messages: models, the translation to chat, the formatter
responses_api/  OpenAI Responses: models, the translation to chat, the formatter
"""
