"""Text <-> token ids and chat templates, torch-free: the `tokenizers` library and a sandboxed Jinja
environment, nothing else.

The HTTP front, the router and the engine all use this class, so a prompt tokenizes to the same
ids wherever it is seen, and importing it costs milliseconds (no transformers, no torch). It reads
what Hugging Face tokenizer folders hold: `tokenizer.json` (the whole tokenizer), and
`tokenizer_config.json` (special tokens, the chat template) or `chat_template.jinja`. Tests check
it against transformers' AutoTokenizer on the same folder, token for token and text for text.

The files can also come as bytes (`TokenizerFiles`), which is how the engine process hands its
tokenizer to a front on another host in the handshake.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from densa.ipc.messages import TokenizerFiles

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                       "mask_token")  # fmt: skip
# Appended to the final message to find where it ends once rendered (as transformers does).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


class TokenizerLoadError(ValueError):
    """The tokenizer files are missing or unreadable."""


def read_tokenizer_files(folder: Path) -> TokenizerFiles:
    """A tokenizer folder's files as data (TokenizerFiles, in ipc/messages.py: the engine
    sends them to every front)."""

    def text(name: str) -> str | None:
        path = folder / name
        return path.read_text(encoding="utf-8") if path.is_file() else None

    tokenizer_json = text(TOKENIZER_FILE)
    if tokenizer_json is None:
        raise TokenizerLoadError(f"{folder} has no {TOKENIZER_FILE}")
    return TokenizerFiles(compact_merges(tokenizer_json), text(CONFIG_FILE), text(TEMPLATE_FILE))


def compact_merges(tokenizer_json: str) -> str:
    """The same tokenizer with its BPE merges written as "a b" strings instead of ["a", "b"]
    pairs (both forms load as the same model), unless a merged piece holds a space.

    Why: the `tokenizers` parser buffers the whole model section before building it, and a
    pair costs it far more than a string: for Qwen2.5's 150k tokens the parse peaks 131 MB
    above the text with pairs, 75 MB with strings. Every process that parses the text gains
    (the engine, each HTTP front, which get it in the handshake). Unreadable JSON is returned
    as it came, for the tokenizer's own error."""
    try:
        data = json.loads(tokenizer_json)
        merges = data["model"]["merges"]
    except (ValueError, KeyError, TypeError):
        return tokenizer_json
    if not merges or not all(isinstance(m, list) and len(m) == 2 for m in merges):
        return tokenizer_json
    if any(" " in piece for pair in merges for piece in pair):
        return tokenizer_json  # "a b" would split such a piece at its own space
    data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(data, ensure_ascii=False)


class Tokenizer:
    """The few calls densa needs: encode, decode, token pieces, and chat rendering."""

    def __init__(
        self,
        files: TokenizerFiles,
        eos_token_ids: tuple[int, ...] = (),
        shown_special_tokens: tuple[str, ...] = (),
    ) -> None:
        """shown_special_tokens: special tokens decoding keeps even when it skips special tokens
        (a reasoning model's `<think>` where it is one: the front splits the text at it)."""
        try:
            self._loaded: Any = _rust_tokenizer(files)
            config = json.loads(files.config_json) if files.config_json else {}
        except (ValueError, Exception) as exc:  # the Rust side raises its own exception type
            raise TokenizerLoadError(f"cannot read the tokenizer: {exc}") from exc
        self.files = files
        self._special_tokens = {k: _token_text(config.get(k)) for k in _SPECIAL_TOKEN_KEYS}
        self.chat_template: str | None = files.chat_template or _config_template(config)
        eos = self._special_tokens.get("eos_token")
        eos_id = self._tok.token_to_id(eos) if eos is not None else None
        ids = set(eos_token_ids) | ({int(eos_id)} if eos_id is not None else set())
        self.eos_token_ids = tuple(sorted(ids))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        added = self._tok.get_added_tokens_decoder()  # id -> AddedToken
        self.all_special_ids: set[int] = {i for i, token in added.items() if token.special}
        shown = {self._tok.token_to_id(text) for text in shown_special_tokens}
        self._skipped_ids = self.all_special_ids - shown
        self._plain: Any = None  # encode_plain's tokenizer, built on first use

    @classmethod
    def from_dir(cls, folder: Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        return cls(read_tokenizer_files(folder), eos_token_ids)

    @property
    def _tok(self) -> Any:
        if self._loaded is None:
            self._loaded = _rust_tokenizer(self.files)
        return self._loaded

    @property
    def is_loaded(self) -> bool:
        """Whether the Rust tokenizer is in memory (see `release`)."""
        return self._loaded is not None

    def release(self) -> None:
        """Drop the Rust tokenizer until a call needs it again (then it is rebuilt from `files`).

        A 150k-token vocabulary holds ~60 MB once built and ~135 MB while it is parsed; an engine
        behind an HTTP front only needs what `__init__` read from it (EOS ids, vocabulary size,
        special ids), which stay. Call `densa.utils.heap.return_free_heap` after it: the Rust
        side frees to the C heap."""
        self._loaded = self._plain = None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template itself renders `tools` (else densa renders them as text)."""
        return bool(self.chat_template) and "tools" in str(self.chat_template)

    @property
    def template_renders_tool_calls(self) -> bool:
        """Whether the chat template itself writes assistant `tool_calls` (and tool results)."""
        return bool(self.chat_template) and "tool_calls" in str(self.chat_template)

    def template_reads(self, name: str) -> bool:
        """Whether the chat template mentions the variable `name` (e.g. reasoning_effort)."""
        return bool(self.chat_template) and name in str(self.chat_template)

    # ---- tokens ----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_plain(self, text: str) -> list[int]:
        """`text` as plain text: a special token's spelling in it ("<|im_end|>" in a source file)
        is tokenized as the characters it is, never as that token, and nothing is added.

        A second Rust tokenizer does it, built on first use (the setting is per tokenizer, and
        `encode` runs on several threads at once): as much memory again as the first."""
        if self._plain is None:
            plain = _rust_tokenizer(self.files)
            plain.encode_special_tokens = True
            self._plain = plain
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled exactly `text` (added or in the vocabulary), if any."""
        token_id = self._tok.token_to_id(text)
        return None if token_id is None else int(token_id)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and len(self._skipped_ids) < len(self.all_special_ids):
            token_ids = [t for t in token_ids if t not in self._skipped_ids]
            skip_special_tokens = False
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [self._tok.id_to_token(t) or "" for t in token_ids]

    @functools.cached_property
    def added_tokens(self) -> dict[str, int]:
        """Every added token (text -> id): the tokenizer splits these out of text before anything
        else, so text that contains one encodes it as that single token."""
        return {t.content: int(i) for i, t in self._tok.get_added_tokens_decoder().items()}

    @functools.cached_property
    def verbatim_added_tokens(self) -> dict[str, int] | None:
        """Added tokens (text -> id) if every one is matched verbatim in text -- not normalized,
        not stripping neighbouring spaces, not whole-word only -- else None.

        The tokenizer splits such tokens out before normalizing and pre-tokenizing, so a text
        encodes as the pieces between them encoded one by one (the router caches the pieces).
        """
        tokens = {}
        for token_id, token in self._tok.get_added_tokens_decoder().items():
            if token.normalized or token.lstrip or token.rstrip or token.single_word:
                return None
            tokens[token.content] = int(token_id)
        return tokens

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the bytes of text one token stands for (special tokens included).

        Byte-level pieces spell each byte as one character of at most 2 UTF-8 bytes, so measuring
        the pieces can only overestimate, which keeps `openai.prepare.max_prompt_bytes` safe.
        """
        pieces = (self._tok.id_to_token(i) for i in range(self.vocab_size))
        return max(len(piece.encode("utf-8")) for piece in pieces if piece is not None)

    # ---- chat ------------------------------------------------------------------------------------
    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        continue_final: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation, ending where the assistant's answer begins -- or,
        with continue_final, inside the final message, so generation extends it. `variables`:
        more for the template to read (e.g. enable_thinking), never the ones set here."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions instead")
        import jinja2

        chat = json.loads(json.dumps(messages))  # plain JSON data only, and a private copy
        _arguments_as_both(chat)
        if continue_final:
            if not chat or not isinstance(chat[-1].get("content"), str):
                raise ChatTemplateError("the final message has no text content to continue")
            final = chat[-1]["content"]
            chat[-1]["content"] = final + _CONTINUE_TAG
        try:
            rendered = _compile(self.chat_template).render(
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=not continue_final,
                **{k: v for k, v in self._special_tokens.items() if v is not None},
                **json.loads(json.dumps(dict(variables or {}))),  # plain JSON data, a copy
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"cannot apply the chat template: {exc}") from exc
        except Exception as exc:  # templates are code: any error is the template's
            raise ChatTemplateError(f"cannot apply the chat template: {exc!r}") from exc
        return _cut_at_continue_tag(rendered, final) if continue_final else rendered

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        continue_final: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        # The template already contains the special tokens; do not add a BOS on top of it.
        return self.encode(self.render_chat(messages, tools, continue_final, variables), False)


class _JsonArguments(dict[str, Any]):
    """A call's arguments as templates take them either way: an object (`.items()`, `tojson`,
    `is mapping`: Hugging Face's convention) that joins text with `+` and prints as its JSON
    text (templates written for OpenAI's string arguments, such as DeepSeek's)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other: Any) -> Any:
        return str(self) + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return other + str(self) if isinstance(other, str) else NotImplemented


def _arguments_as_both(chat: list[dict[str, Any]]) -> None:
    for message in chat:
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), dict):
                function["arguments"] = _JsonArguments(function["arguments"])


def _rust_tokenizer(files: TokenizerFiles) -> Any:
    from tokenizers import Tokenizer as RustTokenizer

    return RustTokenizer.from_str(files.tokenizer_json)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_template(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _cut_at_continue_tag(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "the chat template drops part of the final message, so it cannot be continued"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    """The template in a sandbox with the helpers chat templates expect (as transformers sets
    them up): `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and
    `{% break %}` / `{% continue %}`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)  # fmt: skip

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
