"""Samples to token ids and target masks: plain documents, prompt/completion, chat (records.py).

`mask[t]` says whether token t is a target, i.e. whether the loss counts
predicting it from the tokens before it. A document's first token never is
one (there is nothing before it); documents and pieces are packed without
crossing boundaries (runtime/parallelism/batch.py), so the mask is all that SFT adds.

- text: `prefix + encode(text) + [eod]`, no mask (every token a target);
- prompt/completion: `prefix + encode(prompt) + encode(completion) + [eos]`,
  targets the completion and the eos (TRL's `completion_only_loss`);
- chat: the ids are `apply_chat_template`'s: the chat template
  (tokenizer_config.json's `chat_template` or chat_template.jinja, Jinja2 in
  a sandbox as transformers renders it) renders the whole conversation, which
  is encoded once, without special tokens of the tokenizer's own (the template
  writes any bos it wants); nothing is appended, so a chat ends as its
  template ends it. The targets are the tokens that overlap the template's
  `{% generation %}` blocks when it has them (transformers'
  `return_assistant_tokens_mask`); a template without them is rendered turn by
  turn, and the text each assistant turn adds after the generation prompt
  is the target (ChatML: the content, `<|im_end|>` and the newline after it),
  everything else (system, user, the `<|im_start|>assistant` header) is not.

`prefix` is what the tokenizer itself puts before a text: the ids its
`tokenizer.json` post-processor adds (LLaMA's `<s>`; none for Qwen), as
`AutoTokenizer(text)` of transformers 5 does; `add_bos_token` in
tokenizer_config.json is not read (transformers 5 ignores it too when a
tokenizer.json is there), and a `bos_token` the post-processor does not
add is not put anywhere.

An SFT record with no target token (an empty completion after tokenization,
a conversation without an assistant turn) is an error naming the record, or
is skipped and counted (`no_target_skipped`) with `--skip-bad`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from hydraulis.data.readers import ReadCounts
from hydraulis.data.records import Chat, PromptCompletion, Sample, SkippableRecord
from hydraulis.data.tokenizer import Tokenizer, prefix_of
from hydraulis.errors import HydraulisError

MARKED = re.compile(r"\{%-?\s*generation\s*-?%\}")  # a template with transformers' assistant markers
_TRACKING: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("generation", default=None)


@dataclass(frozen=True)
class EncodedChunk:
    """A chunk of samples as the corpus stores them: tokens back to back, each document's length, the targets."""

    tokens: np.ndarray  # in the corpus's token dtype
    lengths: np.ndarray  # int64, one per document kept (end-of-document token included)
    mask: np.ndarray | None  # uint8 per token when the chunk holds an SFT record (ones for its texts); else None
    targets: int  # tokens the loss counts (module docstring)


def encode_samples(
    samples: Sequence[Sample], tok: Tokenizer, counts: ReadCounts, skip_bad: bool, dtype: np.dtype
) -> EncodedChunk:
    """Encode a chunk of samples in order, with one concatenation into `dtype` for the whole chunk (a document
    costs its tokenizer call and little else: no per-document arrays beyond the tokenizer's own)."""
    prefix = np.asarray(prefix_of(tok), dtype=np.int64)
    eod = np.asarray([tok.eod_id], dtype=np.int64)
    pieces: list[np.ndarray] = []
    masks: list[np.ndarray | int] = []  # a text's mask is its length (ones), made only if the chunk needs one
    lengths: list[int] = []
    targets = 0
    for s in samples:
        if isinstance(s, str):
            ids = tok.encode(s)
            pieces += (prefix, ids, eod) if len(prefix) else (ids, eod)
            n = len(prefix) + len(ids) + 1
            lengths.append(n)
            masks.append(n)
            targets += n - 1
            continue
        ids, mask = _prompt_completion(s, tok, prefix, eod) if isinstance(s, PromptCompletion) else _chat(s, tok)
        if not mask.any():
            if not skip_bad:
                raise SkippableRecord(f"{s.where}: {_no_target(s)}", "--skip-bad")
            counts.no_target_skipped += 1
            counts.documents -= 1
            counts.sft_records -= 1
            continue
        pieces.append(ids)
        masks.append(mask)
        lengths.append(len(ids))
        targets += int(np.count_nonzero(mask[1:]))
    tokens = np.concatenate(pieces, dtype=dtype, casting="unsafe") if pieces else np.empty(0, dtype=dtype)
    mask_all = None
    if any(not isinstance(m, int) for m in masks):
        mask_all = np.concatenate([np.ones(m, dtype=np.uint8) if isinstance(m, int) else m for m in masks])
    return EncodedChunk(tokens, np.asarray(lengths, dtype=np.int64), mask_all, targets)


def _no_target(s: PromptCompletion | Chat) -> str:
    if isinstance(s, PromptCompletion):
        return "the completion is empty after tokenization: nothing to train on"
    return "no assistant turn with any tokens: nothing to train on"


def _prompt_completion(
    s: PromptCompletion, tok: Tokenizer, prefix: np.ndarray, eod: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """prefix + prompt + completion + eos; the targets the completion and the eos (none if it is empty)."""
    prompt, completion = np.concatenate([prefix, tok.encode(s.prompt)]), tok.encode(s.completion)
    mask = np.zeros(len(prompt) + len(completion) + 1, dtype=np.uint8)
    if completion.size:
        mask[len(prompt) :] = 1
    return np.concatenate([prompt, completion, eod]), mask


def _chat(s: Chat, tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The conversation's ids, as apply_chat_template gives them, and its targets (module docstring)."""
    template = getattr(tok, "chat_template", None)
    if not template or not hasattr(tok, "encode_offsets"):
        where = getattr(tok, "source", tok.name)
        raise HydraulisError(
            f"{s.where}: chat records need a chat template, and the tokenizer {where} has none "
            "(tokenizer_config.json: chat_template); use prompt/completion records or another tokenizer"
        )
    render = functools.partial(_render, _compile(template), tok, s.where)
    messages = list(s.messages)
    text, spans = render(messages, False)
    if not MARKED.search(template):  # no {% generation %} blocks: what each assistant turn adds
        spans = _turn_spans(render, messages, text, s.where)
    ids, offsets = tok.encode_offsets(text)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for begin, end in spans:  # a token is a target when it overlaps a span (transformers' rule)
        mask[(offsets[:, 1] > begin) & (offsets[:, 0] < end)] = 1
    return ids, mask


def _turn_spans(render: Any, messages: list[dict[str, Any]], full: str, where: str) -> list[tuple[int, int]]:
    """The characters each assistant turn adds after the generation prompt, rendering turn by turn."""
    spans: list[tuple[int, int]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, _ = render(messages[:i], True)
        after, _ = render(messages[: i + 1], False)
        if not (before.startswith(done) and after.startswith(before)):
            raise HydraulisError(
                f"{where}: the chat template does not render this conversation turn by turn "
                f"(turn {i} changes the text before it), so the assistant tokens cannot be found"
            )
        spans.append((len(before), len(after)))
        done = after
    if not full.startswith(done):
        raise HydraulisError(f"{where}: the chat template renders the whole conversation unlike its turns")
    return spans


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """transformers' tojson: JSON as written, without Jinja's HTML escaping."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


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
    env.filters["tojson"] = _tojson
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise HydraulisError(f"the tokenizer's chat template is not valid Jinja2: {exc}") from None


def _generation_tag() -> Any:
    """`{% generation %}...{% endgeneration %}`, transformers' assistant-mask markers: renders its body and,
    while `_render` tracks, records where in the output the body went (as transformers' AssistantTracker)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                blocks, spans = tracking
                begin = sum(len(b) for b in blocks)
                spans.append((begin, begin + len(text)))
            return text

    return Generation


def _render(
    template: Any, tok: Tokenizer, where: str, messages: list[dict[str, Any]], generation: bool
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of its {% generation %} blocks."""
    from jinja2 import TemplateError

    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    token = _TRACKING.set((blocks, spans))
    try:
        for block in template.generate(
            messages=messages,
            add_generation_prompt=generation,
            bos_token=getattr(tok, "bos_token", None) or "",
            eos_token=getattr(tok, "eos_token", None) or "",
        ):
            blocks.append(block)
    except TemplateError as exc:
        raise HydraulisError(f"{where}: the chat template refused this conversation: {exc}") from None
    finally:
        _TRACKING.reset(token)
    return "".join(blocks), spans
