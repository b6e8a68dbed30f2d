"""The message tree's plain functions (no Redis) and the response ids."""

from __future__ import annotations

from chatsvc.store.records import MessageRecord
from chatsvc.store.responses import new_response_id, response_session
from chatsvc.store.tree import (
    ROOT,
    branch_tokens,
    chain_children,
    join_children,
    leaf_paths,
    link_chain,
    newest_continuation,
    split_children,
    split_prompt,
    subtree,
)


def _m(role: str, ids: list[int], *, restart: bool = False) -> MessageRecord:
    return MessageRecord(role=role, text=role, token_ids=ids, from_start=restart)


def test_branch_tokens_continue_skip_empty_and_restart():
    path = [_m("system", [1, 2]), _m("user", []), _m("assistant", []), _m("user", [3, 4])]
    assert branch_tokens(path) == [1, 2, 3, 4]
    path += [_m("assistant", [5]), _m("user", [1, 2, 9, 4, 6], restart=True), _m("assistant", [7])]
    assert branch_tokens(path) == [1, 2, 9, 4, 6, 7]
    assert branch_tokens([]) == []


def test_split_prompt_extends_or_starts_over():
    assert split_prompt([1, 2], [1, 2, 3]) == ([3], False)
    assert split_prompt([1, 2], [1, 2]) == ([], False)
    assert split_prompt([], [5]) == ([5], False)
    assert split_prompt([1, 2], [1, 3, 4]) == ([1, 3, 4], True)
    assert split_prompt([1, 2, 3], [1, 2]) == ([1, 2], True)


def test_newest_continuation_and_subtree():
    children = {ROOT: ["a"], "a": ["b", "c"], "b": ["d"], "c": ["e", "f"], "f": []}
    assert newest_continuation(children, ROOT) == ["a", "c", "f"]
    assert newest_continuation(children, "b") == ["d"]
    assert newest_continuation(children, "d") == []
    assert subtree(children, "a") == ["a", "b", "d", "c", "e", "f"]
    assert subtree(children, "c") == ["c", "e", "f"]
    assert subtree(children, "x") == ["x"]
    # A cycle is never written; the walks still end on one.
    assert newest_continuation({"a": ["b"], "b": ["a"]}, "a") == ["b"]
    assert subtree({"a": ["b"], "b": ["a"]}, "a") == ["a", "b"]


def test_link_chain_assigns_ids_and_parents_and_lists_children():
    chain = link_chain(
        [_m("user", [1]), MessageRecord(role="assistant", text="x", token_ids=[], id="msg_given")],
        "msg_p",
    )
    assert chain[0].id.startswith("msg_") and chain[1].id == "msg_given"
    assert [m.parent_id for m in chain] == ["msg_p", chain[0].id]
    fields = chain_children(chain, parent_key="msg_p", existing=["msg_old"])
    assert fields == {"msg_p": f"msg_old,{chain[0].id}", chain[0].id: "msg_given"}
    assert chain_children([], parent_key=ROOT, existing=[]) == {}
    assert split_children(join_children(["a", "b"]).encode()) == ["a", "b"]
    assert split_children(None) == [] and split_children(b"") == []


def test_response_ids_name_their_session_and_nothing_else():
    sid = "0123456789abcdef0123456789abcdef"
    rid = new_response_id(sid)
    assert rid.startswith("resp_") and len(rid) <= 64
    assert response_session(rid) == sid
    assert response_session(new_response_id("a_b-c")) == "a_b-c"
    for bad in (
        None,
        7,
        "",
        "resp_",
        "resp_x",
        f"resp_{sid}",
        f"resp_{sid}_short",
        "msg_1",
        f"resp_{sid}*_0123456789abcdef",
        "resp_" + "a" * 70 + "_0123456789abcdef",
    ):
        assert response_session(bad) is None, bad


def test_leaf_paths_are_every_branch_from_the_top():
    def node(id_, parent, ids):
        return MessageRecord(role="user", text=id_, token_ids=ids, id=id_, parent_id=parent)

    nodes = {n.id: n for n in [node("a", None, [1]), node("b", "a", [2]), node("c", "a", [3])]}
    nodes["d"] = node("d", "c", [4])
    children = {ROOT: ["a"], "a": ["b", "c"], "c": ["d"]}
    paths = leaf_paths(nodes, children)
    assert [[m.id for m in p] for p in paths] == [["a", "b"], ["a", "c", "d"]]
    assert [branch_tokens(p) for p in paths] == [[1, 2], [1, 3, 4]]
    assert leaf_paths({}, {}) == []
    # A cycle is never written; the walk still ends on one.
    looped = {"x": node("x", "y", []), "y": node("y", "x", [])}
    assert [len(p) for p in leaf_paths(looped, {})] == [2, 2]
