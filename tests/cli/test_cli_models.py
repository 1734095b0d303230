"""Hugging Face families through the real commands: init_from, train on 2 ranks, export, reload in transformers.

Each model is built and randomised by transformers itself (its own class of
the family), saved with `save_pretrained`, trained by `hydraulis train` with
`init_from`, and exported by `hydraulis export`. The oracle is transformers:
the first step's loss must be its loss on the same batch, and the exported
directory, loaded by `AutoModelForCausalLM`, must be the trained checkpoint
(its logits equal ours). One model has GPT-2's vocabulary of 50257 on a tp2
pool: padded to 50258 rows while training, exported with exactly 50257.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from train_helpers import make_corpus, write_config  # noqa: E402

from hydraulis.data.indexed import open_corpus  # noqa: E402
from hydraulis.data.sampler import TokenBudgetSampler  # noqa: E402
from hydraulis.runtime import StageModel, count_targets, pack_documents  # noqa: E402
from hydraulis.runtime.checkpoint import load_master  # noqa: E402
from hydraulis.runtime.hf_io import unflatten  # noqa: E402
from hydraulis.runtime.layout import ModelLayout  # noqa: E402

pytestmark = pytest.mark.dist

SHAPE = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}  # fmt: skip
FAMILIES = {
    # LLaMA 3: RoPE scaling, GPT-2's vocabulary, which tp2 cannot split
    "llama3-50257": ("LlamaConfig", {"vocab_size": 50257, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),  # fmt: skip
    # Qwen2: q/k/v biases, a head tied to the embedding (across pipeline stages), 301 rows padded to 302
    "qwen2-tied": ("Qwen2Config", {"vocab_size": 301, "tie_word_embeddings": True, "rope_theta": 1e6}),
    # Qwen3: q/k norms and a head_dim of its own (4 heads x 32 != hidden 64)
    "qwen3": ("Qwen3Config", {"vocab_size": 320, "head_dim": 32}),
}
DATA = 'tokens_per_batch = 768\nmax_len = 256\nseed = 3\ntokenizer = "bytes"'
POOL = 'pool = "1x(tp2,pp1); 1x(tp1,pp2)"\nprofile = "@cpu"'


def hf_model(family: str):
    config_class, options = FAMILIES[family]
    config = getattr(transformers, config_class)(**SHAPE, **options)
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(std=0.3)
            else:
                p.normal_(std=p.shape[-1] ** -0.5 if "embed" not in name else 0.5)
    return model


def hf_loss(model, docs: list[np.ndarray]) -> float:
    """transformers on each document alone: summed token cross-entropy / the batch's targets."""
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for d in docs:
            ids = torch.from_numpy(np.asarray(d, dtype=np.int64))[None]
            logits = model(ids).logits[0]
            total += F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum").double()
    return float(total) / count_targets([len(d) for d in docs])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "docs")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_run(request, tmp_path_factory, corpus, session_cli):
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    model = hf_model(family)
    model.save_pretrained(tmp / "hf-in")
    sections = {"model": f'init_from = "{tmp / "hf-in"}"', "data": f'corpus = "{corpus}"\n{DATA}', "parallel": POOL,
                "train": "steps = 2\ncheckpoint_every = 2"}  # fmt: skip
    config = write_config(tmp / "run.toml", corpus, **sections)
    trained = session_cli("train", "--config", str(config), "--nproc", "2", "--out", str(tmp / "run"), timeout=300)
    assert trained.returncode == 0, trained.stderr
    ckpt = tmp / "run" / "checkpoints" / "step-000002"
    exported = session_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp / "hf-out"))
    assert exported.returncode == 0, exported.stderr
    return family, model, tmp, ckpt


def test_first_loss_is_transformers_loss_on_the_same_batch(family_run, corpus):
    _, model, tmp, _ = family_run
    data = open_corpus(corpus)
    batch = TokenBudgetSampler(data.lengths, 768, max_len=256, seed=3).next_batch()
    want = hf_loss(model, [np.asarray(t) for t in batch.tokens(data)])
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    got = rows[0]["loss"]
    assert got == pytest.approx(want, rel=1e-4)


def test_export_is_the_same_family_and_the_trained_model(family_run):
    family, source, tmp, ckpt = family_run
    out = tmp / "hf-out"
    config = json.loads((out / "config.json").read_text())
    want = source.config.to_dict()
    assert config["model_type"] == want["model_type"] and config["architectures"] == want["architectures"]
    for key in ("vocab_size", "tie_word_embeddings", "head_dim", "rope_parameters", "rms_norm_eps"):
        assert config.get(key) == want.get(key), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded) is type(source)
    vocab = want["vocab_size"]
    assert reloaded.model.embed_tokens.weight.shape[0] == vocab
    assert reloaded.lm_head.weight.shape[0] == vocab
    info, master = load_master(ckpt)
    ours = StageModel(info.model)
    ours.load_full_state_dict(unflatten(ModelLayout(info.model, 1), master))
    if family == "llama3-50257":
        assert info.model.vocab_rows == 50258  # padded for tp2 while training
    docs = [torch.from_numpy(np.random.default_rng(5).integers(0, 257, size=n)) for n in (9, 40)]
    packed = pack_documents(docs)
    with torch.no_grad():
        mine = ours(packed.tokens, packed)
        theirs = torch.cat([reloaded(d[None]).logits[0] for d in docs])
    torch.testing.assert_close(mine[:, :vocab], theirs, rtol=1e-4, atol=1e-4)


def _hf_dir(path: Path, **config: object) -> Path:
    """A model directory holding only config.json: the launcher refuses it before it reads any weight."""
    path.mkdir()
    base = {"model_type": "llama", "vocab_size": 320, "hidden_act": "silu", **{k: v for k, v in SHAPE.items()}}
    (path / "config.json").write_text(json.dumps({**base, **config}))
    return path


BAD = {
    "unsupported model_type": ({"model_type": "gemma"}, None, "model_type is 'gemma'"),
    "unsupported option": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, None, "rope_type is 'yarn'"),
    "a sliding window that would act": ({"model_type": "mistral", "sliding_window": 64}, None,
                                        "sliding_window is 64, below max_len 256"),  # fmt: skip
    # checked against every config of the pool before profile = "auto" measures anything
    "heads against a TP degree": ({"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32},
                                  'pool = "1x(tp4,pp1); 2x(tp2,pp1)"\nprofile = "auto"',
                                  "tp4pp1: hf has 2 heads, not divisible by tp=4"),  # fmt: skip
    "KV heads against a TP degree": ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96},
                                     'pool = "2x(tp2,pp1)"\nprofile = "auto"', "hf has 3 KV heads; tp=2"),  # fmt: skip
    "vocabulary below the tokenizer's": ({"vocab_size": 200}, None, "smaller than the bytes tokenizer's 257"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_models_are_one_line_before_any_rank_or_profile(case, tmp_path, corpus, cli):
    change, parallel, expected = BAD[case]
    hf = _hf_dir(tmp_path / "hf", **change)
    sections = {"model": f'init_from = "{hf}"', "data": f'corpus = "{corpus}"\n{DATA}', "parallel": parallel or POOL}
    config = write_config(tmp_path / "bad.toml", corpus, **sections)
    out = tmp_path / "out"
    result = cli("train", "--config", str(config), "--nproc", "4" if parallel else "2", "--out", str(out))
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "profil" not in result.stdout + result.stderr
    assert not out.exists()
