from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment, ParallelConfig, format_configs, parse_deployment_configs
from hydraulis.planner.pool import inline_pool_world, parse_pool
from hydraulis.specs import ClusterSpec, get_model


def test_compact_text_round_trips():
    text = "1x(tp8,pp1) + 6x(tp2,pp2)"
    configs = parse_deployment_configs(text)
    assert configs == [ParallelConfig(8, 1)] + [ParallelConfig(2, 2)] * 6
    assert format_configs(configs) == text
    assert str(Deployment.parse(text, ClusterSpec(32))) == text


def test_config_parse_forms():
    assert ParallelConfig.parse("tp2pp4") == ParallelConfig(2, 4)
    assert ParallelConfig.parse("(tp2, pp4, cp2)") == ParallelConfig(2, 4, 2)
    with pytest.raises(HydraulisError, match="cannot parse"):
        ParallelConfig.parse("tp2xx")


def test_placement_keeps_tp_groups_in_a_node():
    cluster = ClusterSpec(32, 8)
    dep = Deployment.parse("1x(tp8,pp1) + 1x(tp4,pp2) + 4x(tp2,pp1) + 4x(tp1,pp2)", cluster)
    dep.validate(cluster)
    _stages_in_a_node(dep, 8)
    assert sorted(d for r in dep.replicas for d in r.devices) == list(range(32))


def _stages_in_a_node(dep: Deployment, gpn: int) -> None:
    for replica in dep.replicas:
        for s in range(replica.config.pp):
            assert len({d // gpn for d in replica.stage_devices(s)}) == 1


def test_tp_above_node_takes_whole_nodes():
    cluster = ClusterSpec(32, 8)
    dep = Deployment.parse("1x(tp16,pp1) + 2x(tp8,pp1)", cluster)
    big = dep.replicas[0]
    assert sorted({d // 8 for d in big.devices}) in ([0, 1], [1, 2], [2, 3], [0, 2], [0, 3], [1, 3])
    assert len(big.devices) == 16


@pytest.mark.parametrize(
    ("text", "gpus", "gpn", "message"),
    [
        ("2x(tp8,pp1)", 32, 8, "uses 16 GPUs but the cluster has 32"),
        ("1x(tp3,pp1) + 1x(tp3,pp1) + 1x(tp2,pp1)", 8, 4, "no node has 2 free GPUs"),
        ("1x(tp12,pp1) + 1x(tp4,pp1)", 16, 8, "not a multiple"),
        ("3y(tp1,pp1)", 3, 8, "cannot parse"),
    ],
)
def test_impossible_deployments_are_named(text, gpus, gpn, message):
    with pytest.raises(HydraulisError, match=message):
        Deployment.parse(text, ClusterSpec(gpus, gpn))


def test_validate_against_model():
    model = get_model("llama-7b")
    with pytest.raises(HydraulisError, match="not divisible by pp=3"):
        ParallelConfig(1, 3).validate(model)
    with pytest.raises(HydraulisError, match="heads, not divisible by tp=3"):
        ParallelConfig(3, 1).validate(model)
    ParallelConfig(8, 4).validate(model)


def test_explicit_devices_are_checked():
    cluster = ClusterSpec(8, 8)
    c = ParallelConfig(4, 1)
    with pytest.raises(HydraulisError, match="used by two replicas"):
        Deployment.from_devices([c, c], [[0, 1, 2, 3], [3, 4, 5, 6]], cluster)
    with pytest.raises(HydraulisError, match="outside"):
        Deployment.from_devices([c, c], [[0, 1, 2, 3], [4, 5, 6, 9]], cluster)
    with pytest.raises(HydraulisError, match="spans nodes"):
        Deployment.from_devices(
            [ParallelConfig(4, 1)] * 4,
            [[6, 7, 8, 9], [0, 1, 2, 3], [4, 5, 10, 11], [12, 13, 14, 15]],
            ClusterSpec(16, 8),
        )


@given(
    st.lists(st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (4, 2), (8, 1), (1, 4)]), min_size=1, max_size=12)
)
def test_power_of_two_deployments_always_place(pairs):
    _placed_on_full_nodes([ParallelConfig(tp, pp) for tp, pp in pairs])


def _placed_on_full_nodes(configs: list[ParallelConfig]) -> tuple[Deployment, ClusterSpec]:
    """The configs padded to whole 8-GPU nodes with single GPUs (so the cluster is full), placed and validated,
    in the order given."""
    pad = (-sum(c.num_gpus for c in configs)) % 8
    configs = configs + [ParallelConfig(1, 1)] * pad
    cluster = ClusterSpec(sum(c.num_gpus for c in configs), 8)
    dep = Deployment.place(configs, cluster)
    dep.validate(cluster)
    assert dep.configs == tuple(configs)
    return dep, cluster


def test_deployment_rows_round_trip_and_name_the_bad_field():
    cluster = ClusterSpec(16)
    dep = Deployment.parse("1x(tp8,pp1) + 2x(tp2,pp2)", cluster)
    rows = dep.to_rows()
    assert rows[0] == {"tp": 8, "pp": 1, "cp": 1, "devices": list(dep.replicas[0].devices)}
    assert Deployment.from_rows(rows, cluster, "f.deployment") == dep
    bad = [dict(r) for r in rows]
    bad[1]["pp"] = 0
    with pytest.raises(HydraulisError, match=r"f\.deployment\[1\]\.pp: must be at least 1"):
        Deployment.from_rows(bad, cluster, "f.deployment")
    bad = [dict(r) for r in rows]
    bad[2]["devices"] = bad[1]["devices"]
    with pytest.raises(HydraulisError, match=r"^f\.deployment: .*used by two replicas"):
        Deployment.from_rows(bad, cluster, "f.deployment")


def _tp_groups_in_a_node(dep: Deployment, gpn: int) -> None:
    for replica in dep.replicas:
        for s in range(replica.config.pp):
            for k in range(replica.config.cp):
                group = replica.tp_group(s, k)
                assert len(group) == replica.config.tp
                assert len({d // gpn for d in group}) == max(1, replica.config.tp // gpn)


def test_cp_spans_nodes_while_tp_stays_in_one():
    cluster = ClusterSpec(32, 8)
    dep = Deployment.parse("1x(tp8,pp1,cp4)", cluster)
    dep.validate(cluster)
    (replica,) = dep.replicas
    _tp_groups_in_a_node(dep, 8)
    # Layout contract: local index cp_rank*tp + tp_rank, so CP rank k's TP group is node k here.
    assert [sorted({d // 8 for d in replica.tp_group(0, k)}) for k in range(4)] == [[0], [1], [2], [3]]
    assert replica.config.cp_spans_nodes(8)


def test_cp_group_that_fits_a_node_stays_in_it():
    cluster = ClusterSpec(24, 8)
    dep = Deployment.parse("2x(tp2,pp2,cp2) + 1x(tp4,pp1,cp2)", cluster)
    dep.validate(cluster)
    _stages_in_a_node(dep, 8)
    assert not any(replica.config.cp_spans_nodes(8) for replica in dep.replicas)


def test_cp_group_not_a_multiple_of_a_node_places_tp_groups_apart():
    cluster = ClusterSpec(16, 8)
    dep = Deployment.parse("1x(tp4,pp1,cp3) + 1x(tp4,pp1)", cluster)
    dep.validate(cluster)
    _tp_groups_in_a_node(dep, 8)
    assert len({d // 8 for d in dep.replicas[0].devices}) == 2


@pytest.mark.parametrize(
    ("text", "gpus", "gpn", "message"),
    [
        ("1x(tp12,pp1,cp2)", 24, 8, "TP group of 12 GPUs is larger than a node of 8 but not a multiple"),
    ],
)
def test_impossible_cp_deployments_are_named(text, gpus, gpn, message):
    with pytest.raises(HydraulisError, match=message):
        Deployment.parse(text, ClusterSpec(gpus, gpn))


def test_explicit_cp_devices_may_span_nodes_but_not_split_a_tp_group():
    cluster = ClusterSpec(16, 8)
    c = ParallelConfig(4, 1, 2)
    Deployment.from_devices([c, c], [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]], cluster)
    with pytest.raises(HydraulisError, match="TP group spans nodes"):
        Deployment.from_devices([c, c], [[0, 1, 2, 8, 3, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]], cluster)


@given(
    st.lists(
        st.sampled_from(
            [(1, 1, 2), (2, 1, 2), (2, 2, 2), (4, 1, 2), (8, 1, 2), (4, 1, 4), (8, 1, 4), (2, 1, 8), (1, 2, 1)]
        ),
        min_size=1,
        max_size=8,
    )
)
def test_power_of_two_cp_deployments_always_place_with_tp_in_a_node(triples):
    dep, cluster = _placed_on_full_nodes([ParallelConfig(tp, pp, cp) for tp, pp, cp in triples])
    assert sorted(d for r in dep.replicas for d in r.devices) == list(range(cluster.num_gpus))
    _tp_groups_in_a_node(dep, 8)


_SPACE = st.sampled_from(["", " ", "  "])


@st.composite
def _config_text(draw: st.DrawFn) -> str:
    """A config in any of the written forms (parentheses or none, commas or none, any case, spaces)."""
    tp, pp, cp = (draw(st.sampled_from([1, 2, 4])) for _ in range(3))
    sep = draw(st.sampled_from([",", ", ", "", " "]))
    body = f"tp{tp}{sep}pp{pp}" + (f"{sep}cp{cp}" if cp > 1 or draw(st.booleans()) else "")
    body = body.upper() if draw(st.booleans()) else body
    return f"({draw(_SPACE)}{body}{draw(_SPACE)})" if draw(st.booleans()) else body


@st.composite
def _pool_text(draw: st.DrawFn) -> str:
    """An inline pool, then maybe damaged: a parenthesis or another character dropped, one doubled, or one put
    in from the grammar's alphabet."""
    deployments = []
    for _ in range(draw(st.integers(1, 3))):
        items = []
        for _ in range(draw(st.integers(1, 3))):
            count = draw(st.one_of(st.just(""), st.integers(1, 4).map(lambda n: f"{n}{draw(st.sampled_from('xX*'))}")))
            items.append(f"{count}{draw(_SPACE)}{draw(_config_text())}")
        deployments.append(f"{draw(_SPACE)}+{draw(_SPACE)}".join(items))
    text = f"{draw(_SPACE)};{draw(_SPACE)}".join(deployments) + draw(st.sampled_from(["", ";", " ; "]))
    where = draw(st.integers(0, len(text)))
    damage = draw(st.sampled_from(["none", "drop", "double", "insert", "parenthesis", "parenthesis"]))
    parens = [i for i, ch in enumerate(text) if ch in "()"]
    if damage == "parenthesis" and parens:  # the damage a hand-written pool suffers most
        i = draw(st.sampled_from(parens))
        text = text[:i] + text[i + 1 :]
    elif damage == "drop" and text:
        text = text[: min(where, len(text) - 1)] + text[min(where, len(text) - 1) + 1 :]
    elif damage == "double" and text:
        text = text[:where] + text[max(where - 1, 0) : where] + text[where:]
    elif damage == "insert":
        text = text[:where] + draw(st.sampled_from("()+;,x*tpc0129 !")) + text[where:]
    return text


def _nesting_ok(text: str) -> bool:
    """An independent check of one rule of the grammar: parentheses pair up, never nested."""
    depth = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if depth not in (0, 1):
            return False
    return depth == 0


@settings(max_examples=300)
@given(_pool_text())
def test_every_pool_the_parser_accepts_prints_back_to_an_equal_pool(text):
    try:
        world = inline_pool_world(text, "pool")
        pool = parse_pool(text, ClusterSpec(world, 64))
    except HydraulisError as exc:
        assert "\n" not in str(exc)
        event("refused")
        return
    event("accepted")
    assert _nesting_ok(text) and set(text.lower()) <= set("()+;,x*tpc0123456789 "), text
    printed = "; ".join(str(d) for d in pool)
    assert inline_pool_world(printed, "pool") == world
    assert parse_pool(printed, ClusterSpec(world, 64)) == pool


@pytest.mark.parametrize("text", ["1x(tp2,pp1 + 2x(tp1,pp1); 4x(tp1,pp1)", "4x(tp4,pp1", "4x(tp1,pp1))",
                                  "((tp1,pp1))", "4x(tp1,pp1) junk", "4x(tp1,pp1); 4x(tp1,", "2x(tp1,pp1) +"])
def test_unbalanced_truncated_or_trailing_garbage_pools_are_refused(text):
    with pytest.raises(HydraulisError, match=r"^parallel\.pool: cannot parse deployment item") as exc:
        inline_pool_world(text, "parallel.pool")
    assert "\n" not in str(exc.value)
