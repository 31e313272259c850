"""Depth-bounded suffix trees over token sequences, with occurrence counts: the data structure of SuffixDecoding
(Oliaro et al., arXiv:2411.04975), drafter/suffix.py.

What the tree holds: every substring of at most `max_depth` tokens of every sequence in it, as a path from the root,
and for each path the number of its occurrences (`count`: the suffixes, cut at max_depth tokens, that pass through
it). A sequence of n tokens adds n occurrences, one per start position. The next-token estimate after a path is then
child count / sum of the children's counts: how often the path was followed by each token (occurrences that end
there, at the end of a sequence or at the depth bound, say nothing about what comes next and are left out).

Representation: a trie whose edges are compressed in the usual two ways, so that memory grows with the number of
tokens, not tokens x depth.
  * An edge spans several tokens. A node holds no tokens itself, only a reference occurrence (`seq`, `start`: one
    of the occurrences that pass through it) and the depth its edge ends at; the edge's tokens are
    seq[start + parent's depth : start + end].
  * A path that only one occurrence takes from some point on ends in a leaf of count 1 (`kids` None) whose edge runs
    to that occurrence's end, min(len(seq) - start, max_depth). A sequence that grows (a session's history) makes
    such a leaf longer without any work.
Inserting a sequence walks each of its occurrences down from the root, comparing edge tokens by slices and splitting
an edge where the occurrence leaves it; a node is made only where paths branch or an occurrence ends, so the tree has
at most about two nodes per token. When a sequence grows, the occurrences that ended at a node short of max_depth
(`_open`) walk on; those in a leaf grow with it for free.

Two uses:
  * SessionTree: one growing sequence (a session's prompt and committed output), which may also shrink by a few
    tokens (drafts past the committed history, a retried call): the last `undo_tokens` appends are logged and undone;
    a deeper cut rebuilds.
  * GlobalTree: finished sequences (earlier requests' outputs), bounded by total tokens and by number of sequences;
    the oldest sequence is evicted first, by decrementing the counts along each of its occurrences and pruning or
    re-compressing what only it held. Eviction relies on every node's reference being the newest occurrence through
    it, which holds because sequences are inserted in order and evicted oldest first.

Pure Python, no new dependency. Not the `arctic-inference` package (the C++ suffix tree behind vLLM's "suffix"
method): it is a C++ source distribution built at install time, which these sizes do not need. One drafter process
holds about 10^5 tokens here; inserting costs a few microseconds per token and a lookup a fraction of a millisecond.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_MAX_DEPTH = 64  # tokens per indexed substring: room for a long match and a draft after it


class Tokens(array):
    """A sequence's token ids (int32), with its insertion number: the recency that breaks ties between equally
    frequent continuations (the newer one wins)."""

    __slots__ = ("serial",)

    def __new__(cls, tokens: Iterable[int] = (), serial: int = 0) -> Tokens:
        self = super().__new__(cls, "i", tokens)
        self.serial = serial
        return self


class Node:
    """A node and the edge into it (see the module docstring)."""

    __slots__ = ("count", "kids", "seq", "start", "end")

    def __init__(self, count: int, kids: dict[int, Node] | None, seq: Tokens, start: int, end: int) -> None:
        self.count = count  # occurrences passing through (or ending at) this node
        self.kids = kids  # first token of the child's edge -> child; None: a leaf of one occurrence
        self.seq = seq  # reference occurrence: seq[start:...] spells the path from the root
        self.start = start
        self.end = end  # depth at the bottom of the edge (a leaf's is its occurrence's length: see _end)


@dataclass(frozen=True)
class Candidate:
    """A draft read from a tree: the greedy path of most frequent continuations after the longest match."""

    match_length: int = 0  # tokens of the context matched (0: no match with a continuation)
    tokens: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()  # estimated probability of each prefix of the draft (non-increasing)
    score: float = 0.0  # sum of probs: the expected number of accepted tokens under the tree's estimates


NO_CANDIDATE = Candidate()

# undo log entries (SessionTree)
_OPEN, _DEL, _PUT, _COUNT = range(4)


def _common(a: Sequence[int], i: int, b: Sequence[int], j: int, n: int) -> int:
    """The largest m <= n with a[i:i + m] == b[j:j + m] (slice comparisons: C speed, O(log n) of them)."""
    if n <= 0 or a[i:i + n] == b[j:j + n]:
        return max(n, 0)
    lo, hi = 0, n - 1  # a[i:i+lo] == b[j:j+lo]; they differ within the first hi + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[i:i + mid] == b[j:j + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SuffixTree:
    """The tree, its insertion step and its queries; SessionTree and GlobalTree add how sequences come and go."""

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self._reset()

    def _reset(self) -> None:
        self.root = Node(0, {}, Tokens(), 0, 0)
        # (node, start, parent): occurrences of the growing sequence, shorter than max_depth, that end at a node
        self._open: list[tuple[Node, int, Node]] = []

    def _end(self, node: Node) -> int:
        if node.kids is None:
            return min(len(node.seq) - node.start, self.max_depth)
        return node.end

    # ------------------------------------------------------------------ insertion

    def _insert(self, x: Node, px: Node | None, s: int, seq: Tokens, log: list | None, keep_open: bool) -> None:
        """Walk the occurrence seq[s:s + max_depth] down from node x, where its first x.end tokens already are (x is
        the root for a new occurrence; px is x's parent when known), counting it on the way and splitting an edge
        where it leaves the tree's paths. Where it ends at a node short of max_depth it stays open (_open) to be
        walked on when the sequence grows."""
        length = min(len(seq) - s, self.max_depth)
        d = x.end
        if px is not None and px.count and len(x.kids) == 1 and x.count == 1 + next(iter(x.kids.values())).count:
            key = seq[s + px.end]
            c = x.kids.get(seq[s + d])
            if c is not None and px.kids.get(key) is x:
                # This occurrence was the only one ending at x and goes on into x's only child: x would be a mere
                # link. Drop it (its parent points at the child) and walk on from the parent.
                px.kids[key] = c
                if log is not None:
                    log.append((_PUT, px.kids, key, x))
                    log.append((_COUNT, x, x.count, x.seq, x.start))
                x.count = 0  # detached: a record naming it as a parent must not use it
                x, d = px, px.end
        while True:
            t = seq[s + d]
            kids = x.kids
            c = kids.get(t)
            if c is None:  # a new branch: a leaf, which grows with seq by itself
                kids[t] = Node(1, None, seq, s, 0)
                if log is not None:
                    log.append((_DEL, kids, t))
                return
            leaf = c.kids is None
            e = min(len(c.seq) - c.start, self.max_depth) if leaf else c.end
            j = d + 1 + _common(seq, s + d + 1, c.seq, c.start + d + 1, min(e, length) - d - 1)
            if not leaf and j == e:  # through all of c's edge
                if log is not None:
                    log.append((_COUNT, c, c.count, c.seq, c.start))
                c.count += 1
                c.seq, c.start = seq, s  # the reference is the newest occurrence through the node
                if length == e:
                    if keep_open and length < self.max_depth:
                        self._open.append((c, s, x))
                    return
                x, d = c, e
                continue
            # Split c's edge at depth j, where this occurrence leaves it or ends (a leaf's may end there too).
            m = Node(2 if leaf else c.count + 1, {}, seq, s, j)
            if e > j:
                m.kids[c.seq[c.start + j]] = c
            if length > j:
                m.kids[seq[s + j]] = Node(1, None, seq, s, 0)
            elif keep_open and length < self.max_depth:
                self._open.append((m, s, x))
            kids[t] = m
            if log is not None:
                log.append((_PUT, kids, t, c))
            return

    # ------------------------------------------------------------------ queries

    def _locate(self, pattern: Sequence[int]) -> tuple[Node, int, int] | None:
        """Where `pattern` ends in the tree: (node, depth, the node's end depth), or None if it does not occur."""
        node, d, end = self.root, 0, 0
        for token in pattern:
            if d == end:
                if node.kids is None:
                    return None
                node = node.kids.get(token)
                if node is None:
                    return None
                end = self._end(node)
            elif node.seq[node.start + d] != token:
                return None
            d += 1
        return node, d, end

    @staticmethod
    def _continues(where: tuple[Node, int, int]) -> bool:
        node, d, end = where
        return d < end or bool(node.kids)

    def longest_match(self, context: Sequence[int], limit: int) -> tuple[int, tuple[Node, int, int] | None]:
        """The longest suffix of `context`, at most `limit` tokens, that occurs in the tree followed by some token,
        and where it ends. Binary search: if the last L tokens occur followed by x, so do the last L - 1."""
        lo, hi, found = 0, min(limit, len(context), self.max_depth - 1), None
        n = len(context)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            where = self._locate(context[n - mid:])
            if where is not None and self._continues(where):
                lo, found = mid, where
            else:
                hi = mid - 1
        return lo, found

    def speculate(self, context: Sequence[int], k: int, spec_factor: float = 1.0,
                  min_prob: float = 0.1) -> Candidate:
        """Draft up to k tokens after `context`: match its longest suffix (at most max_depth - k tokens, so that k
        tokens fit below it), then follow the most frequent child at every branch (ties: the most recent), while the
        product of the branch probabilities stays >= min_prob, for at most max(1, spec_factor * match length)
        tokens."""
        if k <= 0:
            return NO_CANDIDATE
        length, where = self.longest_match(context, max(1, self.max_depth - k))
        if where is None:
            return NO_CANDIDATE
        budget = max(1, min(k, int(spec_factor * length + 1e-9)))
        node, d, end = where
        tokens: list[int] = []
        probs: list[float] = []
        prob = 1.0
        while len(tokens) < budget:
            if d == end:
                kids = node.kids
                if not kids:
                    break
                if len(kids) == 1:
                    (node,) = kids.values()
                else:
                    best, total = None, 0
                    for child in kids.values():
                        total += child.count
                        if best is None or ((child.count, child.seq.serial, child.start)
                                            > (best.count, best.seq.serial, best.start)):
                            best = child
                    prob *= best.count / total
                    if prob < min_prob:
                        break
                    node = best
                end = self._end(node)
            tokens.append(node.seq[node.start + d])
            probs.append(prob)
            d += 1
        return Candidate(length, tuple(tokens), tuple(probs), sum(probs))

    # ------------------------------------------------------------------ inspection (tests, memory)

    def num_nodes(self) -> int:
        n, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            n += 1
            if node.kids:
                stack.extend(node.kids.values())
        return n

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every path (at every depth, inside edges too) and its count: what the tree says, independent of how it
        is compressed."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[Node, tuple[int, ...]]] = [(self.root, ())]
        while stack:
            node, path = stack.pop()
            for child in (node.kids or {}).values():
                p = path
                for d in range(len(path), self._end(child)):
                    p = (*p, child.seq[child.start + d])
                    out[p] = child.count
                if child.kids:
                    stack.append((child, p))
        return out

    def check(self) -> None:
        """Raise AssertionError where the structure is inconsistent (tests)."""
        stack: list[tuple[Node, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            if node.kids is None:
                assert node.count == 1, "a leaf holds one occurrence"
                continue
            assert sum(c.count for c in node.kids.values()) <= node.count or node is self.root
            for token, child in node.kids.items():
                end = self._end(child)
                assert depth < end <= self.max_depth, "an edge holds at least one token"
                assert child.start + end <= len(child.seq), "the reference covers the edge"
                assert child.seq[child.start + depth] == token, "a child is keyed by its edge's first token"
                assert child.count >= 1
                if child.kids is not None:
                    assert child.count >= 2, "a node of one occurrence is a leaf"
                stack.append((child, end))


def brute_force_counts(sequences: Iterable[Sequence[int]], max_depth: int) -> dict[tuple[int, ...], int]:
    """What SuffixTree.counts() must equal for a tree over `sequences` (tests)."""
    out: dict[tuple[int, ...], int] = {}
    for seq in sequences:
        seq = list(seq)
        for s in range(len(seq)):
            for length in range(1, min(max_depth, len(seq) - s) + 1):
                key = tuple(seq[s:s + length])
                out[key] = out.get(key, 0) + 1
    return out


class SessionTree(SuffixTree):
    """The tree over one growing sequence (a session's prompt and committed output), which may also be cut back:
    the changes made by the last `undo_tokens` tokens' appends are logged, and a cut undoes them (or rebuilds)."""

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, undo_tokens: int = 128) -> None:
        super().__init__(max_depth)
        self.tokens = Tokens()
        self.undo_tokens = undo_tokens
        self._logs: deque[tuple[int, list]] = deque()  # (length before, changes) per recent extend
        self._logged = 0  # tokens appended by the logged extends

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        seq, before = self.tokens, len(self.tokens)
        seq.extend(tokens)
        if len(seq) == before:
            return
        added = len(seq) - before
        log: list | None = [] if added <= self.undo_tokens else None
        records, self._open = self._open, []
        if log is not None:
            log.append((_OPEN, records))
        for x, s, px in records:  # occurrences that ended at a node: walk them on
            self._insert(x, px, s, seq, log, True)
        root = self.root
        for s in range(before, len(seq)):  # the new ones
            self._insert(root, None, s, seq, log, True)
        root.count = len(seq)
        if log is None:  # too long to log: nothing before it can be undone either
            self._logs.clear()
            self._logged = 0
            return
        self._logs.append((before, log))
        self._logged += added
        while self._logged > self.undo_tokens:
            first, _ = self._logs.popleft()
            self._logged -= (self._logs[0][0] if self._logs else len(seq)) - first

    def truncate(self, length: int) -> None:
        """Forget the tokens from `length` on: undo the last extends (then redo what they added before `length`), or
        rebuild when the cut goes deeper than the log."""
        if length >= len(self.tokens):
            return
        kept = self.tokens[:length]
        if len(self.tokens) - length > self._logged:
            self.clear()  # deeper than the log: rebuild
        while len(self.tokens) > length:
            before, log = self._logs.pop()
            for entry in reversed(log):
                self._undo(entry)
            self._logged -= len(self.tokens) - before
            del self.tokens[before:]
            self.root.count = before
        self.extend(kept[len(self.tokens):])

    def clear(self) -> None:
        self._reset()
        del self.tokens[:]
        self._logs.clear()
        self._logged = 0

    def _undo(self, entry: tuple) -> None:
        kind = entry[0]
        if kind == _OPEN:
            self._open = entry[1]
        elif kind == _DEL:
            del entry[1][entry[2]]
        elif kind == _PUT:
            entry[1][entry[2]] = entry[3]
        else:  # _COUNT
            _, node, node.count, node.seq, node.start = entry


class GlobalTree(SuffixTree):
    """The tree over finished sequences, at most `max_tokens` tokens and `max_sequences` sequences: the oldest go
    first. A sequence longer than max_tokens keeps its last max_tokens tokens."""

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, max_tokens: int = 100_000,
                 max_sequences: int = 1_000) -> None:
        super().__init__(max_depth)
        if max_tokens < 1 or max_sequences < 1:
            raise ValueError(f"max_tokens and max_sequences must be >= 1, got {max_tokens}, {max_sequences}")
        self.max_tokens, self.max_sequences = max_tokens, max_sequences
        self.sequences: deque[Tokens] = deque()  # oldest first
        self.num_tokens = 0
        self._serial = 0

    def add(self, tokens: Sequence[int]) -> None:
        tokens = tokens[len(tokens) - self.max_tokens:] if len(tokens) > self.max_tokens else tokens
        if not len(tokens):
            return
        self._serial += 1
        seq = Tokens(tokens, self._serial)
        for s in range(len(seq)):
            self._insert(self.root, None, s, seq, None, False)
        self.root.count += len(seq)
        self.sequences.append(seq)
        self.num_tokens += len(seq)
        while self.num_tokens > self.max_tokens or len(self.sequences) > self.max_sequences:
            self.remove_oldest()

    def remove_oldest(self) -> None:
        seq = self.sequences.popleft()
        self.num_tokens -= len(seq)
        for s in range(len(seq)):
            self._remove_occurrence(seq, s)
        self.root.count -= len(seq)

    def _remove_occurrence(self, seq: Tokens, s: int) -> None:
        """Take the occurrence seq[s:s + max_depth] out: decrement the counts on its path; a node left with no
        occurrence goes, one left with a single occurrence (of a newer sequence: its reference) becomes a leaf."""
        length = min(len(seq) - s, self.max_depth)
        node, d = self.root, 0
        while d < length:
            token = seq[s + d]
            child = node.kids[token]
            if child.kids is None:  # a leaf on this path holds this occurrence only
                del node.kids[token]
                break
            child.count -= 1
            if child.count == 0:
                del node.kids[token]
                break
            if child.count == 1 and child.seq is not seq:
                child.kids = None  # the survivor is the reference, the newest occurrence through it
                return
            node, d = child, child.end
        # `node` lost an ending occurrence or a child: it may now be a plain link between its parent and one child.
        if node is not self.root and node.seq is not seq and node.kids is not None and len(node.kids) == 1:
            (only,) = node.kids.values()
            if only.count == node.count and only.kids is not None:
                node.kids, node.end, node.seq, node.start = only.kids, only.end, only.seq, only.start
