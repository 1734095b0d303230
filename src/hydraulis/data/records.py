"""Records of structured inputs (jsonl lines, parquet/arrow rows) as samples: text, or SFT data.

Three kinds of record, as Hugging Face TRL's SFT trainer reads them:

- `{"text": ...}` (or `--field`): a document; every token is a target;
- `{"prompt": ..., "completion": ...}`: the loss counts the completion only;
- `{"messages": [{"role": ..., "content": ...}, ...]}`: a conversation,
  rendered by the tokenizer's chat template; the loss counts assistant turns.

With format `auto` each record is what its keys say (messages first, then
prompt + completion, then the text field); `text` reads the field only and
`sft` refuses records without prompt/completion or messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hydraulis.errors import HydraulisError

Format = Literal["auto", "text", "sft"]
FORMATS: tuple[str, ...] = ("auto", "text", "sft")


@dataclass(frozen=True)
class PromptCompletion:
    """One SFT example: tokens are encode(prompt) + encode(completion) + [eos]; targets the completion and eos."""

    prompt: str
    completion: str
    where: str  # "path:line" or "path:row", for the one-line errors


@dataclass(frozen=True)
class Chat:
    """One conversation: messages as given (role and content at least), rendered by the chat template."""

    messages: tuple[dict[str, Any], ...]
    where: str


Sample = str | PromptCompletion | Chat


class BadRecord(HydraulisError):
    """A record that is not a sample of the format asked for (skippable with --skip-missing)."""


class SkippableRecord(HydraulisError):
    """A bad record that `hydraulis data build` skips when given `flag`; the message names the flag,
    and a caller that is not `data build` (a `[data] corpus` built by `train`) says how to use it."""

    def __init__(self, reason: str, flag: str) -> None:
        super().__init__(f"{reason} (pass {flag} to skip such records)")
        self.reason = reason
        self.flag = flag

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # raised in a build's worker, raised again here
        return SkippableRecord, (self.reason, self.flag)


def parse_record(record: Any, field: str, fmt: Format, where: str) -> Sample:
    """The sample a record holds; BadRecord (one line naming `where`) when it holds none."""
    if not isinstance(record, dict):
        raise BadRecord(f"{where}: not a JSON object")
    if fmt != "text":
        if "messages" in record:
            return _chat(record["messages"], where)
        if "prompt" in record or "completion" in record:
            return _prompt_completion(record, where)
        if fmt == "sft":
            raise BadRecord(f"{where}: no 'prompt'/'completion' or 'messages' (an SFT record needs one of them)")
    if field not in record:
        extra = " (nor prompt/completion or messages)" if fmt == "auto" else ""
        raise BadRecord(f"{where}: no field {field!r}{extra}")
    text = record[field]
    if not isinstance(text, str):
        raise BadRecord(f"{where}: field {field!r} is {type(text).__name__}, not a string")
    return text


def _prompt_completion(record: dict[str, Any], where: str) -> PromptCompletion:
    for key in ("prompt", "completion"):
        if key not in record:
            raise BadRecord(f"{where}: has {'prompt' if key == 'completion' else 'completion'} but no {key!r}")
        if not isinstance(record[key], str):
            raise BadRecord(f"{where}: field {key!r} is {type(record[key]).__name__}, not a string")
    return PromptCompletion(record["prompt"], record["completion"], where)


def _chat(messages: Any, where: str) -> Chat:
    if not isinstance(messages, list) or not messages:
        raise BadRecord(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRecord(f"{where}: messages[{i}] needs a string 'role' and a string 'content'")
    return Chat(tuple(messages), where)


def check_format(fmt: str) -> Format:
    if fmt not in FORMATS:
        raise HydraulisError(f"unknown --format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    return fmt  # type: ignore[return-value]
