"""A small Hugging Face BPE tokenizer, trained here with `tokenizers` on the text below (no download).

It looks like a LLaMA/Qwen tokenizer where it matters: byte-level BPE, a
`<s>` the post-processor puts before each text, `</s>` as eos, ChatML
specials and (optionally) a ChatML chat template in tokenizer_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

TEXT = """\
Hydraulis trains Transformers on documents of very different lengths. A global batch is a token budget,
and the planner assigns each document to a replica whose parallel configuration suits its length.
Question: what is the capital of France? Answer: Paris is the capital of France.
Question: how many legs does a spider have? Answer: a spider has eight legs.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Fine-tuning a model on prompts and completions trains the completion only: the prompt is context.
def add(a, b):
    return a + b
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ; : ! ? ( ) [ ] { } " ' - + * / = < > #
"""

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ChatML whose assistant turns are marked as transformers marks them (`return_assistant_tokens_mask`):
# transformers' own mask is then an oracle for the turn-by-turn mask of hydraulis/data/sft.py.
CHATML_MARKED = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ message['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen2's pre-tokenizer (its published tokenizer.json): transformers' Qwen2Tokenizer rebuilds exactly this
# (and NFC) whatever tokenizer.json says, so a Qwen2 directory's tokenizer must have it to mean the same ids.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_bpe(out: Path, vocab_size: int = 400, chat_template: str | None = CHATML, qwen2: bool = False) -> Path:
    """Write tokenizer.json (+ tokenizer_config.json) into `out`; returns `out`. `qwen2`: Qwen2's
    normalizer and pre-tokenizer instead of GPT-2's byte-level one."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if qwen2:
        tok.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT.splitlines() * 4, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out
