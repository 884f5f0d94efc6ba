"""What a chat request adds to the chat template's variables: `chat_template_kwargs` as given,
and `reasoning_effort` where the template can use it.

    reasoning_effort    the template reads...      it becomes
    any                 reasoning_effort           reasoning_effort (gpt-oss style templates)
    "none"              enable_thinking            enable_thinking = false (Qwen3, GLM 4.5)
    anything else       neither                    nothing: ignored like an unknown field

An explicit chat_template_kwargs entry wins over the mapping. The router renders prompts with the
same function, so it hashes the same tokens the worker runs.
"""

from __future__ import annotations

from typing import Any

from densa.openai.protocol import ChatCompletionRequest
from densa.text.tokenizer import Tokenizer

EFFORT = "reasoning_effort"
THINKING_SWITCH = "enable_thinking"


def template_variables(tokenizer: Tokenizer, body: ChatCompletionRequest) -> dict[str, Any]:
    variables = dict(body.chat_template_kwargs or {})
    effort = body.reasoning_effort
    if effort is None:
        return variables
    if tokenizer.template_reads(EFFORT):
        variables.setdefault(EFFORT, effort)
    elif effort == "none" and tokenizer.template_reads(THINKING_SWITCH):
        variables.setdefault(THINKING_SWITCH, False)
    return variables


def unread_fields(tokenizer: Tokenizer, body: ChatCompletionRequest) -> list[str]:
    """Request fields that change nothing with this template (reported as ignored)."""
    if body.reasoning_effort is None or tokenizer.template_reads(EFFORT):
        return []
    if body.reasoning_effort == "none" and tokenizer.template_reads(THINKING_SWITCH):
        return []
    return [EFFORT]
