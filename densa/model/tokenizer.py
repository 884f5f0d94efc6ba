"""Tokenizer and chat template, loaded from the model directory (GGUF tokenizers are converted)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, cast

from densa.model.arch import ModelLoadError


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


class Tokenizer:
    """A thin wrapper over a Hugging Face fast tokenizer: the few calls the engine needs."""

    def __init__(self, model_dir: Path, eos_token_ids: tuple[int, ...] = ()) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(model_dir))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {exc}") from exc
        ids = set(eos_token_ids)
        if self._tok.eos_token_id is not None:
            ids.add(int(self._tok.eos_token_id))
        self.eos_token_ids = tuple(sorted(ids))
        self.vocab_size = len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template itself renders `tools` (else densa renders them as text)."""
        template = getattr(self._tok, "chat_template", None)
        return isinstance(template, str) and "tools" in template

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped Hugging Face tokenizer (the grammar engine builds its token trie from it)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return list(self._tok.convert_ids_to_tokens(token_ids))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return str(self._tok.convert_tokens_to_string(tokens))

    @property
    def all_special_ids(self) -> set[int]:
        return set(self._tok.all_special_ids)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the bytes of text one token stands for (special tokens included).

        Byte-level pieces spell each byte as one character of at most 2 UTF-8 bytes, so measuring
        the pieces can only overestimate, which keeps `serve.prepare.max_prompt_bytes` safe.
        """
        pieces = self._tok.convert_ids_to_tokens(list(range(len(self._tok))))
        return max(len(str(piece).encode("utf-8")) for piece in pieces if piece is not None)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        continue_final: bool = False,
    ) -> str:
        """The prompt text for a conversation, ending where the assistant's answer begins -- or,
        with continue_final, inside the final (assistant) message, so generation extends it."""
        if not self.has_chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions instead")
        try:
            return str(
                self._tok.apply_chat_template(
                    messages,
                    tools=cast(Any, tools),
                    add_generation_prompt=not continue_final,
                    continue_final_message=continue_final,
                    tokenize=False,
                )
            )
        except Exception as exc:  # jinja errors surface as many types
            raise ChatTemplateError(f"cannot apply the chat template: {exc}") from exc

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        # The template already contains the special tokens; do not add a BOS on top of it.
        text = self.render_chat(messages, tools, continue_final)
        return self.encode(text, add_special_tokens=False)
