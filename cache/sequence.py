"""Per-sequence bookkeeping held by the manager.

    token_ids   [ computed ...........| appended, KV not yet written ]
                0              num_computed                   num_tokens
    blocks      [ indexed ..| full, not yet indexed | partial ]
                0      num_indexed

Only blocks below ``num_computed // block_size`` may enter the prefix index:
chunked prefill writes a prompt's KV over several steps, and a block whose KV
is not written yet must never be matched by another request.
"""

from __future__ import annotations

from .block_table import BlockTable
from .chain import BlockChain
from .namespace import Namespace
from .prefix_index import PrefixNode


class Sequence:
    """One running sequence: its tokens, block table and place in the prefix index.

    chain: its tokens and their block hashes (``cache.chain``), owned by this
        sequence alone; ``token_ids`` and ``namespace`` read it.

    last_node: the index node of block ``num_indexed - 1`` (the root when 0);
        the next full block is indexed as its child.
    pinned: index nodes this sequence chains through while holding its own
        identical copy of the block (see PrefixNode.pins).
    index_stopped: a hash collision, or ``stop_indexing`` (beam search), ended
        indexing for this sequence; its later blocks stay private.
    pending: chained hashes of the prompt blocks ``[pending_start, ...)`` this
        sequence is computing and has not written yet (see ``cache.pending``).
    owner: digest of the session the sequence belongs to (b"": none); stamped
        on the blocks it indexes, so deleting the session finds them.
    """

    __slots__ = (
        "seq_id",
        "chain",
        "table",
        "num_computed",
        "num_indexed",
        "last_node",
        "pinned",
        "index_stopped",
        "pending",
        "pending_start",
        "owner",
        "num_loading",
    )

    def __init__(
        self,
        seq_id,
        chain: BlockChain,
        table: BlockTable,
        num_computed: int,
        num_indexed: int,
        last_node: PrefixNode,
    ) -> None:
        self.seq_id = seq_id
        self.chain = chain
        self.table = table
        self.num_computed = num_computed
        self.num_indexed = num_indexed
        self.last_node = last_node
        self.pinned: list[PrefixNode] = []
        self.index_stopped = False
        self.pending: list[bytes] = []
        self.pending_start = num_indexed
        self.owner = b""
        # Blocks right after num_computed being read from the disk tier.
        self.num_loading = 0

    @property
    def token_ids(self) -> list[int]:
        return self.chain.tokens

    @property
    def namespace(self) -> Namespace:
        return self.chain.namespace

    def fork(self, child_id) -> Sequence:
        """A copy sharing nothing mutable; the caller adds the block references."""
        child = Sequence(
            child_id,
            self.chain.copy(),
            self.table.copy(),
            self.num_computed,
            self.num_indexed,
            self.last_node,
        )
        child.pinned = list(self.pinned)
        child.index_stopped = self.index_stopped
        child.owner = self.owner
        # The parent alone announces its pending blocks; the child never owns them.
        child.pending_start = self.pending_start
        return child
