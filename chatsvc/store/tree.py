"""A session's messages as a tree: plain functions over records and child lists.

Every message has one parent (None at the top level, whose children are listed
under ``ROOT``); a branch is the path from the top to one message. The session
keeps one branch *active*: new turns continue it unless told otherwise.

    root ── sys ── u1 ── a1 ── u2 ── a2        active branch: sys u1 a1 u2 a2'
                          │          └── a2'   (a2' regenerated a2: siblings)
                          └── u2' ── a3        (u2' edited u2: a branch from a1)

Token ids follow the branch: see ``branch_tokens``. Nothing here touches Redis.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

import msgspec

from chatsvc.store.records import MessageRecord

# The children of the top level are kept under this name; message ids never take it.
ROOT = "root"
MESSAGE_ID_PREFIX = "msg_"


def new_message_id() -> str:
    """A fresh message id (64 random bits: unique within a session for any real size)."""
    return MESSAGE_ID_PREFIX + secrets.token_hex(8)


def split_children(raw: bytes | str | None) -> list[str]:
    """The child ids a ``children`` hash field holds (oldest first)."""
    if not raw:
        return []
    text = raw.decode() if isinstance(raw, bytes) else raw
    return text.split(",")


def join_children(ids: Sequence[str]) -> str:
    # Ids are [A-Za-z0-9_-] (keys.check_id), so a comma can never be part of one.
    return ",".join(ids)


def branch_tokens(messages: Sequence[MessageRecord]) -> list[int]:
    """The token history of a branch: what the model saw up to its last message.

    A message's ids continue the history before it, unless it is ``from_start``:
    then they are the whole history so far. Messages without ids add nothing; the
    next rendered message's ids cover their text.
    """
    tokens: list[int] = []
    for message in messages:
        if message.from_start:
            tokens = list(message.token_ids)
        else:
            tokens.extend(message.token_ids)
    return tokens


def leaf_paths(
    nodes: Mapping[str, MessageRecord], children: Mapping[str, Sequence[str]]
) -> list[list[MessageRecord]]:
    """Every branch of the tree: the path from the top to each message with no child."""
    paths = []
    for leaf_id in sorted(nodes.keys() - {p for p, kids in children.items() if kids}):
        path: list[MessageRecord] = []
        seen: set[str] = set()
        node = nodes.get(leaf_id)
        while node is not None and node.id not in seen:  # never loop on a cycle
            seen.add(node.id)
            path.append(node)
            node = nodes.get(node.parent_id) if node.parent_id else None
        paths.append(path[::-1])
    return paths


def newest_continuation(children: Mapping[str, Sequence[str]], start: str) -> list[str]:
    """The ids below ``start`` when always following the newest child, down to a leaf."""
    chain: list[str] = []
    seen = {start}
    node = start
    while children.get(node):
        node = children[node][-1]
        if node in seen:  # a cycle cannot be written by the store; never loop on one
            break
        seen.add(node)
        chain.append(node)
    return chain


def subtree(children: Mapping[str, Sequence[str]], top: str) -> list[str]:
    """``top`` and every message below it, parents before their children."""
    found: list[str] = []
    seen: set[str] = set()
    stack = [top]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        found.append(node)
        stack.extend(reversed(children.get(node, ())))
    return found


def split_prompt(base: Sequence[int], prompt: Sequence[int]) -> tuple[list[int], bool]:
    """The ids a turn adds to a branch whose history is ``base``, and whether they
    start over: ``(prompt[len(base):], False)`` when the prompt extends the history,
    else ``(prompt, True)`` (the template rendered the conversation again)."""
    n = len(base)
    if len(prompt) >= n and list(prompt[:n]) == list(base):
        return list(prompt[n:]), False
    return list(prompt), True


def link_chain(records: Sequence[MessageRecord], parent_id: str | None) -> list[MessageRecord]:
    """``records`` as one chain below ``parent_id`` (None: the top level): each the
    parent of the next, each with an id (a fresh one where it had none)."""
    chain: list[MessageRecord] = []
    for record in records:
        record_id = record.id or new_message_id()
        chain.append(msgspec.structs.replace(record, id=record_id, parent_id=parent_id))
        parent_id = record_id
    return chain


def chain_children(
    chain: Sequence[MessageRecord], parent_key: str, existing: Sequence[str]
) -> dict[str, str]:
    """The child-list fields a new chain sets: its head joins ``parent_key``'s
    ``existing`` children, each other message is its predecessor's only child."""
    if not chain:
        return {}
    fields = {parent_key: join_children([*existing, chain[0].id])}
    for parent, child in zip(chain, chain[1:], strict=False):
        fields[parent.id] = child.id
    return fields
