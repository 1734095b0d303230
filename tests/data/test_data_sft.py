"""SFT data: prompt/completion and chat records become tokens plus a target mask, checked against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import one_line_error
from test_data_cli import hidden
from tokenizer_helpers import train_bpe

from hydraulis.data.build.corpus import build_corpus
from hydraulis.data.indexed import MASK_FILE, open_corpus
from hydraulis.data.readers import InputOptions, ReadCounts
from hydraulis.data.sources import read_source

transformers = pytest.importorskip("transformers")

# A ChatML template with transformers' {% generation %} markers, so that transformers itself computes the
# assistant mask (return_assistant_tokens_mask) as an independent reference for ours.
GENERATION_CHATML = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PAIRS = [
    ("Question: what is the capital of France?", " Answer: Paris is the capital of France."),
    ("Question: how many legs does a spider have?\n", "Answer: eight."),
    ("def add(a, b):", "\n    return a + b"),
]
CHATS = [
    [
        {"role": "system", "content": "You answer questions."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And how many legs does a spider have?"},
        {"role": "assistant", "content": "A spider has eight legs."},
    ],
    [{"role": "user", "content": "Pack my box."}, {"role": "assistant", "content": "With five dozen jugs."}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok") / "bpe", chat_template=GENERATION_CHATML)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build(src: Path, out: Path, tokenizer: str):  # noqa: ANN201
    """Read a source and build it, as `hydraulis data build` does."""
    counts = ReadCounts()
    return build_corpus(read_source(src, counts, InputOptions()), out, tokenizer, source=str(src), counts=counts)


def test_prompt_completion_tokens_and_targets(tok_dir: Path, tmp_path: Path) -> None:
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    src = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    corpus = build(src, tmp_path / "c", str(tok_dir))
    want_targets = 0
    for i, (p, c) in enumerate(PAIRS):
        prompt = ref(p)["input_ids"]  # <s> + the prompt, as transformers tokenizes a text
        completion = ref(c, add_special_tokens=False)["input_ids"] + [ref.eos_token_id]
        assert corpus[i].tolist() == prompt + completion
        assert corpus.target_mask(i).tolist() == [0] * len(prompt) + [1] * len(completion)
        want_targets += len(completion)
    m = corpus.manifest
    assert m.masked and m.target_tokens == want_targets and m.report.sft_records == len(PAIRS)
    assert (
        open_corpus(tmp_path / "c", verify=True).piece_targets(
            np.arange(len(PAIRS)), np.zeros(len(PAIRS), np.int64), corpus.lengths
        )
        == want_targets
    )


def test_chat_targets_are_transformers_assistant_mask(tok_dir: Path, tmp_path: Path) -> None:
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    corpus = build(src, tmp_path / "c", str(tok_dir))
    for i, messages in enumerate(CHATS):
        out = ref.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert corpus[i].tolist() == list(out["input_ids"])  # nothing appended: the template ends the document
        assert corpus.target_mask(i).tolist() == list(out["assistant_masks"])
        assert sum(out["assistant_masks"]) > 0


def test_a_chat_template_jinja_file_is_the_template(tok_dir: Path, tmp_path: Path) -> None:
    """Where transformers 4.43+ saves the template: chat_template.jinja beside tokenizer.json."""
    own = tmp_path / "tok"
    own.mkdir()
    (own / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (own / "tokenizer_config.json").write_text(json.dumps(config))
    (own / "chat_template.jinja").write_text(GENERATION_CHATML)
    ref = transformers.AutoTokenizer.from_pretrained(str(own))
    corpus = build(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHATS[0]}]), tmp_path / "c", str(own))
    out = ref.apply_chat_template(CHATS[0], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert corpus.target_mask(0).tolist() == list(out["assistant_masks"])
    assert "chat_template.jinja" in dict(corpus.manifest.tokenizer_sha256)


def test_text_documents_before_sft_records_get_full_masks(tok_dir: Path, tmp_path: Path) -> None:
    records = [{"text": "plain text first"}, {"prompt": "Q", "completion": " A"}, {"text": "plain again"}]
    corpus = build(write_jsonl(tmp_path / "m.jsonl", records), tmp_path / "c", str(tok_dir))
    assert corpus.mask is not None and (tmp_path / "c" / MASK_FILE).stat().st_size == corpus.num_tokens
    assert corpus.target_mask(0).all() and corpus.target_mask(2).all() and not corpus.target_mask(1).all()
    plain = build_corpus(["no sft here"], tmp_path / "p", str(tok_dir), "t")
    assert plain.mask is None and plain.target_mask(0) is None and not (tmp_path / "p" / MASK_FILE).exists()


def test_stats_report_target_tokens(cli, tok_dir: Path, tmp_path: Path) -> None:  # noqa: ANN001
    src = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS])
    out = tmp_path / "c"
    res = cli("data", "build", str(src), "--out", str(out), "--tokenizer", str(tok_dir))
    assert res.returncode == 0, res.stderr
    m = open_corpus(out).manifest
    assert f"{m.target_tokens:,} targets" in res.stdout
    res = cli("data", "stats", str(out), "--json")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)
    assert stats["tokens"] == m.tokens and stats["target_tokens"] == m.target_tokens < m.tokens
    assert stats["masked"] is True


def test_bad_sft_input_is_one_line_and_writes_nothing(cli, tok_dir: Path, tmp_path: Path) -> None:  # noqa: ANN001
    no_template = train_bpe(tmp_path / "plain_tok", chat_template=None)
    good = {"prompt": "Q", "completion": " A"}
    cases = [
        (
            [good, {"question": "Q", "answer": "A"}],
            ["--format", "sft"],
            str(tok_dir),
            "jsonl:2: no 'prompt'/'completion'",
        ),
        ([good, {"prompt": "Q"}], [], str(tok_dir), "jsonl:2: has prompt but no 'completion'"),
        ([{"messages": CHATS[1]}], [], str(no_template), "chat records need a chat template"),
        ([good, {"prompt": "Q", "completion": ""}], [], str(tok_dir), "jsonl:2: the completion is empty"),
        ([{"messages": "hello"}], [], str(tok_dir), "jsonl:1: 'messages' must be a non-empty list"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], [], str(tok_dir), "jsonl:1: no assistant turn"),
    ]
    for i, (records, flags, tok, needle) in enumerate(cases):
        src = write_jsonl(tmp_path / f"bad{i}.jsonl", records)
        out = tmp_path / "out"
        msg = one_line_error(cli("data", "build", str(src), "--out", str(out), "--tokenizer", tok, *flags))
        assert needle in msg, (needle, msg)
        assert not out.exists() and hidden(tmp_path) == []
    assert "--skip-bad" in msg  # records with nothing to learn name the flag that skips them
    src = write_jsonl(tmp_path / "skip.jsonl", [good, {"prompt": "Q", "completion": ""}, good])
    res = cli("data", "build", str(src), "--out", str(tmp_path / "ok"), "--tokenizer", str(tok_dir), "--skip-bad")
    assert res.returncode == 0, res.stderr
    m = open_corpus(tmp_path / "ok").manifest
    assert m.documents == 2 and m.report.no_target_skipped == 1 and m.report.documents == 2
