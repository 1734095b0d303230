"""SFT end to end: a transformers LlamaForCausalLM and a BPE tokenizer trained here, prompt/completion and
chat records, `hydraulis data build` + `hydraulis train` with init_from on 2 gloo ranks.

The outside oracle: the first step's loss is transformers' own loss on the same tokens with the prompt
(and non-assistant) labels set to -100, summed over the global batch and divided by its target tokens
(fp32, 1e-4). The masked losses then do not depend on the deployment: TP, PP and CP runs equal one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_helpers import spread_weights  # noqa: E402
from tokenizer_helpers import TEXT, train_bpe  # noqa: E402
from train_helpers import losses  # noqa: E402

from hydraulis.data.indexed import open_corpus  # noqa: E402
from hydraulis.data.sampler import TokenBudgetSampler  # noqa: E402

pytestmark = pytest.mark.dist

SEED = 3
TOKENS_PER_BATCH = 384
MAX_LEN = 96  # some conversations are longer: split pieces keep their mask
POOLS = {
    "hetero": ('pool = "1x(tp2,pp1); 1x(tp1,pp2); 2x(tp1,pp1)"\nprofile = "tiny@cpu"', 2),
    "cp": ('pool = "1x(tp1,pp1,cp2)"\nprofile = "tiny@cpu+cp"', 2),
    "one": ('pool = "1x(tp1,pp1)"\nprofile = "tiny@cpu"', 1),
}


def records() -> list[dict]:
    """Prompt/completion pairs cut from the shipped text, and conversations of several turns."""
    lines = [line for line in TEXT.splitlines() if len(line.split()) >= 4]
    out: list[dict] = []
    for i, line in enumerate(lines):
        words = line.split()
        cut = 1 + i % (len(words) - 1)
        out.append({"prompt": " ".join(words[:cut]), "completion": " " + " ".join(words[cut:])})
        turns = [{"role": "system", "content": "Answer briefly."}] if i % 2 else []
        for j in range(1 + i % 3):
            turns.append({"role": "user", "content": lines[(i + j) % len(lines)][:40]})
            turns.append({"role": "assistant", "content": lines[(i + j + 1) % len(lines)][:30 + 10 * j]})
        out.append({"messages": turns})
    return out


def hf_model(path: Path):  # noqa: ANN201
    """A random tiny LlamaForCausalLM with non-trivial weights, saved as a Hugging Face directory."""
    from hydraulis.runtime.hf import hf_config
    from hydraulis.specs import MODELS

    torch.manual_seed(SEED)
    model = spread_weights(transformers.LlamaForCausalLM(hf_config(MODELS["tiny"])).float())
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def sft(tmp_path_factory: pytest.TempPathFactory, session_cli) -> dict:  # noqa: ANN001
    tmp = tmp_path_factory.mktemp("sft")
    hf = tmp / "hf"
    model = hf_model(hf)
    train_bpe(hf)  # the checkpoint's own tokenizer: data.tokenizer = "auto" picks it
    src = tmp / "sft.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records()))
    corpus = tmp / "corpus"
    built = session_cli("data", "build", str(src), "--out", str(corpus), "--tokenizer", str(hf))
    assert built.returncode == 0, built.stderr
    runs = {}
    for name, (parallel, nproc) in POOLS.items():
        config = tmp / f"{name}.toml"
        config.write_text(
            f'[model]\ninit_from = "{hf}"\n'
            f'[data]\ncorpus = "{corpus}"\ntokens_per_batch = {TOKENS_PER_BATCH}\nmax_len = {MAX_LEN}\nseed = {SEED}\n'
            f"[parallel]\n{parallel}\n[optim]\nlr = 3e-3\nwarmup = 1\n[train]\nsteps = 3\nlog_every = 1\n"
        )
        out = tmp / name
        result = session_cli("train", "--config", str(config), "--nproc", str(nproc), "--out", str(out), timeout=300)
        runs[name] = (result, out)
    return {"model": model, "corpus": corpus, "runs": runs, "hf": hf, "source": src}


def hf_first_loss(model, corpus_dir: Path) -> tuple[float, int, int]:  # noqa: ANN001
    """transformers' loss on the first global batch: labels -100 where the mask says no target."""
    corpus = open_corpus(corpus_dir)
    batch = TokenBudgetSampler(corpus.lengths, TOKENS_PER_BATCH, MAX_LEN, SEED, "split").next_batch()
    model.config._attn_implementation = "eager"
    total, targets = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for d, s, n in zip(batch.docs, batch.starts, batch.lengths, strict=True):
            d, s, n = int(d), int(s), int(n)
            ids = torch.from_numpy(np.asarray(corpus[d][s : s + n], dtype=np.int64))
            labels = ids.clone()
            labels[torch.from_numpy(np.asarray(corpus.target_mask(d)[s : s + n]) == 0)] = -100
            count = int((labels[1:] != -100).sum())
            if count == 0:
                continue
            loss = model(input_ids=ids[None], labels=labels[None], use_cache=False).loss  # mean over its targets
            total += loss.double() * count
            targets += count
    return float(total) / targets, targets, batch.num_tokens - len(batch)


def test_first_sft_loss_is_transformers_loss_with_prompt_labels_ignored(sft):
    result, out = sft["runs"]["hetero"]
    assert result.returncode == 0, result.stderr[-3000:]
    want, targets, unmasked = hf_first_loss(sft["model"], sft["corpus"])
    assert 0 < targets < unmasked  # the mask matters: far fewer targets than tokens
    got = losses(out)[0]
    print(f"\nSFT first loss {got:.7f}, transformers' {want:.7f} ({targets} of {unmasked} targets)")
    assert got == pytest.approx(want, rel=1e-4)
    assert "initialised from" in result.stdout + result.stderr


def test_masked_losses_do_not_depend_on_the_deployment(sft):
    for name, (result, _) in sft["runs"].items():
        assert result.returncode == 0, (name, result.stderr[-3000:])
    one = losses(sft["runs"]["one"][1])
    for name in ("hetero", "cp"):
        np.testing.assert_allclose(losses(sft["runs"][name][1]), one, rtol=1e-5, err_msg=name)
    rows = [json.loads(x) for x in (sft["runs"]["cp"][1] / "metrics.jsonl").read_text().splitlines()][:-1]
    assert all("cp2" in r["deployment"] for r in rows)


def test_the_example_config_prepares_with_a_jsonl_corpus_and_the_checkpoint_tokenizer(sft, tmp_path):
    """examples/sft.toml with its two paths replaced (and a pool that needs no profiling)."""
    import tomllib

    from hydraulis.config import load_config, parse_config
    from hydraulis.data.tokenizer import get_tokenizer
    from hydraulis.job import prepare

    example = Path(__file__).resolve().parents[2] / "examples" / "sft.toml"
    load_config(example)  # valid as shipped
    data = tomllib.loads(example.read_text())
    data["model"]["init_from"] = str(sft["hf"])
    data["data"].update(corpus=str(sft["source"]), tokens_per_batch=TOKENS_PER_BATCH, max_len=MAX_LEN)
    data["parallel"] = {"pool": "1x(tp1,pp1)", "profile": "tiny@cpu"}
    said: list[str] = []
    job = prepare(parse_config(data), nproc=1, out=str(tmp_path / "run"), steps=1, resume=False, log=said.append)
    assert job.tokenizer == str(sft["hf"])
    built = open_corpus(job.corpus_path)
    assert built.manifest.tokenizer == get_tokenizer(str(sft["hf"])).name and built.manifest.masked
    assert built.manifest.target_tokens == open_corpus(sft["corpus"]).manifest.target_tokens
    assert any("sft.jsonl: built into the cache once" in line for line in said), said
