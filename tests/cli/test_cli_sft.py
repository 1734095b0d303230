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

Fine-tuning never goes silently wrong (issue 31): a rank killed before the first checkpoint restarts from
init_from, and so does a `--resume` that finds no checkpoint (the first loss is still transformers'); what
max_len cuts is counted where the run starts and ends, a run left without targets is refused; chats with
and without generation markers are transformers' own; the export keeps the source's pad id.

Export from anywhere (issue 43): the runs are started in a project directory with relative paths
(`init_from = "hf"`, tokenizer "auto") and exported from another directory, which keeps the tokenizer and
the source's pad id; a run whose tokenizer is gone is refused, naming the path tried.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cli_helpers import rank_pids, start_cli  # noqa: E402
from hf_helpers import spread_weights  # noqa: E402
from tokenizer_helpers import CHATML, CHATML_MARKED, TEXT, train_bpe  # noqa: E402
from train_helpers import losses, step_rows  # noqa: E402

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
# Both families and both formats; Qwen2's chat is left out (the chat template is the same for both families,
# and each hetero run costs ~15 s of the suite): the other tests need llama's two runs and Qwen2's completion.
CASES = [("llama", "completion"), ("llama", "chat"), ("qwen2", "completion")]
RESTARTED = ("qwen2", "completion")  # a rank of this run is killed before the first checkpoint (--max-restarts 1)
SOURCE_PAD = {"llama": None, "qwen2": 3}  # the source config's pad_token_id (the tokenizer's <pad> is 4)


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
    from hydraulis.runtime.storage.hf import hf_config
    from hydraulis.specs import MODELS

    torch.manual_seed(SEED)
    if family == "llama":
        model = spread_weights(transformers.LlamaForCausalLM(hf_config(MODELS["tiny"])).float())
    else:
        config = transformers.Qwen2Config(
            hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=403, tie_word_embeddings=True, rope_theta=1e6,
            max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=SOURCE_PAD["qwen2"],
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
        # As a user does in a project's directory: the model and corpus by relative paths, the tokenizer "auto"
        # (the model's own); the export below runs from another directory (the tests' own).
        project = hf.parent
        relative = (hf.relative_to(project), corpus.relative_to(project))
        config = write_config(tmp / "hetero.toml", *relative, HETERO, checkpoint_every=STEPS)
        out = tmp / "run"
        train = ("train", "--config", str(config), "--nproc", "2", "--out", str(out))
        result = (killed_and_restarted(train, project) if (family, fmt) == RESTARTED
                  else session_cli(*train, timeout=300, cwd=project))  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        ckpt = out / "checkpoints" / f"step-{STEPS:06d}"
        assert Path.cwd() != project
        exported = session_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp / "hf-out"))
        assert exported.returncode == 0, exported.stderr
        runs[(family, fmt)] = {"family": family, "model": model, "hf": hf, "source": src, "records": chosen,
                               "corpus": corpus,
                               "result": result, "out": out, "ckpt": ckpt, "export": tmp / "hf-out",
                               "tmp": tmp}  # fmt: skip
        return runs[(family, fmt)]

    return run


def killed_and_restarted(train: tuple[str, ...], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`hydraulis train ... --max-restarts 1` with one rank killed as soon as the ranks exist: long before
    the first checkpoint, so the restart finds none and must start from init_from again."""
    proc = start_cli(*train, "--max-restarts", "1", cwd=cwd)
    deadline = time.monotonic() + 120
    while len(ranks := rank_pids(proc.pid)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.kill(ranks[-1], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    assert "restarting from the last checkpoint (1 of 1)" in stdout, (stdout, stderr)
    assert "no checkpoint yet: starting from step 0" in stdout and "initialised from" in stdout, stdout
    return subprocess.CompletedProcess(train, proc.returncode, stdout, stderr)


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
    (a chat is apply_chat_template's ids exactly: nothing appended)."""
    corpus = open_corpus(case["corpus"])
    want = transformers_records(case["hf"], case["records"])
    assert len(corpus) == len(want)
    for d, (ids, mask) in enumerate(want):
        assert list(map(int, corpus[d])) == ids, d
        assert list(map(int, corpus.target_mask(d))) == mask, d
    assert sum(sum(m[1:]) for _, m in want) == corpus.manifest.target_tokens


def test_first_sft_loss_is_transformers_loss_with_prompt_labels_ignored(case):
    result, out = case["result"], case["out"]
    want, targets, unmasked = hf_first_loss(case["model"], case["corpus"])
    assert 0 < targets < unmasked  # the mask matters: far fewer targets than tokens
    got = losses(out)[0]
    print(f"\nSFT first loss {got:.7f}, transformers' {want:.7f} ({targets} of {unmasked} targets)")
    assert got == pytest.approx(want, rel=1e-4)
    assert "initialised from" in result.stdout + result.stderr
    used = [r["deployment"] for r in step_rows(out)]
    pool = [d["text"] for d in json.loads((out / "pool.json").read_text())["deployments"]]
    print("deployments:", used, "of", pool)
    assert len(pool) == 3 and set(used) <= set(pool)  # the planner chooses among three (TP, PP, data parallel)
    if "messages" in case["records"][0]:  # the conversations' pieces of up to max_len tokens want TP at times
        assert len(set(used)) > 1, used  # the planner switched between the pool's deployments


def test_export_reloads_in_transformers_as_the_trained_model_and_its_tokenizer(case):
    from hydraulis.checkpoints.saver import load_master
    from hydraulis.runtime import StageModel, concatenate_documents
    from hydraulis.runtime.optimizer.layout import ShardLayout
    from hydraulis.runtime.storage.hf_io import unflatten

    source, export = case["model"], case["export"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert type(reloaded) is type(source)
    vocab = source.config.vocab_size
    assert reloaded.model.embed_tokens.weight.shape[0] == vocab == reloaded.lm_head.weight.shape[0]
    assert reloaded.config.tie_word_embeddings == source.config.tie_word_embeddings
    info, master = load_master(case["ckpt"])
    ours = StageModel(info.model)
    ours.load_full_state_dict(unflatten(ShardLayout(info.model, 1), master))
    corpus = open_corpus(case["corpus"])
    docs = [torch.from_numpy(np.asarray(corpus[d][:MAX_LEN], dtype=np.int64)) for d in (0, 3)]
    packed = concatenate_documents(docs)
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
    # exported from another directory than the run's relative paths were written for: the run recorded them absolute
    recorded = tomllib.loads((case["out"] / "config.toml").read_text())
    assert (recorded["model"]["init_from"], recorded["data"]["corpus"]) == (str(case["hf"]), str(case["corpus"]))
    assert (config["eos_token_id"], config["bos_token_id"]) == (original.eos_token_id, original.bos_token_id)
    assert reloaded.generation_config.eos_token_id == original.eos_token_id
    # The source model's pad id is kept (Qwen2's 3), else the tokenizer's <pad>; the same in both files.
    pad = source.config.pad_token_id if source.config.pad_token_id is not None else original.pad_token_id
    assert pad == SOURCE_PAD[case["family"]] or (SOURCE_PAD[case["family"]] is None and pad == 4)
    assert config["pad_token_id"] == pad == reloaded.generation_config.pad_token_id


def test_an_export_whose_tokenizer_is_gone_is_refused_naming_the_path_tried(sft, tmp_path, cli):  # noqa: ANN001
    """The run's model directory (its tokenizer, "auto") moved away: one line naming where it was looked for,
    exit 2, nothing written; only --no-tokenizer (and --no-source-config, for its config's fields) exports."""
    run = sft("qwen2", "completion")
    model = tmp_path / "models" / "qwen2"
    shutil.copytree(run["hf"], model)
    copy = tmp_path / "run"
    shutil.copytree(run["ckpt"], copy / "checkpoints" / run["ckpt"].name)
    (copy / "config.toml").write_text((run["out"] / "config.toml").read_text().replace(str(run["hf"]), str(model)))
    out = tmp_path / "hf-out"
    done = cli("export", "--checkpoint", str(copy), "--out", str(out))  # a run directory: its newest checkpoint
    assert done.returncode == 0, done.stderr
    assert f"exporting {copy / 'checkpoints' / run['ckpt'].name}" in done.stdout
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == SOURCE_PAD["qwen2"]
    model.rename(tmp_path / "moved")
    again = tmp_path / "again"
    for flags, tried in (((), model), (("--no-tokenizer",), model / "config.json")):
        done = cli("export", "--checkpoint", str(copy), "--out", str(again), *flags)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(f"error: {tried}: ") and "not there" in done.stderr, done.stderr
        assert not again.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert "--no-tokenizer" in cli("export", "--checkpoint", str(copy), "--out", str(again)).stderr
    done = cli("export", "--checkpoint", str(copy), "--out", str(again), "--no-tokenizer", "--no-source-config")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in again.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


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
    assert all("cp2" in r["deployment"] for r in step_rows(runs["cp"]))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_example_config_prepares_with_a_jsonl_corpus_and_the_checkpoint_tokenizer(family, sft, tmp_path):
    """examples/sft.toml with its two paths replaced (and a pool that needs no profiling)."""
    import tomllib

    from hydraulis.data.tokenizer import get_tokenizer
    from hydraulis.training.config import load_config, parse_config
    from hydraulis.training.job import prepare

    run = sft(family, "completion")
    example = Path(__file__).resolve().parents[2] / "examples" / "sft.toml"
    load_config(example)  # valid as shipped
    data = tomllib.loads(example.read_text())
    data["model"]["init_from"] = str(run["hf"])
    data["data"].update(corpus=str(run["source"]), tokens_per_batch=TOKENS_PER_BATCH, max_len=MAX_LEN)
    data["parallel"] = {"pool": "1x(tp1,pp1)", "profile": "@cpu"}
    said: list[str] = []
    job = prepare(parse_config(data), nproc=1, out=str(tmp_path / "run"), steps=1, resume=False, log=said.append)
    assert job.data.tokenizer == str(run["hf"])
    built = open_corpus(job.data.corpus_path)
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


def split_counts(rows: list[tuple[list[int], list[int]]], max_len: int) -> tuple[int, int, int, int]:
    """What `split` at max_len does, counted from transformers' ids and masks: records cut, their pieces,
    target tokens lost (a piece's first token has nothing before it) and kept."""
    long = [(ids, mask) for ids, mask in rows if len(ids) > max_len]
    pieces = sum(-(-len(ids) // max_len) for ids, _ in long)
    lost = sum(mask[k] for _, mask in long for k in range(max_len, len(mask), max_len))
    return len(long), pieces, lost, sum(sum(m[1:]) for _, m in rows) - lost


def test_a_resume_before_any_checkpoint_starts_from_init_from(sft, session_cli):  # noqa: ANN001
    """A run stopped before its first checkpoint (its first step diverged), then `--resume`: a fresh start
    from init_from, whose first loss is transformers' on the init_from model. The run says what max_len
    split before it starts and again in its summary (counted here from transformers' tokens), and its
    output, not a terminal, is never wrapped (no COLUMNS)."""
    run = sft("llama", "completion")
    config = write_config(run["tmp"] / "resume.toml", run["hf"], run["corpus"], POOLS["one"][0])
    config.write_text(config.read_text() + "max_bad_steps = 1\n")
    out = run["tmp"] / "resumed"
    train = ("train", "--config", str(config), "--nproc", "1", "--out", str(out))
    first = session_cli(*train, env={"HYDRAULIS_TEST_NAN_STEP": "0"})
    assert first.returncode == 2 and "training diverged" in first.stderr, first.stderr
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    again = session_cli(*train, "--resume", env={"COLUMNS": None})
    assert again.returncode == 0, again.stderr[-3000:]
    lines = again.stdout.splitlines()
    assert "no checkpoint yet: starting from step 0" in lines and f"initialised from {run['hf']}" in lines
    want, _, _ = hf_first_loss(run["model"], run["corpus"])
    assert losses(out)[0] == pytest.approx(want, rel=1e-4)  # the pretrained weights, not random ones
    records, pieces, lost, kept = split_counts(transformers_records(run["hf"], run["records"]), MAX_LEN)
    assert records > 0 and lost > 0
    said = (f"overlong: {records} record(s) longer than max_len {MAX_LEN} split into {pieces} pieces; "
            f"{lost} of {lost + kept} target tokens lost")  # fmt: skip
    assert lines[0].startswith(said), lines[0]  # the run's first line
    done = next(i for i, line in enumerate(lines) if line.startswith("done: "))
    assert lines[done + 1].startswith(said), lines[done:]  # and in its summary
    assert lines[done].endswith("%") and "iteration time predicted/measured median error" in lines[done]
    summary = json.loads((out / "summary.json").read_text())["overlong"]
    assert (summary["split"], summary["pieces"], summary["target_tokens_lost"]) == (records, pieces, lost)
    assert summary["target_tokens_kept"] == kept


NO_NEWLINE_MARKED = (  # generation markers that leave the newline after <|im_end|> out, as many training templates
    "{% for message in messages %}{% if message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chats_are_transformers_with_and_without_generation_markers(sft, tmp_path, cli):  # noqa: ANN001
    """`data build` of chats: ids are apply_chat_template's, and targets are transformers' assistant mask
    whenever the template marks them (here the newline after <|im_end|> is left out); a template
    without markers takes what each assistant turn adds, which is transformers' mask of the same text marked
    around those turns (CHATML_MARKED). A tokenizer that names a bos but whose post-processor adds none
    puts none before a prompt, as transformers' tokenizer does."""
    from tokenizers import Tokenizer

    run = sft("llama", "chat")
    marked = transformers.AutoTokenizer.from_pretrained(train_bpe(tmp_path / "marked", chat_template=CHATML_MARKED))
    for name, template in (("marked", NO_NEWLINE_MARKED), ("unmarked", CHATML)):
        tok = train_bpe(tmp_path / name, chat_template=template)
        built = cli("data", "build", str(run["source"]), "--out", str(tmp_path / f"{name}-c"), "--tokenizer", str(tok))
        assert built.returncode == 0, built.stderr
        corpus = open_corpus(tmp_path / f"{name}-c")
        oracle = transformers.AutoTokenizer.from_pretrained(tok) if name == "marked" else marked
        for d, record in enumerate(run["records"]):
            want = oracle.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)  # fmt: skip
            assert list(map(int, corpus[d])) == list(want["input_ids"]), (name, d)
            assert list(map(int, corpus.target_mask(d))) == list(want["assistant_masks"]), (name, d)
    nobos = train_bpe(tmp_path / "nobos")
    backend = Tokenizer.from_file(str(nobos / "tokenizer.json"))
    backend.post_processor = None
    backend.save(str(nobos / "tokenizer.json"))
    completion = sft("llama", "completion")
    built = cli("data", "build", str(completion["source"]), "--out", str(tmp_path / "nobos-c"), "-t", str(nobos))
    assert built.returncode == 0, built.stderr
    want = transformers_records(nobos, completion["records"])
    assert want[0][0][0] != transformers.AutoTokenizer.from_pretrained(nobos).bos_token_id  # no bos from it
    assert [list(map(int, d)) for d in iter_docs(open_corpus(tmp_path / "nobos-c"))] == [ids for ids, _ in want]


def iter_docs(corpus):  # noqa: ANN001, ANN201
    return (corpus[d] for d in range(len(corpus)))


def truncate_counts(rows: list[tuple[list[int], list[int]]], max_len: int) -> tuple[int, int]:
    """`truncate` as documented, from transformers' ids and masks: the window ends at the record's end when
    its targets fit after a token of context, else it starts at the token before the first target.
    Returns (records cut, target tokens kept)."""
    cut, kept = 0, 0
    for ids, mask in rows:
        start = 0
        if len(ids) > max_len:
            cut += 1
            first = next(i for i in range(1, len(mask)) if mask[i])
            start = max(0, min(len(ids) - max_len, first - 1))
        kept += sum(mask[start + 1 : start + max_len])
    return cut, kept


def test_what_max_len_cuts_is_counted_and_nothing_left_is_refused(sft, tmp_path, cli):  # noqa: ANN001
    """The issue's run: max_len 8 with `truncate` cut every completion away. Now truncate keeps each
    completion's start (the prompt goes first), and the manifest and `data stats` say what it cuts,
    counted here from transformers' tokens. A corpus whose targets a max_len loses entirely is refused in
    one line by `data build --max-len` and by `train`, before any rank, with nothing written."""
    run = sft("llama", "completion")
    out = tmp_path / "c8"
    built = cli("data", "build", str(run["source"]), "--out", str(out), "-t", str(run["hf"]),
                "--max-len", "8", "--overlong", "truncate")  # fmt: skip
    assert built.returncode == 0, built.stderr
    cut, kept = truncate_counts(transformers_records(run["hf"], run["records"]), 8)
    manifest = json.loads((out / "manifest.json").read_text())["overlong"]
    assert (manifest["truncated"], manifest["target_tokens_kept"]) == (cut, kept) and cut == len(run["records"])
    assert kept >= 2 * cut  # each record keeps targets (its completion's start, or its end and the eos)
    stats = cli("data", "stats", str(out), "-t", str(run["hf"]), env={"COLUMNS": None})
    line = f"overlong: {cut} record(s) longer than max_len 8 truncated; {manifest['target_tokens_lost']} of"
    assert stats.returncode == 0 and line in stats.stdout.splitlines()[-1], stats.stdout
    assert any("corpus" in row and "top1% s²" in row for row in stats.stdout.splitlines())  # headers not cut
    again = cli("data", "stats", str(out), "-t", str(run["hf"]), "--max-len", "8", "--overlong", "truncate", "--json")
    assert json.loads(again.stdout)["overlong"] == manifest

    # One target token (the <|im_end|> of an empty answer), at the start of a max_len piece: nothing left.
    tok = train_bpe(tmp_path / "tok", chat_template=NO_NEWLINE_MARKED)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]
    mask = transformers.AutoTokenizer.from_pretrained(tok).apply_chat_template(
        chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )["assistant_masks"]
    assert sum(mask) == 1 and mask.index(1) >= 2
    at = str(mask.index(1))
    src = tmp_path / "one.jsonl"
    src.write_text(json.dumps({"messages": chat}) + "\n")
    refused = cli("data", "build", str(src), "--out", str(tmp_path / "none"), "-t", str(tok), "--max-len", at)
    assert refused.returncode == 2 and not (tmp_path / "none").exists(), refused.stderr
    assert refused.stderr.startswith(f"error: --max-len {at} --overlong split: no target token is left")
    config = tmp_path / "none.toml"
    config.write_text(
        f'[model]\npreset = "tiny"\n[data]\ncorpus = "{src}"\ntokenizer = "{tok}"\ntokens_per_batch = 64\n'
        f'max_len = {at}\n[parallel]\npool = "1x(tp1,pp1)"\nprofile = "tiny@cpu"\n[train]\nsteps = 1\n'
    )
    result = cli("train", "--config", str(config), "--nproc", "1", "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"max_len = {at}, overlong = 'split': no target token is left" in result.stderr
    assert not (tmp_path / "run").exists()
