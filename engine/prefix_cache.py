"""Prefix cache across requests: a trie of prompt blocks whose nodes can restore a session to that point.

Many requests start alike (a long system prompt, a tool list, the same document). The cache cuts a
prompt into blocks of `block` tokens; each node of the trie is one block boundary of some earlier
prompt and holds a Session `Snapshot` taken there (engine/session.py: the recurrent GDN + conv arrays
on the host, every KV cache's length, the last logits) plus a *holder*: a forked session whose history
passes through the node, so its KV caches hold the keys and values up to it. A hybrid model's
recurrent state cannot be rewound, which is why the snapshots sit at block boundaries: a prompt that
shares 300 tokens with a cached one resumes from the boundary at 256 (block 128) and computes the rest.

`start(new_session, ids)`: walks the trie along `ids`, forks the deepest matching node's holder and
restores its snapshot (a hit of `cached` tokens), then prefills the prompt's remaining whole blocks
one at a time, snapshotting and inserting each boundary, so the next request with this start finds
it. The caller's generate loop runs the tail past the last boundary. Nodes are evicted least
recently used first (leaves first) when the host and device bytes they hold pass `budget_bytes`; a
holder is closed when no node refers to it any more.

What this is not: a session's own turn-to-turn reuse (Session.sync does that), or paged KV memory:
each holder keeps its own copy of the KV rows it covers.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .backends.base import GrowingKVCache
from .errors import GenerationCancelled
from .kvquant import Q3KVCache
from .session import Session, Snapshot

DEFAULT_BLOCK = 128  # tokens per trie edge: the granularity at which a shared start is found
DEFAULT_BUDGET = 1 << 30  # bytes of snapshots and holder KV rows kept


@dataclass(eq=False)
class _Holder:
    session: Session
    nbytes: int
    users: int = 0  # nodes that restore through it


@dataclass(eq=False)
class _Node:
    n_tokens: int
    parent: _Node | None
    key: tuple[int, ...]  # the block of tokens on the edge from the parent
    snapshot: Snapshot | None = None
    holder: _Holder | None = None
    nbytes: int = 0
    used: int = 0  # LRU clock
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheStart:
    """What `start` hands back: the session at the end of the prompt's whole blocks, how many prompt
    tokens came from the cache, and the tokens (and seconds) it prefilled to extend the cache."""

    session: Session
    cached_tokens: int
    prefilled_tokens: int
    prefill_s: float


def _snapshot_bytes(snap: Snapshot) -> int:
    n = sum(int(a.nbytes) for layer in snap.recurrent for a in layer.values())
    n += int(snap.last_logits.nbytes) if snap.last_logits is not None else 0
    return n + 120 * snap.n_tokens  # the token, position and next-position tuples (Python objects)


def _holder_bytes(session: Session) -> int:
    """Bytes a session's state holds: KV arrays at their capacity (what a device allocates; holders
    are made with the capacity they need), recurrent arrays."""
    n = 0
    for st in session.states:
        if isinstance(st.kv, (GrowingKVCache, Q3KVCache)):
            n += int(st.kv.nbytes)
        n += sum(int(a.nbytes) for a in st.recurrent.values())
    return n


class PrefixCache:
    """Shared prompt starts across requests (see the module docstring). Thread-safe; the prefills
    run on the caller's thread, outside the lock."""

    def __init__(self, block: int = DEFAULT_BLOCK, budget_bytes: int = DEFAULT_BUDGET):
        if block < 1:
            raise ValueError("the prefix cache's block must be at least 1 token")
        self.block = int(block)
        self.budget_bytes = int(budget_bytes)
        self._root = _Node(0, None, ())
        self._lock = threading.Lock()
        self._clock = itertools.count(1)
        self._holders: dict[int, _Holder] = {}
        self.nbytes = 0
        self.lookups = 0
        self.hits = 0
        self.lookup_tokens = 0  # prompt tokens asked for
        self.hit_tokens = 0  # of those, restored from the cache
        self.evictions = 0

    # ---- the one entry point ---------------------------------------------------------------------------
    def start(self, new_session: Callable[[int | None], Session], ids: Sequence[int],
              cancel: threading.Event | None = None) -> CacheStart:
        """A session holding the longest cached start of `ids` (whole blocks), extended to the last
        whole block of `ids` with each new boundary cached. A cancel stops the extension early (the
        session keeps what ran; the caller's generate loop notices the cancel). new_session(capacity)
        makes an empty session; on a miss its KV capacity is the prompt's whole blocks, so the holder
        forked from it keeps no more than it covers (the request's own session grows as it goes)."""
        ids = [int(t) for t in ids]
        node, session = self._resume(new_session, ids)
        try:
            return self._extend(node, session, ids, cancel)
        except BaseException:
            session.close()  # out of memory, or an error: the session goes, its memory with it
            raise

    def _extend(self, node: _Node, session: Session, ids: list[int],
                cancel: threading.Event | None) -> CacheStart:
        cached = node.n_tokens
        t0 = time.perf_counter()
        prefilled = 0
        new_nodes: list[_Node] = []
        b = self.block
        while node.n_tokens + b <= len(ids) and not (cancel is not None and cancel.is_set()):
            stop = node.n_tokens + b
            try:
                session.prefill(ids[node.n_tokens : stop], cancel=cancel)
            except GenerationCancelled:
                break  # the session keeps the chunks that ran; the generate loop reports the cancel
            prefilled += stop - node.n_tokens
            child = _Node(stop, node, tuple(ids[node.n_tokens : stop]), snapshot=session.snapshot())
            child.nbytes = _snapshot_bytes(child.snapshot) if child.snapshot is not None else 0
            new_nodes.append(child)
            node = child
        if new_nodes:
            self._insert(new_nodes, session.fork())
        return CacheStart(session, cached, prefilled, time.perf_counter() - t0)

    # ---- trie ----------------------------------------------------------------------------------------------
    def _resume(self, new_session: Callable[[int | None], Session],
                ids: list[int]) -> tuple[_Node, Session]:
        """The deepest node on `ids`' path and a fresh session restored to it (or the root and a new
        session). Counts the lookup."""
        with self._lock:
            node = self._root
            b = self.block
            while node.n_tokens + b <= len(ids):
                child = node.children.get(tuple(ids[node.n_tokens : node.n_tokens + b]))
                if child is None:
                    break
                node = child
            stamp = next(self._clock)
            walk: _Node | None = node
            while walk is not None:
                walk.used = stamp
                walk = walk.parent
            self.lookups += 1
            self.lookup_tokens += len(ids)
            if node is not self._root:
                self.hits += 1
                self.hit_tokens += node.n_tokens
            holder, snap = node.holder, node.snapshot
            twin = holder.session.fork() if holder is not None else None
        if twin is None or snap is None:
            whole = len(ids) // self.block * self.block
            return self._root, new_session(whole or None)
        twin.restore(snap)
        twin.snapshots = []  # the holder's own turn boundaries are not this request's
        return node, twin

    def _insert(self, nodes: list[_Node], holder_session: Session) -> None:
        """Link a chain of new nodes under the first one's parent, all restoring through one new
        holder; boundaries another request inserted meanwhile are kept as they are."""
        holder = _Holder(holder_session, _holder_bytes(holder_session))
        with self._lock:
            stamp = next(self._clock)
            parent = nodes[0].parent
            assert parent is not None
            for node in nodes:
                existing = parent.children.get(node.key)
                if existing is not None:
                    existing.used = stamp
                    parent = existing
                    continue
                node.parent = parent
                node.holder = holder
                node.used = stamp
                holder.users += 1
                parent.children[node.key] = node
                self.nbytes += node.nbytes
                parent = node
            if holder.users:
                self._holders[id(holder)] = holder
                self.nbytes += holder.nbytes
                drop = self._evict()
            else:
                drop = [holder]
        for h in drop:
            h.session.close()

    def _evict(self) -> list[_Holder]:
        """Remove least recently used leaves until the cache fits its budget (lock held); returns the
        holders no node uses any more, to be closed outside the lock."""
        freed: list[_Holder] = []
        while self.nbytes > self.budget_bytes:
            leaves = [n for n in self._nodes() if not n.children and n is not self._root]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.used)
            assert victim.parent is not None
            del victim.parent.children[victim.key]
            self.nbytes -= victim.nbytes
            self.evictions += 1
            holder = victim.holder
            if holder is not None:
                holder.users -= 1
                if holder.users == 0:
                    del self._holders[id(holder)]
                    self.nbytes -= holder.nbytes
                    freed.append(holder)
        return freed

    def _nodes(self) -> list[_Node]:
        out, todo = [], [self._root]
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(node.children.values())
        return out

    # ---- observation ---------------------------------------------------------------------------------------
    @property
    def hit_rate(self) -> float:
        """Prompt tokens restored from the cache / prompt tokens looked up."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def metrics(self) -> dict[str, float | int]:
        with self._lock:
            return {
                "cache_entries": len(self._nodes()) - 1,
                "cache_bytes": self.nbytes,
                "cache_budget_bytes": self.budget_bytes,
                "cache_lookups": self.lookups,
                "cache_hits": self.hits,
                "cache_hit_tokens": self.hit_tokens,
                "cache_lookup_tokens": self.lookup_tokens,
                "cache_hit_rate": self.hit_rate,
                "cache_evictions": self.evictions,
            }

    def clear(self) -> None:
        """Forget everything (e.g. when the model changes) and close the holders."""
        with self._lock:
            holders = list(self._holders.values())
            self._holders.clear()
            self._root = _Node(0, None, ())
            self.nbytes = 0
        for h in holders:
            h.session.close()
