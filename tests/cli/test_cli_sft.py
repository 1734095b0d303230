"""SFT end to end: a transformers LlamaForCausalLM and a Qwen2ForCausalLM, a BPE tokenizer trained here,
prompt/completion and chat records, `hydraulis data build` + `hydraulis train` with init_from on 2 gloo
ranks of a pool the planner switches between, then `hydraulis export` and a reload by transformers.

The outside oracles are transformers' own: each record's ids and target mask are what its tokenizer
gives (the chat mask is `apply_chat_template(return_assistant_tokens_mask=True)` on a template with
generation markers); the first step's loss is transformers' loss on the same tokens with the prompt
(and non-assistant) labels set to -100, summed over the global batch and divided by its target tokens
(fp32, 1e-4); the export reloaded by `AutoModelForCausalLM` gives the trained checkpoint's logits and
`AutoTokenizer` encodes (and renders chats) like the source tokenizer. The masked losses then do not
depend on the deployment: TP, PP and CP runs equal one process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_helpers import spread_weights  # noqa: E402
from tokenizer_helpers import CHATML_MARKED, TEXT, train_bpe  # noqa: E402
from train_helpers import losses  # noqa: E402

from hydraulis.data.indexed import open_corpus  # noqa: E402
from hydraulis.data.sampler import TokenBudgetSampler  # noqa: E402

pytestmark = pytest.mark.dist

SEED = 3
TOKENS_PER_BATCH = 384
MAX_LEN = 96  # some conversations are longer: split pieces keep their mask
STEPS = 3
HETERO = 'pool = "1x(tp2,pp1); 1x(tp1,pp2); 2x(tp1,pp1)"\nprofile = "@cpu"'
POOLS = {  # the deployment-independence runs, besides the hetero one of llama/chat
    "cp": ('pool = "1x(tp1,pp1,cp2)"\nprofile = "tiny@cpu+cp"', 2),
    "one": ('pool = "1x(tp1,pp1)"\nprofile = "tiny@cpu"', 1),
}
FAMILIES = ("llama", "qwen2")
FORMATS = ("completion", "chat")
CASES = [(f, k) for f in FAMILIES for k in FORMATS]


def records() -> list[dict]:
    """Prompt/completion pairs cut from the shipped text, and conversations of several turns."""
    lines = [line for line in TEXT.splitlines() if len(line.split()) >= 4]
    out: list[dict] = []
    for i, line in enumerate(lines):
        words = line.split()
        cut = 1 + i % (len(words) - 1)
        # every other prompt has a long context: documents of very different lengths, as SFT data has
        context = "".join(lines[(i + j) % len(lines)] + "\n" for j in range(1, 7)) if i % 2 == 0 else ""
        out.append({"prompt": context + " ".join(words[:cut]), "completion": " " + " ".join(words[cut:])})
        turns = [{"role": "system", "content": "Answer briefly."}] if i % 2 else []
        for j in range(1 + i % 3):
            turns.append({"role": "user", "content": lines[(i + j) % len(lines)][:40]})
            turns.append({"role": "assistant", "content": lines[(i + j + 1) % len(lines)][:30 + 10 * j]})
        out.append({"messages": turns})
    return out


def hf_model(family: str, path: Path):  # noqa: ANN201
    """A random tiny model of the family with non-trivial weights, saved as a Hugging Face directory.

    The Qwen2 one has q/k/v biases, a head tied to the embedding and 403 rows (more than the
    tokenizer's 400, as Qwen's own checkpoints have; padded to 404 for tp2)."""
    from hydraulis.runtime.hf import hf_config
    from hydraulis.specs import MODELS

    torch.manual_seed(SEED)
    if family == "llama":
        model = spread_weights(transformers.LlamaForCausalLM(hf_config(MODELS["tiny"])).float())
    else:
        config = transformers.Qwen2Config(
            hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=403, tie_word_embeddings=True, rope_theta=1e6,
            max_position_embeddings=512, rms_norm_eps=1e-6,
        )  # fmt: skip
        model = spread_weights(transformers.Qwen2ForCausalLM(config).float(), tied_hidden=64)
    model.save_pretrained(str(path))
    return model.eval()


def write_config(path: Path, hf: Path, corpus: Path, parallel: str, checkpoint_every: int = 0) -> Path:
    path.write_text(
        f'[model]\ninit_from = "{hf}"\n'
        f'[data]\ncorpus = "{corpus}"\ntokens_per_batch = {TOKENS_PER_BATCH}\nmax_len = {MAX_LEN}\nseed = {SEED}\n'
        f"[parallel]\n{parallel}\n[optim]\nlr = 3e-3\nwarmup = 1\n"
        f"[train]\nsteps = {STEPS}\nlog_every = 1\ncheckpoint_every = {checkpoint_every}\n"
    )
    return path


@pytest.fixture(scope="module")
def sft(tmp_path_factory: pytest.TempPathFactory, session_cli):  # noqa: ANN001, ANN201
    """(family, format) -> one hetero run on 2 ranks and its export, each made once per module."""
    models: dict[str, tuple] = {}
    runs: dict[tuple[str, str], dict] = {}

    def run(family: str, fmt: str) -> dict:
        if (family, fmt) in runs:
            return runs[(family, fmt)]
        if family not in models:
            hf = tmp_path_factory.mktemp(family) / "hf"
            model = hf_model(family, hf)
            # the checkpoint's own tokenizer (data.tokenizer = "auto" picks it), Qwen2's pre-tokenizer for Qwen2
            train_bpe(hf, chat_template=CHATML_MARKED, qwen2=family == "qwen2")
            models[family] = (model, hf)
        model, hf = models[family]
        tmp = hf.parent / fmt
        tmp.mkdir()
        src = tmp / "sft.jsonl"
        chosen = [r for r in records() if ("messages" in r) == (fmt == "chat")]
        src.write_text("".join(json.dumps(r) + "\n" for r in chosen))
        corpus = tmp / "corpus"
        built = session_cli("data", "build", str(src), "--out", str(corpus), "--tokenizer", str(hf))
        assert built.returncode == 0, built.stderr
        config = write_config(tmp / "hetero.toml", hf, corpus, HETERO, checkpoint_every=STEPS)
        out = tmp / "run"
        result = session_cli("train", "--config", str(config), "--nproc", "2", "--out", str(out), timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        ckpt = out / "checkpoints" / f"step-{STEPS:06d}"
        exported = session_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp / "hf-out"))
        assert exported.returncode == 0, exported.stderr
        runs[(family, fmt)] = {"model": model, "hf": hf, "source": src, "records": chosen, "corpus": corpus,
                               "result": result, "out": out, "ckpt": ckpt, "export": tmp / "hf-out",
                               "tmp": tmp}  # fmt: skip
        return runs[(family, fmt)]

    return run


@pytest.fixture(params=CASES, ids=[f"{f}-{k}" for f, k in CASES])
def case(request, sft) -> dict:  # noqa: ANN001
    return sft(*request.param)


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


def transformers_records(hf: Path, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """Each record's ids and target mask by transformers' tokenizer alone (TRL's completion-only loss)."""
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    out = []
    for r in rows:
        if "prompt" in r:
            prompt = tok(r["prompt"])["input_ids"]  # its post-processor puts <s> first
            completion = tok(r["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            out.append((prompt + completion, [0] * len(prompt) + [1] * len(completion)))
        else:
            chat = tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)  # fmt: skip
            out.append((list(chat["input_ids"]), list(chat["assistant_masks"])))
    return out


def test_ids_and_target_masks_are_transformers(case):
    """The built corpus holds what transformers' tokenizer and chat template give, record by record
    (a chat document is closed by an end-of-document token that is no target)."""
    corpus = open_corpus(case["corpus"])
    want = transformers_records(case["hf"], case["records"])
    assert len(corpus) == len(want)
    eos = transformers.AutoTokenizer.from_pretrained(case["hf"]).eos_token_id
    for d, (ids, mask) in enumerate(want):
        if "messages" in case["records"][d]:
            ids, mask = ids + [eos], mask + [0]
        assert list(map(int, corpus[d])) == ids, d
        assert list(map(int, corpus.target_mask(d))) == mask, d
    assert sum(sum(m) for _, m in want) == corpus.manifest.target_tokens


def test_first_sft_loss_is_transformers_loss_with_prompt_labels_ignored(case):
    result, out = case["result"], case["out"]
    want, targets, unmasked = hf_first_loss(case["model"], case["corpus"])
    assert 0 < targets < unmasked  # the mask matters: far fewer targets than tokens
    got = losses(out)[0]
    print(f"\nSFT first loss {got:.7f}, transformers' {want:.7f} ({targets} of {unmasked} targets)")
    assert got == pytest.approx(want, rel=1e-4)
    assert "initialised from" in result.stdout + result.stderr
    used = [json.loads(x)["deployment"] for x in (out / "metrics.jsonl").read_text().splitlines()[:-1]]
    pool = [d["text"] for d in json.loads((out / "pool.json").read_text())["deployments"]]
    print("deployments:", used, "of", pool)
    assert len(pool) == 3 and set(used) <= set(pool)  # the planner chooses among three (TP, PP, data parallel)
    if "messages" in case["records"][0]:  # the conversations' pieces of up to max_len tokens want TP at times
        assert len(set(used)) > 1, used  # the planner switched between the pool's deployments


def test_export_reloads_in_transformers_as_the_trained_model_and_its_tokenizer(case):
    from hydraulis.runtime import StageModel, pack_documents
    from hydraulis.runtime.checkpoint import load_master
    from hydraulis.runtime.hf_io import unflatten
    from hydraulis.runtime.layout import ModelLayout

    source, export = case["model"], case["export"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert type(reloaded) is type(source)
    vocab = source.config.vocab_size
    assert reloaded.model.embed_tokens.weight.shape[0] == vocab == reloaded.lm_head.weight.shape[0]
    assert reloaded.config.tie_word_embeddings == source.config.tie_word_embeddings
    info, master = load_master(case["ckpt"])
    ours = StageModel(info.model)
    ours.load_full_state_dict(unflatten(ModelLayout(info.model, 1), master))
    corpus = open_corpus(case["corpus"])
    docs = [torch.from_numpy(np.asarray(corpus[d][:MAX_LEN], dtype=np.int64)) for d in (0, 3)]
    packed = pack_documents(docs)
    with torch.no_grad():
        mine = ours(packed.tokens, packed)
        theirs = torch.cat([reloaded(d[None]).logits[0] for d in docs])
        before = torch.cat([source(d[None]).logits[0] for d in docs])
    torch.testing.assert_close(mine[:, :vocab], theirs, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(theirs, before, atol=1e-3)  # the export is the trained model, not the source

    original = transformers.AutoTokenizer.from_pretrained(case["hf"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    for text in [*TEXT.splitlines(), "Fine-tune a model on your own data. <|im_start|>"]:
        assert tokenizer.encode(text) == original.encode(text), text
    chat = next(r["messages"] for r in records() if "messages" in r)
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == original.apply_chat_template(
        chat, add_generation_prompt=True
    )
    config = json.loads((export / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (original.eos_token_id, original.bos_token_id)
    assert reloaded.generation_config.eos_token_id == original.eos_token_id


def test_masked_losses_do_not_depend_on_the_deployment(sft, session_cli):  # noqa: ANN001
    """The llama chat run (pieces of split conversations among them) on CP ranks and on one process."""
    hetero = sft("llama", "chat")
    runs = {}
    for name, (parallel, nproc) in POOLS.items():
        config = write_config(hetero["tmp"] / f"{name}.toml", hetero["hf"], hetero["corpus"], parallel)
        out = hetero["tmp"] / name
        result = session_cli("train", "--config", str(config), "--nproc", str(nproc), "--out", str(out), timeout=300)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        runs[name] = out
    one = losses(runs["one"])
    for name, out in (("hetero", hetero["out"]), ("cp", runs["cp"])):
        np.testing.assert_allclose(losses(out), one, rtol=1e-5, err_msg=name)
    rows = [json.loads(x) for x in (runs["cp"] / "metrics.jsonl").read_text().splitlines()][:-1]
    assert all("cp2" in r["deployment"] for r in rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_example_config_prepares_with_a_jsonl_corpus_and_the_checkpoint_tokenizer(family, sft, tmp_path):
    """examples/sft.toml with its two paths replaced (and a pool that needs no profiling)."""
    import tomllib

    from hydraulis.config import load_config, parse_config
    from hydraulis.data.tokenizer import get_tokenizer
    from hydraulis.job import prepare

    run = sft(family, "completion")
    example = Path(__file__).resolve().parents[2] / "examples" / "sft.toml"
    load_config(example)  # valid as shipped
    data = tomllib.loads(example.read_text())
    data["model"]["init_from"] = str(run["hf"])
    data["data"].update(corpus=str(run["source"]), tokens_per_batch=TOKENS_PER_BATCH, max_len=MAX_LEN)
    data["parallel"] = {"pool": "1x(tp1,pp1)", "profile": "@cpu"}
    said: list[str] = []
    job = prepare(parse_config(data), nproc=1, out=str(tmp_path / "run"), steps=1, resume=False, log=said.append)
    assert job.tokenizer == str(run["hf"])
    built = open_corpus(job.corpus_path)
    assert built.manifest.tokenizer == get_tokenizer(str(run["hf"])).name and built.manifest.masked
    assert built.manifest.target_tokens == open_corpus(run["corpus"]).manifest.target_tokens
    assert any("sft.jsonl: built into the cache once" in line for line in said), said


BAD_RECORDS = {  # the record, the `data build` flag that skips it
    "a prompt without a completion": ({"prompt": "Question?"}, "--skip-missing"),
    "an empty completion": ({"prompt": "Question?", "completion": ""}, "--skip-bad"),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_a_bad_record_in_a_jsonl_corpus_says_how_to_build_it_skipped(case, tmp_path, cli):  # noqa: ANN001
    """`train` has no --skip-missing/--skip-bad: the line names `hydraulis data build` with the flag and the
    `[data] corpus` to point at its output, before any rank starts, and nothing is cached or written."""
    record, flag = BAD_RECORDS[case]
    src = tmp_path / f"bad{list(BAD_RECORDS).index(case)}.jsonl"  # its own name in the session's cache
    src.write_text(json.dumps({"prompt": "Question?", "completion": " Answer."}) + "\n" + json.dumps(record) + "\n")
    config = tmp_path / "bad.toml"
    config.write_text(
        f'[model]\npreset = "tiny"\n[data]\ncorpus = "{src}"\ntokenizer = "bytes"\ntokens_per_batch = 256\n'
        f'max_len = 64\n[parallel]\npool = "1x(tp1,pp1)"\nprofile = "tiny@cpu"\n[train]\nsteps = 1\n'
    )
    out = tmp_path / "out"
    result = cli("train", "--config", str(config), "--nproc", "1", "--out", str(out))
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {src}:2: "), result.stderr
    assert f"hydraulis data build {src} --out DIR --tokenizer bytes {flag}" in lines[0], lines[0]
    assert "[data] corpus = DIR" in lines[0] and "(pass" not in lines[0]
    assert not out.exists()
    cached = list((Path(os.environ["HYDRAULIS_CACHE"]) / "sources").glob(f"{src.stem}-*"))
    assert not cached, (cached, result.stderr)
