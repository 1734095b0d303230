"""Samples to token ids and target masks: plain documents, prompt/completion, chat (records.py).

`mask[t]` says whether token t is a target, i.e. whether the loss counts
predicting it from the tokens before it. A document's first token never is
one (there is nothing before it); documents and pieces are packed without
crossing boundaries (runtime/batch.py), so the mask is all that SFT adds.

- text: `prefix + encode(text) + [eod]`, no mask (every token a target);
- prompt/completion: `prefix + encode(prompt) + encode(completion) + [eos]`,
  targets the completion and the eos (TRL's `completion_only_loss`);
- chat: the chat template (tokenizer_config.json's `chat_template`, Jinja2
  in a sandbox as transformers renders it) renders the conversation turn by
  turn; the text each assistant turn adds after the generation prompt is
  the target, everything else (system, user, the `<|assistant|>` header)
  is not. The end-of-document token closes the document (not a target)
  unless the template already ended it with one.

An SFT record with no target token (an empty completion after tokenization,
a conversation without an assistant turn) is an error naming the record, or
is skipped and counted (`no_target_skipped`) with `--skip-bad`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from hydraulis.data.readers import ReadCounts
from hydraulis.data.records import Chat, PromptCompletion, Sample, SkippableRecord
from hydraulis.data.tokenizer import Tokenizer, prefix_of
from hydraulis.errors import HydraulisError


@dataclass(frozen=True)
class Encoded:
    """One document's ids (eod included) and its target mask (None: every token is a target)."""

    ids: np.ndarray
    mask: np.ndarray | None


def encode_samples(samples: Sequence[Sample], tok: Tokenizer, counts: ReadCounts, skip_bad: bool) -> list[Encoded]:
    """Encode a chunk of samples in order; plain texts in one batch call (tiktoken's threads)."""
    prefix = np.asarray(prefix_of(tok), dtype=np.int64)
    eod = np.asarray([tok.eod_id], dtype=np.int64)
    texts = [s for s in samples if isinstance(s, str)]
    plain = iter(tok.encode_batch(texts)) if texts else iter(())
    out = []
    for s in samples:
        if isinstance(s, str):
            out.append(Encoded(np.concatenate([prefix, next(plain), eod]), None))
            continue
        parts = _prompt_completion(s, tok, prefix) if isinstance(s, PromptCompletion) else _chat(s, tok)
        ids = np.concatenate([p for p, _ in parts])
        mask = np.concatenate([np.full(len(p), m, dtype=np.uint8) for p, m in parts])
        if not mask.any():
            if not skip_bad:
                raise SkippableRecord(f"{s.where}: {_no_target(s)}", "--skip-bad")
            counts.no_target_skipped += 1
            counts.documents -= 1
            counts.sft_records -= 1
            continue
        if not (isinstance(s, Chat) and len(ids) and ids[-1] == tok.eod_id):
            ids = np.concatenate([ids, eod])
            mask = np.append(mask, np.uint8(isinstance(s, PromptCompletion)))
        out.append(Encoded(ids, mask))
    return out


def _no_target(s: PromptCompletion | Chat) -> str:
    if isinstance(s, PromptCompletion):
        return "the completion is empty after tokenization: nothing to train on"
    return "no assistant turn with any tokens: nothing to train on"


def _prompt_completion(s: PromptCompletion, tok: Tokenizer, prefix: np.ndarray) -> list[tuple[np.ndarray, int]]:
    completion = tok.encode(s.completion)
    if completion.size == 0:
        return [(np.concatenate([prefix, tok.encode(s.prompt)]), 0)]
    return [(np.concatenate([prefix, tok.encode(s.prompt)]), 0), (completion, 1)]


def _chat(s: Chat, tok: Tokenizer) -> list[tuple[np.ndarray, int]]:
    """The conversation as (ids, is_target) segments, rendered turn by turn (see the module docstring)."""
    template = getattr(tok, "chat_template", None)
    if not template:
        where = getattr(tok, "source", tok.name)
        raise HydraulisError(
            f"{s.where}: chat records need a chat template, and the tokenizer {where} has none "
            "(tokenizer_config.json: chat_template); use prompt/completion records or another tokenizer"
        )
    render = functools.partial(_render, _compile(template), tok, s.where)
    texts: list[tuple[str, int]] = []
    done = ""
    messages = list(s.messages)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        after = render(messages[: i + 1], False)
        if not (before.startswith(done) and after.startswith(before)):
            raise HydraulisError(
                f"{s.where}: the chat template does not render this conversation turn by turn "
                f"(turn {i} changes the text before it), so the assistant tokens cannot be found"
            )
        texts += [(before[len(done) :], 0), (after[len(before) :], 1)]
        done = after
    full = render(messages, False)
    if not full.startswith(done):
        raise HydraulisError(f"{s.where}: the chat template renders the whole conversation unlike its turns")
    texts.append((full[len(done) :], 0))
    texts = [(t, m) for t, m in texts if t]
    ids = tok.encode_batch([t for t, _ in texts]) if texts else []
    return [(a, m) for a, (_, m) in zip(ids, texts, strict=True) if a.size]


@functools.cache
def _compile(template: str) -> Any:
    """The template in a sandboxed Jinja2 environment, configured as transformers configures it."""
    try:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise HydraulisError("chat records need Jinja2: pip install 'hydraulis[data]'") from None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_tag()]
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise HydraulisError(f"the tokenizer's chat template is not valid Jinja2: {exc}") from None


def _generation_tag() -> Any:
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers) render their body:
    the turn-by-turn rendering finds the assistant tokens without them."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return Generation


def _render(template: Any, tok: Tokenizer, where: str, messages: list[dict[str, Any]], generation: bool) -> str:
    from jinja2 import TemplateError

    try:
        return template.render(
            messages=messages,
            add_generation_prompt=generation,
            bos_token=getattr(tok, "bos_token", None) or "",
            eos_token=getattr(tok, "eos_token", None) or "",
        )
    except TemplateError as exc:
        raise HydraulisError(f"{where}: the chat template refused this conversation: {exc}") from None
