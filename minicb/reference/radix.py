"""RadixTree: token-level prefix sharing, the data structure of SGLang's RadixAttention
(Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs", 2024).

minicb's prefix cache (block_manager.py) names each *full* block by a hash chained over every
token before it, so a new prompt can reuse only whole blocks. A radix tree stores the cached
token sequences themselves, one edge per run of tokens that no two sequences split: a new prompt
walks down from the root comparing tokens, and reuses *any* token-level prefix, even one that
ends in the middle of what would have been a block.

    insert([1, 2, 3, 4]); insert([1, 2, 5])      root
                                                   |- (1, 2)        shared by both: stored once
                                                        |- (3, 4)
                                                        |- (5,)

Eviction is LRU over *leaves*: only a node that no running request holds (ref_count == 0) and that
has no children can go, so a shared prefix outlives every branch below it. A node's last_access is
a logical clock, bumped on every match or insert that passes through it.

This is a reference to read, draw and count with, not a cache the engine uses: it stores token
ids only (the engine would keep, per token, where its K/V lives). Nothing in the engine imports it.
"""

import heapq


class RadixNode:
    """One edge of the tree: the run of tokens `key` below `parent`, with its children by first
    token."""

    __slots__ = ("key", "children", "parent", "ref_count", "last_access")

    def __init__(self, key: tuple[int, ...] = (), parent: "RadixNode | None" = None):
        self.key = tuple(key)
        self.children: dict[int, RadixNode] = {}  # first token of the child's key -> child
        self.parent = parent
        self.ref_count = 0  # running requests that hold this node: it may not be evicted
        self.last_access = 0  # logical time of the last match or insert through this node

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self):
        head = ", ".join(map(str, self.key[:6])) + (", ..." if len(self.key) > 6 else "")
        return (
            f"RadixNode({len(self.key)} tokens ({head}), ref={self.ref_count}, "
            f"t={self.last_access})"
        )


def common_prefix_len(a, b) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixTree:
    def __init__(self):
        self.root = RadixNode()
        self.clock = 0  # logical time: one tick per match_prefix / insert
        self.num_tokens = 0  # tokens stored (the sum of every node's key length)
        self.tokens_compared = 0  # cost counter: token comparisons made by match_prefix and insert
        self.nodes_visited = 0  # cost counter: nodes stepped into by match_prefix and insert

    # ------------------------------------------------------------------ walk
    def _walk(self, tokens):
        """Follow `tokens` from the root. Yields (node, matched) for every node entered, where
        `matched` is how many of that node's key tokens agree with `tokens` (the last may be
        partial)."""
        node, i = self.root, 0
        while i < len(tokens) and tokens[i] in node.children:
            child = node.children[tokens[i]]
            matched = common_prefix_len(child.key, tokens[i:])
            self.tokens_compared += min(matched + 1, len(child.key), len(tokens) - i)
            self.nodes_visited += 1
            partial = matched < len(child.key)  # decided before the caller may split the child
            yield child, matched
            if partial:
                return
            node, i = child, i + matched

    def match_prefix(self, tokens, touch: bool = True) -> int:
        """Length of the longest prefix of `tokens` stored in the tree (any number of tokens).
        Touches every node on the way, which is what keeps a hot prefix away from eviction
        (`touch=False`: only look, as a probe that no request follows)."""
        self.clock += touch
        total = 0
        for node, matched in self._walk(tokens):
            if touch:
                node.last_access = self.clock
            total += matched
        return total

    # ------------------------------------------------------------------ insert
    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut `node`'s key after `at` tokens: a new parent holds the head, `node` keeps the
        tail."""
        head = RadixNode(node.key[:at], node.parent)
        head.ref_count, head.last_access = node.ref_count, node.last_access
        node.parent.children[head.key[0]] = head
        node.key, node.parent = node.key[at:], head
        head.children[node.key[0]] = node
        return head

    def insert(self, tokens) -> int:
        """Store `tokens`. Returns how many leading tokens were already stored (the rest are
        new)."""
        self.clock += 1
        tokens = tuple(tokens)
        node, i = self.root, 0
        for child, matched in self._walk(tokens):
            child.last_access = self.clock
            if matched < len(child.key):
                if i + matched == len(tokens):  # tokens end inside this edge: nothing new to store
                    return len(tokens)
                child = self._split(child, matched)
            node, i = child, i + matched
        if i < len(tokens):
            leaf = RadixNode(tokens[i:], node)
            leaf.last_access = self.clock
            node.children[leaf.key[0]] = leaf
            self.num_tokens += len(leaf.key)
        return i

    # ------------------------------------------------------------------ references
    def _path(self, tokens) -> list[RadixNode]:
        """The nodes that hold `tokens` (which must be stored: insert them first)."""
        path, covered = [], 0
        for node, matched in self._walk(tokens):
            path.append(node)
            covered += matched
        if covered < len(tokens):
            raise ValueError(
                f"only {covered} of {len(tokens)} tokens are stored: insert them before locking"
            )
        return path

    def lock(self, tokens) -> None:
        """A running request uses `tokens`: none of the nodes holding them may be evicted."""
        for node in self._path(tokens):
            node.ref_count += 1

    def unlock(self, tokens) -> None:
        """The request is done with `tokens`: its nodes become evictable again once nothing else
        holds them."""
        path = self._path(tokens)
        if any(node.ref_count == 0 for node in path):
            raise ValueError("unlock without a matching lock")
        for node in path:
            node.ref_count -= 1

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> list[tuple[int, ...]]:
        """Free at least `num_tokens` tokens (fewer if everything left is locked): remove the least
        recently used unlocked leaf, again and again; a parent left without children becomes a leaf
        in turn. Whole nodes go, as in SGLang. Returns the keys removed, in eviction order."""
        # Ties in last_access (a split and the new leaf share one tick) go by tree order:
        # reproducible.
        order = {id(n): i for i, n in enumerate(self.nodes())}
        heap = [
            (n.last_access, order[id(n)], n) for n in self.nodes() if n.is_leaf and n.ref_count == 0
        ]
        heapq.heapify(heap)
        removed, freed = [], 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.num_tokens -= len(leaf.key)
            freed += len(leaf.key)
            removed.append(leaf.key)
            if parent is not self.root and parent.is_leaf and parent.ref_count == 0:
                heapq.heappush(heap, (parent.last_access, order[id(parent)], parent))
        return removed

    # ------------------------------------------------------------------ inspection
    def nodes(self) -> list[RadixNode]:
        """Every node but the root, parents before children, children by first token."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                out.append(node)
            stack.extend(node.children[t] for t in sorted(node.children, reverse=True))
        return out

    def sequences(self) -> list[tuple[int, ...]]:
        """The token sequence from the root to every leaf: what the tree can serve in full."""
        out = []

        def visit(node, prefix):
            prefix = prefix + node.key
            if node.is_leaf and node is not self.root:
                out.append(prefix)
            for t in sorted(node.children):
                visit(node.children[t], prefix)

        visit(self.root, ())
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if the tree is malformed (used by the tests)."""
        total = 0
        for node in self.nodes():
            assert node.key, "a node other than the root has an empty key"
            assert node.parent.children.get(node.key[0]) is node, (
                "a child is filed under the wrong token"
            )
            assert node.ref_count >= 0, "negative reference count"
            if node.ref_count:
                assert node.parent is self.root or node.parent.ref_count > 0, (
                    "a locked node under an unlocked one"
                )
            total += len(node.key)
        assert total == self.num_tokens, "num_tokens differs from the tokens stored"

    def pretty(self, label=lambda key: str(list(key))) -> str:
        """One line per node, indented by depth: `label(key)`, its length, ref count and last
        access."""
        lines = []

        def visit(node, depth):
            for t in sorted(node.children):
                child = node.children[t]
                lines.append(
                    f"{'  ' * depth}{label(child.key)}  [{len(child.key)} tok, ref "
                    f"{child.ref_count}, t {child.last_access}]"
                )
                visit(child, depth + 1)

        visit(self.root, 0)
        return "\n".join(lines)

    def __repr__(self):
        leaves = sum(1 for n in self.nodes() if n.is_leaf)
        return (
            f"RadixTree({self.num_tokens} tokens in {len(self.nodes())} nodes, {leaves} leaves, "
            f"clock={self.clock})"
        )
