"""OpenAI's Responses API (`POST /v1/responses`), the stateless subset, on densa's chat pipeline:
the request is translated into a chat request, the engine outputs into a response object or its
stream of events (docs/serving.md, "OpenAI Responses").

    models.py     the request, the response object, its output items and stream events
    to_chat.py    the request as a ChatCompletionRequest
    formatter.py  engine outputs as a response object or as events
"""
