"""`autosbp explain`: nodes named and found by the module path the model was written with.

The oracle is the captured graph of the same model: each plan node's path is the nn.Module path
export recorded for it (a parameter's qualified name for its placeholder), the default listing
holds its ops but neither placeholders nor views, `--node PATH` explains the op of that module
and `--node PREFIX` lists the ops below it. A plan written before paths were recorded still
loads and is explained by node name.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from autosbp import explain
from autosbp.capturing import capture
from autosbp.capturing.graph import OpGraph, Role
from autosbp.cli import build_parser, main
from autosbp.commands.explain import run
from autosbp.errors import PlanError
from autosbp.explanation import TOP, find_nodes, short_op
from autosbp.plan import Plan, load_plan
from autosbp.zoo import build_model

ARGS = "layers=2,hidden=32,heads=2,seq=8,batch=4"


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Plan, OpGraph]:
    path = tmp_path_factory.mktemp("explain") / "gpt2.json"
    assert main(["plan", "gpt", "--model-args", ARGS, "--devices", "2", "--out", str(path)]) == 0
    kwargs = dict(pair.split("=") for pair in ARGS.split(","))
    graph = capture(*build_model("gpt", **{k: int(v) for k, v in kwargs.items()}))
    return path, load_plan(path), graph


def explain_out(*argv: str) -> str:
    """What `autosbp explain ARGV` prints on a console wide enough for its tables' names."""
    args = build_parser().parse_args(["explain", *argv])
    console = Console(file=io.StringIO(), width=300, highlight=False, emoji=False)
    assert run(args, console) == 0
    return console.file.getvalue()


def table_rows(out: str) -> list[list[str]]:
    """The body rows of the rich table(s) in `out`, as cells."""
    return [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in out.splitlines()
        if line.startswith("│")
    ]


def graph_path(graph: OpGraph, name: str) -> str:
    node = graph.node(name)
    return node.name or node.module_path


def is_op(graph: OpGraph, name: str) -> bool:
    """A compute node that is no view (its ATen schema aliases no output to an input)."""
    node = graph.node(name)
    if node.role is not Role.COMPUTE:
        return False
    returns = node.schema.returns if node.schema is not None else ()
    return not any(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def test_the_plan_records_each_node_module_path(planned) -> None:
    _, plan, graph = planned
    assert set(plan.nodes) == set(graph.order)
    assert {name: node.path for name, node in plan.nodes.items()} == {
        name: graph_path(graph, name) for name in graph.order
    }
    assert plan.nodes["p_blocks_1_attn_qkv_weight"].path == "blocks.1.attn.qkv.weight"


def test_listing_shows_the_ops_under_their_module_paths(planned) -> None:
    path, _, graph = planned
    rows = table_rows(explain_out(str(path)))
    expected = [name for name in graph.order if is_op(graph, name)]
    assert [row[2] for row in rows] == expected
    assert len(expected) < len(graph.order)  # placeholders and views are left out
    for module, op, name, *_ in rows:
        assert module == (graph_path(graph, name) or TOP)
        assert op == short_op(graph.node(name).op)
    assert [row[2] for row in table_rows(explain_out(str(path), "--all"))] == list(graph.order)


@pytest.mark.parametrize("block", [0, 1], ids=["first-block", "tied-block"])
def test_node_by_module_path_explains_its_op(planned, capsys, block: int) -> None:
    path, plan, graph = planned
    module = f"blocks.{block}.attn.qkv"
    (linear,) = [n for n in graph.order if is_op(graph, n) and graph.node(n).module_path == module]
    assert main(["explain", str(path), "--node", module]) == 0
    out = capsys.readouterr().out
    assert f"{module} {linear} (aten.linear.default): chose" in " ".join(out.split())
    why = explain(plan, module)
    assert why.node == linear
    assert why.alternatives == plan.alternatives[plan.nodes[linear].tied_to or linear]
    assert explain(plan, linear).node == linear  # the export's name still finds it


def test_node_by_module_prefix_lists_its_ops(planned) -> None:
    path, plan, graph = planned
    prefix = "blocks.0.attn"
    expected = [
        name
        for name in graph.order
        if is_op(graph, name) and (graph.node(name).module_path + ".").startswith(prefix + ".")
    ]
    assert len(expected) == 3  # qkv, attention, proj
    assert [row[2] for row in table_rows(explain_out(str(path), "--node", prefix))] == expected
    with pytest.raises(PlanError, match=r"holds 3 ops .* Pass one of their node names"):
        explain(plan, prefix)
    placeholders = find_nodes(plan, "blocks.0.attn.qkv.weight")
    assert placeholders == ["p_blocks_0_attn_qkv_weight"]


def test_unknown_path_names_the_nearest(planned, capsys) -> None:
    path, _, _ = planned
    assert main(["explain", str(path), "--node", "blocks.0.atn.qkv"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "not in the plan of gpt" in err
    assert "Did you mean: blocks.0.attn.qkv" in err


def test_a_plan_without_paths_loads_and_explains_by_name(planned, tmp_path, capsys) -> None:
    path, _, _ = planned
    data = json.loads(path.read_text())
    for node in data["nodes"].values():
        node.pop("path", None)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert main(["explain", str(old), "--node", "linear"]) == 0
    assert "linear (aten.linear.default): chose" in " ".join(capsys.readouterr().out.split())
    rows = table_rows(explain_out(str(old)))
    assert rows and all(row[0] == TOP for row in rows)
    assert main(["explain", str(old), "--node", "blocks.0.attn.qkv"]) == 2
    assert "written before plans recorded module paths" in " ".join(capsys.readouterr().err.split())


def test_names_from_the_file_are_shown_not_obeyed(planned, tmp_path, capsys) -> None:
    """A path holding rich markup (an edited plan) is printed as written, not as markup."""
    path, _, _ = planned
    data = json.loads(path.read_text())
    data["nodes"]["linear"]["path"] = "blocks.[bold]x[/]"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    assert "│ blocks.[bold]x[/] " in explain_out(str(edited))
    assert main(["explain", str(edited), "--node", "blocks.[bold]x[/]"]) == 0
    assert "blocks.[bold]x[/] linear (aten.linear.default)" in capsys.readouterr().out
