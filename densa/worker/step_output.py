"""What the runner answers each step (ModelRunner.execute): plain data, the other half of the
step contract whose first half is sched/output.py's SchedulerOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from densa.cache.integrity import IntegrityViolation
from densa.ipc.messages import TokenLogprobs
from densa.sched.output import PackedPages
from densa.worker.prompt_logprobs import PromptLogprobs


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Requests the runner refused to compute: they touched a KV page they no longer own.
    failed: dict[str, IntegrityViolation] = field(default_factory=dict)
    # Requests that got no token for a reason of their own ("code: message"), e.g. logits with
    # no finite value to sample from, or a grammar that refused the token ("grammar_error: ...").
    # The engine ends exactly these with an error. A landing's writer that failed is here too.
    errors: dict[str, str] = field(default_factory=dict)
    # Verifying requests (speculative decoding): the proposed tokens accepted this step, which
    # come before the request's sampled token, and their logprobs where asked for.
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Only when the runner keeps hidden states (an MTP proposer reads them): each computed
    # request's final hidden states, one row per position of its chunk ([num_tokens, hidden]),
    # proposals included; the engine keeps the rows of the positions the step accepted.
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    # Requests that asked for their prompt's logprobs (echo): those of the prompt positions this
    # step computed (worker/prompt_logprobs.py).
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # The step's KVExports, by export id: the pages as they were before the step wrote any.
    exported: dict[str, PackedPages] = field(default_factory=dict)
    # Landings the tag check refused (their writers are among `errors`), for counting by kind.
    refused_landings: list[IntegrityViolation] = field(default_factory=list)
    # Seconds the step's batched integrity check took (what --kv-integrity costs a step).
    integrity_check_s: float = 0.0
