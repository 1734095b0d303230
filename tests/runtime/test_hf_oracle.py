"""An outside oracle: Hugging Face's own classes compute what our model computes.

One model per family (LLaMA with and without LLaMA 3 RoPE scaling, Mistral,
Qwen2 with q/k/v biases and tied embeddings, Qwen3 with q/k norms and its own
head_dim) and a padded vocabulary, each against transformers' class of
that family (`AutoModelForCausalLM.from_config`).

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
from hydraulis.families import ARCHITECTURES, hf_tensor_shapes, spec_from_hf_config  # noqa: E402
from hydraulis.runtime import IGNORE_INDEX, StageModel, concatenate_documents, count_targets, micro_batch_loss  # noqa: E402
from hydraulis.runtime.optimizer.layout import full_shapes, reset_parameters  # noqa: E402
from hydraulis.runtime.storage.hf import (  # noqa: E402
    from_hf_state_dict,
    hf_config,
    hf_name,
    our_name,
    to_hf_state_dict,
)
from hydraulis.specs import MODELS, Architecture  # noqa: E402

RTOL = 1e-5
SEED = 4321
LENGTHS = (13, 4, 29, 1, 17, 8)  # a one-token document has no target, but still goes through the model
GQA = MODELS["tiny"]  # heads 4, kv_heads 2
MHA = MODELS["tiny-mha"]
MQA = replace(GQA, name="tiny-mqa", kv_heads=1)
# original_max_position_embeddings 64: of the 8 frequencies of head_dim 16, one is kept, one smoothed, six divided
LLAMA3 = replace(GQA, name="tiny-llama3", arch=Architecture(rope_theta=500000.0, norm_eps=1e-6,
                                                             rope_llama3=(8.0, 1.0, 4.0, 64)))  # fmt: skip
MISTRAL = replace(GQA, name="tiny-mistral", arch=Architecture(family="mistral", rope_theta=1e6, norm_eps=1e-6))
QWEN2 = replace(GQA, name="tiny-qwen2", arch=Architecture(family="qwen2", qkv_bias=True, rope_theta=1e6, norm_eps=1e-6))
QWEN2_TIED = replace(QWEN2, name="tiny-qwen2-tied", arch=replace(QWEN2.arch, tied_embeddings=True))
QWEN3 = replace(GQA, name="tiny-qwen3", arch=Architecture(family="qwen3", qk_norm=True, head_dim=32, norm_eps=1e-6))
PADDED = replace(GQA, name="tiny-padded", vocab=509, padded_vocab=512)  # as a tp4 pool pads 509
QWEN2_PADDED = replace(QWEN2, name="tiny-qwen2-padded", vocab=509, padded_vocab=512)
FAMILIES = (LLAMA3, MISTRAL, QWEN2, QWEN2_TIED, QWEN3, PADDED)
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
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    assert type(model).__name__ == ARCHITECTURES[spec.arch.family]  # transformers' own class of the family
    spread_weights(model, spec.hidden if spec.arch.tied_embeddings else None)
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


@pytest.mark.parametrize("spec", [GQA, MHA, *FAMILIES], ids=lambda s: s.name)
def test_packed_model_matches_hf_per_document(spec):
    ref = hf_reference(spec)
    model = StageModel(spec)
    model.load_full_state_dict(ref["state"])
    docs = documents(spec.vocab)
    batch = concatenate_documents(docs)
    logits = model(batch.tokens, batch)
    assert logits.shape[-1] == spec.vocab_rows
    # padded ids never win: their logits are -inf (and so take no probability, loss or gradient)
    assert torch.all(logits[:, spec.vocab :] == float("-inf"))
    bounds = batch.cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        torch.testing.assert_close(logits[start:end, : spec.vocab], ref["logits"][i], rtol=RTOL, atol=RTOL)
        targets = batch.targets[start:end]
        doc_loss = F.cross_entropy(logits[start:end], targets, ignore_index=IGNORE_INDEX, reduction="sum")
        assert float(doc_loss.detach()) == pytest.approx(ref["losses"][i], rel=RTOL, abs=1e-6), f"document {i}"
    loss = micro_batch_loss(model, batch.tokens, batch) / count_targets(LENGTHS)
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
    for scenario, spec in (("tp4-gqa", GQA), ("tp4-gqa-sp", GQA), ("tp2pp2-mqa", MQA),
                           ("tp4-qwen2-padded", QWEN2_PADDED), ("tp2pp2-qwen2-tied", QWEN2_TIED),
                           ("tp4-qwen3-sp", QWEN3), ("tp2pp2-llama3", LLAMA3)):  # fmt: skip
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
    # A tensor held by two stages (a tied embedding) has the sum of their gradients, as the optimizer sums them.
    by_stage = {rep["stage"]: rep["grads"] for rep in reports}
    grads: dict[str, torch.Tensor] = {}
    for stage_grads in by_stage.values():
        for name, g in stage_grads.items():
            grads[name] = grads[name] + g if name in grads else g
    for rep in reports:  # every TP rank of a stage has the same full gradients
        for name, g in rep["grads"].items():
            assert torch.equal(g, by_stage[rep["stage"]][name]), f"{scenario}: {name} differs within a stage"
    for name, g in grads.items():
        err = rel_err(g, ref["grads"][name])
        assert err <= RTOL, f"{scenario}: {name} rel err {err:.2e}"
    assert set(grads) == set(full_shapes(spec))


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


@pytest.mark.parametrize("spec", [QWEN2_TIED, QWEN2_PADDED], ids=lambda s: s.name)
def test_state_dict_round_trip_of_tied_and_padded_models(spec):
    ours = StageModel(spec)
    reset_parameters(ours, 7)
    state = dict(ours.state_dict())
    hf = to_hf_state_dict(state, spec)
    assert set(hf) == set(hf_reference(spec)["hf_state"])
    assert hf["model.embed_tokens.weight"].shape[0] == spec.vocab  # padded rows trimmed
    back = from_hf_state_dict({**hf, "lm_head.weight": hf["model.embed_tokens.weight"]} if spec.arch.tied_embeddings
                              else hf, spec)  # fmt: skip
    for name, t in state.items():
        rows = spec.vocab if name in ("embedding.weight", "output.weight") else None
        assert torch.equal(back[name][:rows], t[:rows])
        assert not back[name][spec.vocab :].any() if rows else True  # padded rows come in as zeros


@pytest.mark.parametrize("spec", [GQA, MHA, *FAMILIES], ids=lambda s: s.name)
def test_the_weights_check_expects_what_transformers_saves(spec):
    """families.hf_tensor_shapes (the torch-free check of init_from's weights) is the tensors transformers'
    own model of the family has, and the runtime's parameters map onto them one to one."""
    model = transformers.AutoModelForCausalLM.from_config(hf_config(spec))
    theirs = {name: tuple(p.shape) for name, p in model.named_parameters()}  # a tied head appears once
    assert hf_tensor_shapes(spec) == theirs
    ours = {hf_name(n): (spec.vocab, *s[1:]) if n in ("embedding.weight", "output.weight") else s
            for n, s in full_shapes(spec).items()}  # fmt: skip
    assert ours == theirs


@pytest.mark.parametrize("spec", [GQA, MHA, MQA, MODELS["llama-70b"], *FAMILIES], ids=lambda s: s.name)
def test_spec_survives_hf_config(spec):
    config = hf_config(spec).to_dict()
    assert config["model_type"] == spec.arch.family
    assert spec_from_hf_config(config, spec.name) == replace(spec, padded_vocab=0)  # HF has no padding


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
        ({"model_type": "gemma"}, "model_type is 'gemma'"),
        ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
        ({"attention_bias": True}, "attention_bias is True"),
        ({"mlp_bias": True}, "mlp_bias is True"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.rope_type is 'yarn'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_parameters of type llama3 has no"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type is 'linear'"),
        ({"model_type": "qwen2", "rope_scaling": {"rope_type": "llama3"}}, "rope_scaling.rope_type is 'llama3'"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias is True"),
        ({"model_type": "mistral", "sliding_window": 100}, "sliding_window is 100, below max_len 200"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
         "sliding_window is 64, below max_len 200"),  # fmt: skip
        ({"attention_dropout": 0.1}, "attention_dropout is 0.1"),
        ({"head_dim": 32}, "head_dim is 32"),
        ({"num_key_value_heads": 3}, "heads 4 is not divisible by kv_heads 3"),
    ],
)
def test_bad_configs_name_the_key(change, message):
    config = {**hf_config(GQA).to_dict(), **change}
    with pytest.raises(HydraulisError, match=re.escape(message)) as info:
        spec_from_hf_config(config, "bad", max_len=200)
    assert "\n" not in str(info.value)


def test_sliding_windows_that_do_not_act_are_accepted():
    mistral = {**hf_config(MISTRAL).to_dict(), "sliding_window": 4096}
    assert spec_from_hf_config(mistral, "m", max_len=4096).arch.family == "mistral"
    qwen2 = {**hf_config(QWEN2).to_dict(), "use_sliding_window": False, "sliding_window": 64}
    assert spec_from_hf_config(qwen2, "q", max_len=4096) == replace(QWEN2, name="q")


def test_missing_keys_mean_the_family_defaults():
    config = hf_config(GQA).to_dict()
    del config["rms_norm_eps"]
    assert spec_from_hf_config(config, "x").arch.norm_eps == 1e-6  # LlamaConfig's default
    config = hf_config(QWEN3).to_dict()
    del config["head_dim"]
    assert spec_from_hf_config(config, "x").head_dim == 128  # Qwen3Config's default


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
        to_hf_state_dict({k: v for k, v in state.items() if k != "layers.2.ffn.w2.weight"}, GQA)
    with pytest.raises(HydraulisError, match=r"layers\.0\.attn\.wq\.bias"):
        to_hf_state_dict({**state, "layers.0.attn.wq.bias": torch.zeros(64)}, GQA)
    with pytest.raises(HydraulisError, match=r"output\.weight: shape \(512, 32\)"):
        to_hf_state_dict({**state, "output.weight": torch.zeros(512, 32)}, GQA)


def test_transformers_stays_lazy():
    # hydraulis.runtime (and its hf module) must import without importing transformers.
    code = "import sys, hydraulis.runtime, hydraulis.runtime.storage.hf; assert 'transformers' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
