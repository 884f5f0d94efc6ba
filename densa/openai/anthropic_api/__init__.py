"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on densa's chat
pipeline: the request is translated into a chat request, the engine outputs into a Message or its
stream of events (docs/serving.md, "Anthropic Messages").

    models.py     the request, the Message, its stream events and error bodies
    to_chat.py    the request as a ChatCompletionRequest
    formatter.py  engine outputs as a Message or as events; errors in Anthropic's shape
"""
