"""An outside oracle: Hugging Face's LlamaForCausalLM computes what our model computes.

Every other runtime test compares our parallel layouts with our own
single-process model; here that model (and its TP/PP layouts) meets an
implementation written by someone else. HF runs each document alone (plain
positions, a causal mask, eager attention); we pack the documents into one
micro-batch. Logits, per-document losses and the gradient of every
parameter must agree (fp32, relative 1e-5). Weights are random (seeded) and
scaled so that attention is far from uniform and norms are not all ones;
nothing is downloaded.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import hf_workers  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from dist_launcher import run_workers  # noqa: E402
from hf_helpers import spread_weights  # noqa: E402

from hydraulis.errors import HydraulisError  # noqa: E402
from hydraulis.runtime import IGNORE_INDEX, StageModel, count_targets, micro_batch_loss, pack_documents  # noqa: E402
from hydraulis.runtime.hf import (  # noqa: E402
    from_hf_state_dict,
    hf_config,
    hf_name,
    our_name,
    spec_from_hf_config,
    to_hf_state_dict,
)
from hydraulis.runtime.layout import full_shapes, reset_parameters  # noqa: E402
from hydraulis.specs import MODELS  # noqa: E402

RTOL = 1e-5
SEED = 4321
LENGTHS = (13, 4, 29, 1, 17, 8)  # a one-token document has no target, but still goes through the model
GQA = MODELS["tiny"]  # heads 4, kv_heads 2
MHA = MODELS["tiny-mha"]
MQA = replace(GQA, name="tiny-mqa", kv_heads=1)
MICRO_BATCHES = ((0, 1, 3), (2,), (4, 5))  # for the gloo runs: 3 micro-batches of different token counts


def documents(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, vocab, (s,), generator=g) for s in LENGTHS]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@functools.cache
def hf_reference(spec):
    """HF on each document alone: its weights (our names), logits, per-document losses, gradients (our names).

    The loss is the sum of token cross-entropies over all documents divided by
    their targets, as `train_step` computes it.
    """
    torch.manual_seed(SEED)
    config = hf_config(spec)
    config._attn_implementation = "eager"  # its own matmul-softmax attention, not our SDPA path
    model = spread_weights(transformers.LlamaForCausalLM(config).float().eval())
    docs = documents(spec.vocab)
    total = count_targets(LENGTHS)
    logits, losses = [], []
    for doc in docs:
        out = model(input_ids=doc[None], use_cache=False).logits[0]
        logits.append(out.detach())
        losses.append(F.cross_entropy(out[:-1], doc[1:], reduction="sum"))
    (sum(losses) / total).backward()
    grads = from_hf_state_dict({n: p.grad for n, p in model.named_parameters()}, spec)
    weights = from_hf_state_dict({n: p.detach().clone() for n, p in model.named_parameters()}, spec)
    return {
        "state": weights,
        "hf_state": {n: p.detach().clone() for n, p in model.named_parameters()},
        "logits": logits,
        "losses": [float(x.detach()) for x in losses],
        "loss": float(sum(losses).detach() / total),
        "grads": grads,
    }


# ------------------------------------------------------------ one process


@pytest.mark.parametrize("spec", [GQA, MHA], ids=lambda s: s.name)
def test_packed_model_matches_hf_per_document(spec):
    ref = hf_reference(spec)
    model = StageModel(spec)
    model.load_full_state_dict(ref["state"])
    docs = documents(spec.vocab)
    batch = pack_documents(docs)
    logits = model(batch.tokens, batch)
    bounds = batch.cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        torch.testing.assert_close(logits[start:end], ref["logits"][i], rtol=RTOL, atol=RTOL)
        targets = batch.targets[start:end]
        doc_loss = F.cross_entropy(logits[start:end], targets, ignore_index=IGNORE_INDEX, reduction="sum")
        assert float(doc_loss.detach()) == pytest.approx(ref["losses"][i], rel=RTOL, abs=1e-6), f"document {i}"
    loss = micro_batch_loss(model, logits, batch) / count_targets(LENGTHS)
    assert float(loss.detach()) == pytest.approx(ref["loss"], rel=RTOL)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert set(grads) == set(ref["grads"])
    for name, g in grads.items():
        assert rel_err(g, ref["grads"][name]) <= RTOL, f"{name}: rel err {rel_err(g, ref['grads'][name]):.2e}"


# ------------------------------------------------------------ tensor parallel, 4 gloo ranks


@pytest.fixture(scope="module")
def four_rank_results():
    cases = {}
    for scenario, spec in (("tp4-gqa", GQA), ("tp4-gqa-sp", GQA), ("tp2pp2-mqa", MQA)):
        cases[scenario] = (spec, hf_reference(spec)["state"], documents(spec.vocab), MICRO_BATCHES)
    return cases, run_workers(hf_workers.run_scenarios, 4, cases, deadline_s=90)


@pytest.mark.dist
@pytest.mark.parametrize("scenario", list(hf_workers.SCENARIOS))
def test_tensor_parallel_beyond_kv_heads_matches_hf(four_rank_results, scenario):
    cases, results = four_rank_results
    spec = cases[scenario][0]
    ref = hf_reference(spec)
    reports = [r[scenario] for r in results]
    losses = [r["loss"] for r in reports if r["loss"] is not None]
    assert losses
    for loss in losses:
        assert loss == pytest.approx(ref["loss"], rel=RTOL)
    seen = set()
    for rep in reports:
        for name, g in rep["grads"].items():
            err = rel_err(g, ref["grads"][name])
            assert err <= RTOL, f"{scenario} stage {rep['stage']}: {name} rel err {err:.2e}"
            seen.add(name)
    assert seen == set(full_shapes(spec))


# ------------------------------------------------------------ the mapping


def test_state_dict_round_trip_is_identity():
    ours = StageModel(GQA)
    reset_parameters(ours, 7)
    state = dict(ours.state_dict())
    hf = to_hf_state_dict(state, GQA)
    assert set(hf) == set(hf_reference(GQA)["hf_state"])  # exactly HF's parameter names
    back = from_hf_state_dict(hf, GQA)
    assert set(back) == set(state)
    for name, t in state.items():
        assert torch.equal(back[name], t)
        assert hf_name(name) in hf and our_name(hf_name(name)) == name
    assert set(to_hf_state_dict(state)) == set(hf)  # without a spec, names alone


@pytest.mark.parametrize("spec", [GQA, MHA, MQA, MODELS["llama-70b"]], ids=lambda s: s.name)
def test_spec_survives_hf_config(spec):
    assert spec_from_hf_config(hf_config(spec).to_dict(), spec.name) == spec


def test_transformers4_style_config_dict():
    # config.json of a transformers 4.x LLaMA checkpoint: rope_theta and rope_scaling at top level.
    config = {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": 512,
    }
    assert spec_from_hf_config(config, "tiny") == GQA


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type is 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings is True"),
        ({"attention_bias": True}, "attention_bias is True"),
        ({"mlp_bias": True}, "mlp_bias is True"),
        ({"rms_norm_eps": 1e-6}, "rms_norm_eps is 1e-06"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, "rope_parameters.rope_theta is 500000"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0}}, "rope_parameters.rope_type is 'llama3'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling is"),
        ({"rope_parameters": None, "rope_theta": 1e6}, "rope_theta is 1000000"),
        ({"attention_dropout": 0.1}, "attention_dropout is 0.1"),
        ({"head_dim": 32}, "head_dim is 32"),
        ({"num_key_value_heads": 3}, "heads 4 is not divisible by kv_heads 3"),
    ],
)
def test_bad_configs_name_the_key(change, message):
    config = {**hf_config(GQA).to_dict(), **change}
    with pytest.raises(HydraulisError, match=re.escape(message)) as info:
        spec_from_hf_config(config, "bad")
    assert "\n" not in str(info.value)


def test_missing_eps_means_hf_default():
    config = hf_config(GQA).to_dict()
    del config["rms_norm_eps"]
    with pytest.raises(HydraulisError, match=r"rms_norm_eps is 1e-06"):
        spec_from_hf_config(config, "bad")


def test_state_dict_errors_name_the_key():
    hf = dict(hf_reference(GQA)["hf_state"])
    state = from_hf_state_dict(hf, GQA)
    with pytest.raises(HydraulisError, match=r"model\.layers\.3\.mlp\.up_proj\.weight"):
        from_hf_state_dict({k: v for k, v in hf.items() if k != "model.layers.3.mlp.up_proj.weight"}, GQA)
    with pytest.raises(HydraulisError, match=r"model\.layers\.4\.mlp\.up_proj\.weight"):  # a layer too many
        from_hf_state_dict({**hf, "model.layers.4.mlp.up_proj.weight": hf["model.layers.3.mlp.up_proj.weight"]}, GQA)
    with pytest.raises(HydraulisError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        from_hf_state_dict({**hf, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, GQA)
    with pytest.raises(HydraulisError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight: shape \(64, 64\)"):
        from_hf_state_dict({**hf, "model.layers.1.self_attn.k_proj.weight": torch.zeros(64, 64)}, GQA)
    # old checkpoints' saved RoPE buffers are derived data, skipped
    assert set(from_hf_state_dict({**hf, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}, GQA)) == set(
        state
    )
    with pytest.raises(HydraulisError, match=r"layers\.2\.ffn\.w2\.weight"):
        to_hf_state_dict({k: v for k, v in state.items() if k != "layers.2.ffn.w2.weight"})
    with pytest.raises(HydraulisError, match=r"layers\.0\.attn\.wq\.bias"):
        to_hf_state_dict({**state, "layers.0.attn.wq.bias": torch.zeros(64)})
    with pytest.raises(HydraulisError, match=r"output\.weight: shape \(512, 32\)"):
        to_hf_state_dict({**state, "output.weight": torch.zeros(512, 32)}, GQA)


def test_transformers_stays_lazy():
    # hydraulis.runtime (and its hf module) must import without importing transformers.
    code = "import sys, hydraulis.runtime, hydraulis.runtime.hf; assert 'transformers' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
