"""Fill-in-the-middle prompts, built from the model's own FIM tokens.

Editor plugins send the code before and after the cursor and want the middle. A code model that
was trained for it (Qwen2.5-Coder, StarCoder, DeepSeek-Coder, CodeLlama, ...) has tokens that mark
the three parts; densa finds them in the tokenizer by the spellings llama.cpp recognises
(src/llama-vocab.cpp) and lays the prompt out as llama.cpp's server does (format_prompt_infill):

    /infill, with the repo-level tokens (Qwen2.5-Coder's <|repo_name|>, <|file_sep|>):
        [REPO] "myproject\\n"
        [SEP] filename "\\n" text          one per input_extra chunk
        [SEP] "filename\\n"
        [BOS] [PRE] input_prefix prompt [SUF] input_suffix [MID]
    without them, each input_extra chunk is "\\n\\n--- snippet ---\\n\\n" text, and no header.

    /v1/completions with `suffix` (OpenAI's form has no other files):
        [BOS] [PRE] prompt [SUF] suffix [MID]

The markers go in as their token ids; the code around them is encoded as plain text
(Tokenizer.encode_plain), so a file that spells "<|fim_suffix|>" cannot move the parts around.
Only /infill's `prompt`, text the client writes after the prefix, may hold special tokens (as in
llama.cpp). [BOS] is whatever the tokenizer puts before a text (nothing for Qwen). What the model
writes ends at the end of the text or at a token that starts another part of a repository (FIM_PAD,
REPO, SEP), as in llama.cpp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from densa.text.tokenizer import Tokenizer

# Spellings of each FIM token, by role, in the order llama.cpp looks for them.
SPELLINGS: dict[str, tuple[str, ...]] = {
    "prefix": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
               "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "suffix": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
               "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
               "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "repo": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "file_sep": ("<|file_sep|>",),
    # The end of a text, where a model trained on whole files ends a middle.
    "end": ("<|endoftext|>",),
}  # fmt: skip
REPO_NAME = "myproject"  # llama.cpp's: the request does not name its project
FILE_NAME = "filename"  # ... nor the file being edited
EXTRA_FILE_NAME = "tmp"  # an input_extra chunk without a filename
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between chunks when there is no SEP token


class FimUnsupported(ValueError):
    """The tokenizer has no FIM tokens: the model was not trained to fill in the middle."""


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file_sep: int | None = None
    pad: int | None = None
    end: int | None = None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end the middle, besides the model's EOS."""
        ends = (self.pad, self.repo, self.file_sep, self.end)
        return tuple(t for t in ends if t is not None)


@dataclass(frozen=True)
class ExtraChunk:
    """Another file of the project, for context (an /infill input_extra entry)."""

    text: str
    filename: str = EXTRA_FILE_NAME


@dataclass(frozen=True)
class FimPrompt:
    token_ids: list[int]
    stop_token_ids: tuple[int, ...]
    num_extra_dropped: int = 0  # leading input_extra tokens left out to fit the context


def fim_tokens(tokenizer: Tokenizer) -> FimTokens:
    """The tokenizer's FIM tokens; FimUnsupported (saying which are missing) without them."""
    found = {role: _find(tokenizer, spellings) for role, spellings in SPELLINGS.items()}
    missing = [role for role in ("prefix", "suffix", "middle") if found[role] is None]
    if missing:
        wanted = ", ".join(SPELLINGS[role][0] for role in missing)
        raise FimUnsupported(
            f"this model cannot fill in the middle: its tokenizer has no {wanted} token "
            "(or another spelling of it); serve a code model trained for FIM, such as "
            "Qwen2.5-Coder, or send the prompt without a suffix"
        )
    prefix, suffix, middle = (found[role] for role in ("prefix", "suffix", "middle"))
    assert prefix is not None and suffix is not None and middle is not None
    return FimTokens(prefix, suffix, middle, found["repo"], found["file_sep"], found["pad"],
                     found["end"])  # fmt: skip


def _find(tokenizer: Tokenizer, spellings: Sequence[str]) -> int | None:
    for text in spellings:
        token_id = tokenizer.token_id(text)
        if token_id is not None:
            return token_id
    return None


def completion_prompt(tokenizer: Tokenizer, prompt: str, suffix: str) -> FimPrompt:
    """/v1/completions with `suffix`: [BOS] [PRE] prompt [SUF] suffix [MID]."""
    fim = fim_tokens(tokenizer)
    ids = [*_bos(tokenizer), fim.prefix, *tokenizer.encode_plain(prompt), fim.suffix,
           *tokenizer.encode_plain(suffix), fim.middle]  # fmt: skip
    return FimPrompt(ids, fim.stop_token_ids)


def infill_prompt(
    tokenizer: Tokenizer,
    input_prefix: str,
    input_suffix: str,
    extra: Sequence[ExtraChunk] = (),
    prompt: str = "",
    max_prompt_tokens: int | None = None,
) -> FimPrompt:
    """llama.cpp's /infill layout (module docstring). When the whole does not fit in
    `max_prompt_tokens`, the oldest tokens of the extra context are left out, as llama.cpp
    does; the prefix, suffix and prompt never are (the caller refuses a prompt still too long)."""
    fim = fim_tokens(tokenizer)
    head = _extra_context(tokenizer, fim, extra)
    body = [*_bos(tokenizer), fim.prefix, *tokenizer.encode_plain(input_prefix),
            *tokenizer.encode(prompt, add_special_tokens=False), fim.suffix,
            *tokenizer.encode_plain(input_suffix), fim.middle]  # fmt: skip
    num_dropped = 0
    if max_prompt_tokens is not None and len(head) + len(body) > max_prompt_tokens:
        num_dropped = min(len(head), len(head) + len(body) - max_prompt_tokens)
    return FimPrompt(head[num_dropped:] + body, fim.stop_token_ids, num_dropped)


def _extra_context(tokenizer: Tokenizer, fim: FimTokens, extra: Sequence[ExtraChunk]) -> list[int]:
    ids: list[int] = []
    if fim.repo is not None:
        ids += [fim.repo, *tokenizer.encode_plain(REPO_NAME + "\n")]
    for chunk in extra:
        if fim.file_sep is not None:
            ids += [fim.file_sep, *tokenizer.encode_plain(chunk.filename + "\n")]
        else:
            ids += tokenizer.encode_plain(SNIPPET_SEPARATOR)
        ids += tokenizer.encode_plain(chunk.text)
    if fim.file_sep is not None:
        ids += [fim.file_sep, *tokenizer.encode_plain(FILE_NAME + "\n")]
    return ids


def _bos(tokenizer: Tokenizer) -> list[int]:
    """What the tokenizer puts before every text (a BOS token, or nothing)."""
    return tokenizer.encode("", add_special_tokens=True)
