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
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tokenizer_helpers import train_bpe  # noqa: E402
from train_helpers import hf_loss, step_rows, write_config  # noqa: E402

from hydraulis.checkpoints.saver import load_master  # noqa: E402
from hydraulis.data.indexed import open_corpus  # noqa: E402
from hydraulis.data.sampler import TokenBudgetSampler  # noqa: E402
from hydraulis.runtime import StageModel, concatenate_documents  # noqa: E402
from hydraulis.runtime.optimizer.layout import ShardLayout  # noqa: E402
from hydraulis.runtime.storage.hf_io import unflatten  # noqa: E402

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


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus, session_cli):
    """family -> (family, source model, directory, checkpoint): each trained and exported once per module."""
    runs: dict[str, tuple] = {}

    def run(family: str) -> tuple:
        if family not in runs:
            tmp = tmp_path_factory.mktemp(family)
            model = hf_model(family)
            model.save_pretrained(tmp / "hf-in")
            sections = {"model": f'init_from = "{tmp / "hf-in"}"', "data": f'corpus = "{corpus}"\n{DATA}',
                        "parallel": POOL, "train": "steps = 2\ncheckpoint_every = 2"}  # fmt: skip
            config = write_config(tmp / "run.toml", corpus, **sections)
            out = str(tmp / "run")
            done = session_cli("train", "--config", str(config), "--nproc", "2", "--out", out, timeout=300)
            assert done.returncode == 0, done.stderr
            ckpt = tmp / "run" / "checkpoints" / "step-000002"
            exported = session_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp / "hf-out"))
            assert exported.returncode == 0, exported.stderr
            runs[family] = (family, model, tmp, ckpt)
        return runs[family]

    return run


@pytest.fixture(params=list(FAMILIES))
def family_run(request, trained):
    return trained(request.param)


@pytest.fixture
def qwen2_run(trained):
    """One family is enough for the tokenizer: it does not depend on the model."""
    return trained("qwen2-tied")


def test_first_loss_is_transformers_loss_on_the_same_batch(family_run, corpus):
    _, model, tmp, _ = family_run
    data = open_corpus(corpus)
    batch = TokenBudgetSampler(data.lengths, 768, max_len=256, seed=3).next_batch()
    want = hf_loss(model, [np.asarray(t) for t in batch.tokens(data)])
    got = step_rows(tmp / "run")[0]["loss"]
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
    # the run's tokenizer is the built-in bytes one: its end of document is 256
    assert (config["eos_token_id"], config["bos_token_id"]) == (256, None)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256
    assert config["max_position_embeddings"] == 512  # the source's, not the default 4096
    info, master = load_master(ckpt)
    ours = StageModel(info.model)
    ours.load_full_state_dict(unflatten(ShardLayout(info.model, 1), master))
    if family == "llama3-50257":
        assert info.model.vocab_rows == 50258  # padded for tp2 while training
    docs = [torch.from_numpy(np.random.default_rng(5).integers(0, 257, size=n)) for n in (9, 40)]
    packed = concatenate_documents(docs)
    with torch.no_grad():
        mine = ours(packed.tokens, packed)
        theirs = torch.cat([reloaded(d[None]).logits[0] for d in docs])
    torch.testing.assert_close(mine[:, :vocab], theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["bytes", "gpt2"])
def test_a_builtin_tokenizer_is_exported_for_autotokenizer(name, trained, tmp_path, cli):
    """A built-in tokenizer is written as Hugging Face files: AutoTokenizer loads them, encodes a sentence into
    the ids of hydraulis' own tokenizer and decodes them back. The 50257-row model trained with bytes (the
    fixture's export); for gpt2 a copy of its run names gpt2 (the vocabulary holds it), exported from the run
    directory (its newest checkpoint)."""
    from hydraulis.data.tokenizer import get_tokenizer

    _, _, tmp, ckpt = trained("llama3-50257")
    out = tmp / "hf-out"
    if name == "gpt2":
        run = tmp_path / "run"
        shutil.copytree(ckpt, run / "checkpoints" / ckpt.name)
        manifest = run / "checkpoints" / ckpt.name / "manifest.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "tokenizer": "gpt2"}))
        (run / "config.toml").write_text((tmp / "run" / "config.toml").read_text().replace('"bytes"', '"gpt2"'))
        out = tmp_path / "hf-out"
        done = cli("export", "--checkpoint", str(run), "--out", str(out))
        assert done.returncode == 0, done.stderr
    ours = get_tokenizer(name)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    sentence = "Fine-tune a model on your own data: naïve café, 3.14 ×2 — 日本語\n\n  done."
    ids = theirs.encode(sentence)
    assert ids == ours.encode(sentence).tolist() and theirs.decode(ids) == sentence
    assert theirs.eos_token_id == ours.eod_id == json.loads((out / "config.json").read_text())["eos_token_id"]
    assert len(ids) < len(sentence.encode()) if name == "gpt2" else len(ids) == len(sentence.encode())


def _hf_dir(path: Path, **config: object) -> Path:
    """A model directory: config.json, and the weights transformers saves for it when it can build it."""
    path.mkdir()
    base = {"model_type": "llama", "vocab_size": 320, "hidden_act": "silu", **{k: v for k, v in SHAPE.items()}}
    (path / "config.json").write_text(json.dumps({**base, **config}))
    try:
        made = transformers.AutoConfig.for_model(**{**base, **config})
        transformers.AutoModelForCausalLM.from_config(made).save_pretrained(str(path / "saved"))
    except (ValueError, KeyError, TypeError):
        return path  # a config transformers refuses: hydraulis refuses it too, before any weight
    (path / "saved" / "model.safetensors").rename(path / "model.safetensors")
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


def _without(path: Path, name: str) -> None:
    """Rewrite the directory's weights without tensor `name`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"))


BAD_WEIGHTS = {  # what is done to a good directory, what the line says
    "no weights file": (lambda hf: (hf / "model.safetensors").unlink(), "/hf/model.safetensors: no such file"),
    "a tensor missing": (lambda hf: _without(hf, "model.norm.weight"), "the weights have no 'model.norm.weight'"),
    "a tensor of another shape": (
        lambda hf: (hf / "config.json").write_text((hf / "config.json").read_text().replace("176", "160")),
        "mlp.gate_proj.weight has shape (176, 64), the model's config says (160, 64)",
    ),
    "a truncated weights file": (
        lambda hf: (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes()[:-100]),
        "model.safetensors: truncated",
    ),
}


@pytest.mark.parametrize("case", list(BAD_WEIGHTS))
def test_bad_weights_are_one_line_before_any_profile_or_rank(case, tmp_path, corpus, cli):
    """The init_from weights (files, tensor names and shapes against config.json) are read from their headers
    before any corpus build, profile (profile = "auto") or rank: one line, and no run directory left."""
    damage, expected = BAD_WEIGHTS[case]
    hf = _hf_dir(tmp_path / "hf")
    damage(hf)
    parallel = 'pool = "1x(tp1,pp1)"\nprofile = "auto"'
    config = write_config(tmp_path / "bad.toml", corpus, model=f'init_from = "{hf}"', data=DATA, parallel=parallel)
    out = tmp_path / "out"
    result = cli("train", "--config", str(config), "--nproc", "1", "--out", str(out))
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert "profil" not in result.stdout + result.stderr
    assert not out.exists()


@pytest.mark.parametrize("as_file", [False, True], ids=["directory", "saved tokenizer.json"])
def test_export_copies_the_runs_hf_tokenizer(qwen2_run, tmp_path, cli, as_file):
    """A run whose tokenizer is a Hugging Face one (a directory or a tokenizer.json, as `[data] tokenizer`
    names it): the export carries its files and its ids, and AutoTokenizer loads it."""
    _, _, _, ckpt = qwen2_run
    directory = train_bpe(tmp_path / "tok", vocab_size=300)  # the model has 301 rows
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    source = directory / "tokenizer.json" if as_file else directory
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "checkpoints" / ckpt.name)
    manifest = run / "checkpoints" / ckpt.name / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "tokenizer": str(source)}))
    (run / "config.toml").write_text(f'[data]\ntokenizer = "{source}"\n')
    out = tmp_path / "hf-out"
    done = cli("export", "--checkpoint", str(run / "checkpoints" / ckpt.name), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    reloaded = transformers.AutoTokenizer.from_pretrained(out)
    text = "Fine-tune a model on your own data."
    assert reloaded.encode(text) == tokenizer.encode(text)
    eos = tokenizer.convert_tokens_to_ids("</s>")
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == eos and config["bos_token_id"] == tokenizer.convert_tokens_to_ids("<s>")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos
    assert reloaded.eos_token == "</s>"  # the directory's tokenizer config travels, special tokens included
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.generation_config.eos_token_id == eos


def test_a_lone_tokenizer_json_is_copied_without_ids(qwen2_run, tmp_path, cli):
    _, _, _, ckpt = qwen2_run
    shutil.copy(train_bpe(tmp_path / "tok", vocab_size=300) / "tokenizer.json", tmp_path / "bpe.json")
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "checkpoints" / ckpt.name)
    (run / "config.toml").write_text(f'[data]\ntokenizer = "{tmp_path / "bpe.json"}"\n')
    manifest = run / "checkpoints" / ckpt.name / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "tokenizer": None}))
    out = tmp_path / "hf-out"
    done = cli("export", "--checkpoint", str(run / "checkpoints" / ckpt.name), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert (out / "tokenizer.json").read_text() == (tmp_path / "bpe.json").read_text()
    reloaded = transformers.AutoTokenizer.from_pretrained(out)
    assert reloaded.decode(reloaded.encode("some text", add_special_tokens=False)) == "some text"
    assert json.loads((out / "config.json").read_text())["eos_token_id"] is None  # nothing declares one


def test_resume_on_a_pool_without_tp_keeps_the_padding(trained, tmp_path, corpus, cli):
    """Trained padded for tp2 (50258 rows); resumed on tp1 replicas, which need no padding: the run
    keeps its checkpoint's rows instead of failing on a model of another shape."""
    _, _, tmp, _ = trained("llama3-50257")
    run = tmp_path / "run"
    shutil.copytree(tmp / "run", run)
    sections = {"model": f'init_from = "{tmp / "hf-in"}"', "data": f'corpus = "{corpus}"\n{DATA}',
                "parallel": 'pool = "2x(tp1,pp1)"\nprofile = "@cpu"', "train": "steps = 3"}  # fmt: skip
    config = write_config(tmp_path / "resume.toml", corpus, **sections)
    # 3 steps where the run had 2 (a longer schedule) on another pool: changes a resume takes only when asked
    done = cli("train", "--config", str(config), "--nproc", "2", "--out", str(run), "--resume", "--change-schedule",
               "--change-config")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in step_rows(run)][-1] == 2
    manifest = json.loads((run / "checkpoints" / "step-000003" / "manifest.json").read_text())
    assert manifest["model"]["padded_vocab"] == 50258
