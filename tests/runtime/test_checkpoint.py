"""Checkpoints on gloo: bit-for-bit resume, resharding 4 -> 2 ranks, partial and bad checkpoints, HF in and out.

Three spawns: the first run (4 ranks: uninterrupted, interrupted with saves,
another model's checkpoint, saves with and without interleaving), the resume in
new processes (4 ranks, with the refused loads first, each save resumed with the
other vp), and 2 ranks on another pool (resharded resume, then
training from a Hugging Face model and saving it for the export tests).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ckpt_workers import (
    KEEP,
    MAX_LEN,
    SAVE_AT,
    SEED,
    TOKENS_PER_BATCH,
    first_run,
    make_corpus,
    resume_resharded_and_hf,
    resume_same,
)
from dist_launcher import run_workers
from train_helpers import hf_loss

from hydraulis.checkpoints.manifest import (
    CHECKPOINT_SCHEMA,
    MANIFEST_FILE,
    latest_checkpoint,
    list_checkpoints,
    read_manifest,
    step_dir_name,
)
from hydraulis.checkpoints.saver import load_master
from hydraulis.data.indexed import open_corpus
from hydraulis.data.sampler import TokenBudgetSampler
from hydraulis.errors import HydraulisError
from hydraulis.optim import AdamWSettings
from hydraulis.runtime import IGNORE_INDEX, StageModel, concatenate_documents, count_targets
from hydraulis.runtime.optimizer.layout import ShardLayout, full_shapes
from hydraulis.runtime.optimizer.sharded import ShardedOptimizer
from hydraulis.runtime.storage.hf import hf_config, hf_name
from hydraulis.runtime.storage.hf_io import init_from, unflatten
from hydraulis.specs import MODELS

pytestmark = pytest.mark.dist

TINY = MODELS["tiny"]
LAST = step_dir_name(SAVE_AT)
PREVIOUS = step_dir_name(SAVE_AT - 1)


# -- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    corpus = make_corpus(root / "corpus")
    ckpt, other = root / "run", root / "other"
    results = run_workers(first_run, 4, corpus, ckpt, other, root / "interleaved", deadline_s=300)
    return root, corpus, ckpt, other, results


def variant(root: Path, ckpt: Path, name: str) -> Path:
    """A copy of the run's checkpoints to damage."""
    out = root / name
    shutil.copytree(ckpt, out)
    return out


def shard(path: Path, rank: int) -> Path:
    return path / "optimizer" / f"__{rank}_0.distcp"


@pytest.fixture(scope="module")
def bad(work) -> dict[str, Path]:
    """Checkpoints that load_checkpoint must refuse, each with one line naming the file."""
    root, _, ckpt, other, _ = work
    cases = {}
    p = variant(root, ckpt, "corrupt") / LAST
    data = bytearray(shard(p, 1).read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard(p, 1).write_bytes(bytes(data))
    cases["corrupt"] = p
    p = variant(root, ckpt, "truncated") / LAST
    with shard(p, 2).open("r+b") as fh:
        fh.truncate(shard(p, 2).stat().st_size // 2)
    cases["truncated"] = p
    p = variant(root, ckpt, "missing") / LAST
    shard(p, 3).unlink()
    cases["missing"] = p
    p = variant(root, ckpt, "schema") / LAST
    manifest = json.loads((p / MANIFEST_FILE).read_text())
    (p / MANIFEST_FILE).write_text(json.dumps({**manifest, "schema": "hydraulis.checkpoint/9"}))
    cases["schema"] = p
    p = variant(root, ckpt, "no-manifest") / LAST
    (p / MANIFEST_FILE).unlink()
    cases["no-manifest"] = p
    cases["shape"] = other / step_dir_name(0)
    p = variant(root, other, "shape-metadata") / step_dir_name(0)
    manifest = json.loads((p / MANIFEST_FILE).read_text())
    manifest["model"] = {**manifest["model"], "kv_heads": TINY.kv_heads, "name": "tiny"}  # lies; DCP's metadata tells
    (p / MANIFEST_FILE).write_text(json.dumps(manifest))
    cases["shape-metadata"] = p
    return cases


@pytest.fixture(scope="module")
def resumed(work, bad):
    root, corpus, ckpt, _, _ = work
    fallback = variant(root, ckpt, "fallback")
    (fallback / LAST / MANIFEST_FILE).unlink()  # killed before the manifest: the previous one is loaded
    return run_workers(resume_same, 4, corpus, bad, ckpt, fallback, root / "interleaved", deadline_s=300)


def randomised_hf_model(spec, seed: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config(spec)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(std=p.shape[-1] ** -0.5 if p.dim() == 2 and "embed" not in name else 0.5)
    return model


@pytest.fixture(scope="module")
def resharded(work):
    root, corpus, ckpt, _, _ = work
    hf_dir = root / "hf-in"
    model = randomised_hf_model(TINY, SEED)
    model.save_pretrained(hf_dir)
    results = run_workers(resume_resharded_and_hf, 2, corpus, ckpt, hf_dir, root / "hf-run", deadline_s=300)
    return hf_dir, model, results


# -- helpers ----------------------------------------------------------------------------------------
def our_loss(spec, state: dict[str, torch.Tensor], docs: list[np.ndarray]) -> float:
    model = StageModel(spec)
    model.load_full_state_dict(state)
    packed = concatenate_documents([torch.from_numpy(np.asarray(d, dtype=np.int64)) for d in docs])
    with torch.no_grad():
        logits = model(packed.tokens, packed)
        loss = F.cross_entropy(logits, packed.targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return float(loss) / count_targets([len(d) for d in docs])


def first_batch(corpus_dir: Path) -> list[np.ndarray]:
    corpus = open_corpus(corpus_dir)
    batch = TokenBudgetSampler(corpus.lengths, TOKENS_PER_BATCH, max_len=MAX_LEN, seed=SEED).next_batch()
    return [np.asarray(t) for t in batch.tokens(corpus)]


def canonical_vector(spec, hf_state: dict[str, torch.Tensor]) -> torch.Tensor:
    layout = ShardLayout(spec, 1)
    return torch.cat([p.to_canonical(hf_state[hf_name(p.name)].float()) for p in layout.params])


def rel(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.array(a) - np.array(b)) / np.abs(np.array(b))))


# -- the first run -------------------------------------------------------------------------------------
def test_saves_keep_the_last_k_with_a_complete_manifest(work):
    _, corpus, ckpt, _, results = work
    assert [s for s, _ in list_checkpoints(ckpt)] == list(range(SAVE_AT - KEEP + 1, SAVE_AT + 1))
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]  # no temporary directory left
    info = read_manifest(ckpt / LAST)
    assert (info.step, info.world_size, info.optimizer_step) == (SAVE_AT, 4, SAVE_AT)
    assert info.tokenizer == "bytes"
    assert info.corpus_sha256 == open_corpus(corpus).manifest.checksums
    assert info.pool == ("1x(tp2,pp1) + 2x(tp1,pp1)", "2x(tp1,pp2)", "1x(tp2,pp2)")
    # The sampler state is the batch the uninterrupted run trained next, not the one drawn ahead.
    assert (info.sampler.epoch, info.sampler.position) == tuple(results[0]["full_positions"][SAVE_AT])
    shards = [f"optimizer/__{r}_0.distcp" for r in range(4)]
    assert sorted(info.files) == sorted(["optimizer/.metadata", *shards, *(f"rng-{r:05d}.json" for r in range(4))])
    assert json.loads((ckpt / LAST / MANIFEST_FILE).read_text())["schema"] == CHECKPOINT_SCHEMA
    assert results[0]["first"] == results[0]["full"][:SAVE_AT]
    assert set(info.missed) <= set(info.pool)  # rank 0's record of the deployments that missed a batch


def test_a_resume_keeps_the_deployments_that_missed_a_batch():
    """The feed's state carries rank 0's record of the pool deployments that could not hold some batch, by
    text: a resumed run's comparison leaves them out too, even on a pool listed in another order."""
    from train_workers import corpus, settings

    from hydraulis.runtime.plan_feed import PlanFeed

    s = settings()
    lengths = [len(d) for d in corpus(s.model.vocab)]

    def feed(pool):
        return PlanFeed(TokenBudgetSampler(lengths, 700, 160, seed=1), pool, s.parallel.cost, 0, 4, None)

    before = feed(s.parallel.pool)
    before.planner.missed.add(1)
    state = before.state_dict()
    assert state["missed"] == [str(s.parallel.pool[1])]
    after = feed(s.parallel.pool[::-1])
    after.load_state_dict(state)
    assert after.planner.missed == {len(s.parallel.pool) - 2}
    worker = PlanFeed(TokenBudgetSampler(lengths, 700, 160, seed=1), s.parallel.pool, s.parallel.cost, 1, 4, None)
    assert worker.planner is None and worker.state_dict()["missed"] == []  # only rank 0 plans
    worker.load_state_dict(state)
    assert worker.step == state["step"]


def _timeless(data):
    """A schedule's JSON without the seconds its planning took (the one thing two plannings differ in)."""
    if isinstance(data, dict):
        return {k: _timeless(v) for k, v in data.items() if k != "planning_time_s"}
    return [_timeless(v) for v in data] if isinstance(data, list) else data


def test_a_feed_that_plans_when_its_step_begins_gives_the_same_batches_plans_and_positions():
    """Where CPU ranks fill the cores the feed plans a batch when its step begins, not beside the last step's
    compute: nothing is planned between steps, and the batches, schedules and checkpoint positions are those of
    a feed planning ahead (so a resume continues either alike)."""
    from train_workers import corpus, settings

    from hydraulis.runtime.plan_feed import PlanFeed

    s = settings()
    lengths = [len(d) for d in corpus(s.model.vocab)]
    feeds = [PlanFeed(TokenBudgetSampler(lengths, 700, 160, seed=1), s.parallel.pool, s.parallel.cost, 0, 4, None,
                      ahead=ahead) for ahead in (True, False)]
    for feed in feeds:
        feed.world = 1  # its broadcast is then local: this process plans and reads its own plans
    try:
        for step in range(4):
            (b1, p1, _), (b2, p2, _) = (feed.next() for feed in feeds)
            assert np.array_equal(b1.lengths, b2.lengths) and _timeless(p1.to_dict()) == _timeless(p2.to_dict()), step
            assert feeds[0]._pending is not None and feeds[1]._pending is None  # the next plan: ahead, or not yet
            assert feeds[0].state_dict() == feeds[1].state_dict()
            for feed in feeds:
                feed.step += 1
    finally:
        for feed in feeds:
            feed.close()


def test_latest_skips_partial_checkpoints_and_sweeps_temporary_ones(work):
    root, _, ckpt, _, _ = work
    lines: list[str] = []
    swept = variant(root, ckpt, "swept")
    tmp = swept / f".{step_dir_name(SAVE_AT + 1)}.tmp"
    (tmp / "optimizer").mkdir(parents=True)
    (tmp / "optimizer" / "__0_0.distcp").write_bytes(b"half")
    assert latest_checkpoint(swept, log=lines.append) == swept / LAST
    assert not tmp.exists()
    assert len(lines) == 1 and str(tmp) in lines[0]
    for damage in ("no-manifest", "truncated", "missing"):
        lines.clear()
        damaged = variant(root, ckpt, f"latest-{damage}")
        if damage == "no-manifest":
            (damaged / LAST / MANIFEST_FILE).unlink()
        elif damage == "truncated":
            with shard(damaged / LAST, 0).open("r+b") as fh:
                fh.truncate(10)
        else:
            shard(damaged / LAST, 2).unlink()
        assert latest_checkpoint(damaged, log=lines.append) == damaged / PREVIOUS, damage
        assert len(lines) == 1 and str(damaged / LAST) in lines[0], lines
    assert latest_checkpoint(root / "nothing-here", log=lines.append) is None


def test_a_truncated_manifest_is_one_line_naming_it(work):
    root, _, ckpt, _, _ = work
    p = variant(root, ckpt, "bad-json") / LAST
    text = (p / MANIFEST_FILE).read_text()
    (p / MANIFEST_FILE).write_text(text[: len(text) // 2])
    with pytest.raises(HydraulisError, match="not valid JSON") as exc:
        read_manifest(p)
    assert str(p / MANIFEST_FILE) in str(exc.value) and "\n" not in str(exc.value)


# -- resume in new processes ---------------------------------------------------------------------------
def test_resume_continues_bit_for_bit(work, resumed):
    full = work[4][0]
    for r in resumed:
        assert r["step"] == SAVE_AT and r["saved_world"] == 4
        assert r["losses"] == full["full"][SAVE_AT:]  # ==: the same bits
        assert r["positions"] == full["full_positions"][SAVE_AT:]
    assert [r["rng"] for r in resumed] == [r["rng"] for r in work[4]]  # each rank's torch, numpy, python RNGs
    assert len({str(r["rng"]) for r in resumed}) == len(resumed)
    for key in ("master", "exp_avg"):
        got = torch.cat([r[key] for r in resumed])
        want = torch.cat([r[key] for r in work[4]])
        assert torch.equal(got, want), key
    print(f"\nbit-for-bit resume: losses {resumed[0]['losses']} == {full['full'][SAVE_AT:]}")


def test_a_checkpoint_resumes_bit_for_bit_with_interleaving_changed(work, resumed):
    """Saved at vp = 1, resumed at vp = 2 and back (2x(tp1,pp2) and 2x(tp1,pp2,vp2), whose plans hold the same
    micro-batches): each run's losses and master weights are the bits of an uninterrupted vp = 1 run; the resumed
    runs defer their weight gradients (zero-bubble W's, ckpt_workers.resume_interleaving), which changes no bit."""
    full, master = work[4][0]["full_v1"], [r["master_v1"] for r in work[4]]
    for saved in ("v1", "v2"):
        for rank, r in enumerate(resumed):
            losses, got = r[f"from_{saved}"]
            assert losses == full[SAVE_AT:], (saved, losses, full)  # ==: the same bits
            assert torch.equal(got, master[rank]), saved


EXPECTED_ERRORS = {
    "corrupt": ("__1_0.distcp", "checksum"),
    "truncated": ("__2_0.distcp", "truncated"),
    "missing": ("__3_0.distcp", "missing"),
    "schema": (MANIFEST_FILE, "schema"),
    "no-manifest": (LAST, "no manifest.json"),
    "shape": (MANIFEST_FILE, "kv_heads=4"),
    "shape-metadata": (".metadata", "has shape"),
}


def test_bad_checkpoints_are_refused_before_anything_changes(resumed, bad):
    for name, (where, what) in EXPECTED_ERRORS.items():
        messages = {r["errors"][name] for r in resumed}
        assert len(messages) == 1, (name, messages)  # every rank raises the same error
        message = messages.pop()
        assert message is not None, name
        assert "\n" not in message and where in message and what in message, (name, message)
        assert str(bad[name]) in message, (name, message)
    assert all(r["untouched"] for r in resumed)


def test_a_checkpoint_killed_before_its_manifest_falls_back_to_the_previous(resumed):
    assert {r["fallback_step"] for r in resumed} == {SAVE_AT - 1}


# -- 4 ranks -> 2 ranks, another pool ------------------------------------------------------------------
def test_resume_on_two_ranks_with_another_pool(work, resharded):
    full = work[4][0]["full"]
    _, _, results = resharded
    got = results[0]["losses"]
    assert results[0]["step"] == SAVE_AT
    diff = rel(got, full[SAVE_AT:])
    print(f"\n4 -> 2 ranks resharded resume: max relative loss difference {diff:.2e}")
    assert diff < 1e-5
    master = ShardLayout(TINY, 2).assemble([r["master"] for r in results])
    want = ShardLayout(TINY, 4).assemble([r["master"] for r in work[4]])
    assert float((master - want).norm() / want.norm()) < 1e-5


# -- Hugging Face ----------------------------------------------------------------------------------------
def test_training_from_hf_starts_at_hf_loss(work, resharded):
    _, corpus, _, _, _ = work
    _, model, results = resharded
    state = {k: v.detach() for k, v in model.state_dict().items()}
    initial = ShardLayout(TINY, len(results)).assemble([r["hf_initial"] for r in results])
    assert torch.equal(initial, canonical_vector(TINY, state))
    want = hf_loss(model, first_batch(corpus))
    got = results[0]["hf_losses"][0]
    print(f"\ninit_from HF: first loss {got:.7f}, HF's {want:.7f}, rel {abs(got - want) / want:.1e}")
    assert got == pytest.approx(want, rel=1e-5)
    assert results[0]["hf_losses"][-1] < got


def test_init_from_reads_only_each_owners_range(resharded):
    hf_dir, model, _ = resharded
    state = {k: v.detach() for k, v in model.state_dict().items()}
    parts = []
    for rank in range(3):  # uneven ranges that cut tensors anywhere, row- and column-wise
        opt = ShardedOptimizer(ShardLayout(TINY, 3), rank, AdamWSettings())
        assert init_from(opt, hf_dir).hidden == TINY.hidden
        parts.append(opt.master)
    assert torch.equal(ShardLayout(TINY, 3).assemble(parts), canonical_vector(TINY, state))


def test_init_from_refuses_other_configs(tmp_path):
    opt = ShardedOptimizer(ShardLayout(TINY, 1), 0, AdamWSettings())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(HydraulisError, match="model_type") as exc:
        init_from(opt, tmp_path)
    assert str(tmp_path / "config.json") in str(exc.value) and "\n" not in str(exc.value)
    config = hf_config(MODELS["tiny-mha"]).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HydraulisError, match="kv_heads=4"):
        init_from(opt, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(TINY).to_dict()))
    with pytest.raises(HydraulisError, match="model.safetensors: no such file"):
        init_from(opt, tmp_path)


def test_export_loads_in_transformers_with_our_loss(work, resharded, cli, tmp_path):
    transformers = pytest.importorskip("transformers")
    _, _, results = resharded
    ckpt = Path(results[0]["hf_saved"])
    assert sorted(p.name for p in ckpt.parent.iterdir()) == [ckpt.name]  # replaced, nothing left beside it
    out = tmp_path / "hf-out"
    done = cli("export", "--checkpoint", str(ckpt), "--out", str(out))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert [Path(line.split()[1]).name for line in lines] == files  # the bytes tokenizer written as HF files
    assert sorted(p.name for p in out.iterdir()) == files
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (256, None)  # the bytes tokenizer's end of document
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    model = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    info, master = load_master(ckpt)
    assert torch.equal(master, ShardLayout(TINY, len(results)).assemble([r["hf_master"] for r in results]))
    ours = unflatten(ShardLayout(TINY, 1), master)
    exported = {k: v.detach() for k, v in model.state_dict().items()}
    assert set(exported) == {hf_name(n) for n in full_shapes(TINY)}
    assert all(torch.equal(exported[hf_name(n)], t) for n, t in ours.items())
    rng = np.random.default_rng(99)
    held_out = [rng.integers(0, 257, size=int(n)) for n in (17, 64, 5, 120)]
    theirs, mine = hf_loss(model, held_out), our_loss(TINY, ours, held_out)
    print(f"\nexport: held-out loss HF {theirs:.7f}, ours {mine:.7f}, rel {abs(theirs - mine) / mine:.1e}")
    assert theirs == pytest.approx(mine, rel=1e-4)
    assert info.step == 3


def test_export_bad_input_is_one_line_and_writes_nothing(work, cli, tmp_path):
    root, _, ckpt, _, _ = work
    broken = variant(root, ckpt, "export-broken") / LAST
    shard(broken, 0).write_bytes(b"x" * shard(broken, 0).stat().st_size)  # same size, other bytes
    for source, what in ((broken, "checksum"), (tmp_path / "nope", "no such checkpoint")):
        out = tmp_path / "out"
        done = cli("export", "--checkpoint", str(source), "--out", str(out))
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and what in done.stderr, done.stderr
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    existing = tmp_path / "taken"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    done = cli("export", "--checkpoint", str(ckpt / LAST), "--out", str(existing))
    assert done.returncode == 2 and "--force" in done.stderr
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]
