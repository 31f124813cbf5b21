"""The prefix cache: a radix tree over token ids at page granularity (SGLang's RadixCache, with a page per node and
layer group).

Each node below the root is one full page of tokens: its key is those `page_size` token ids, its value the page
that holds their KV in each layer group (specs.py), and its path from the root the tokens before them. A request
starts from the longest cached prefix of its tokens (`match`: only their KV beyond it is computed), and its full
pages go into the tree as soon as their KV is computed (`insert`: after a prefill, when it is retracted, when it
ends), so that n samples of one prompt, or the next turn of a conversation, find them. The tree holds each of
its pages once (PagePool); pages that no request holds are given back when pages run short (`evict`).

A sliding-window group's page may be missing from a node (0: given back, SGLang's tombstone): a query sees only the
window before it, so a prefix is usable up to a page boundary p only if every window group holds the pages of the
window before p. When pages run short, the window pages of nodes that stay (interior ones, or ones a request
holds) go first, least recently used first, then whole leaves. A model with linear-attention layers resumes a
prefix only at a node that keeps a checkpoint of their state (states.py); checkpoints go least recently used
first when their slots run short.

Only full pages are shared: a partly filled last page stays its request's own. A weight update or a new weight
version flushes the tree (`flush`, a new `epoch`): KV computed by the old weights never serves a new request.

Requests share KV only within a namespace (a tree per namespace, `roots`): what a request ran on and whose KV it may
read, its LoRA adapter and its client's cache salt (engine/lora_registry.py:cache_namespace). A namespace nobody
can ask for any more (a retired adapter's) is dropped whole (`forget`).
"""

import heapq
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from services.scheduler.kv.pages import PagePool
from services.scheduler.kv.states import NO_STATE, StateSlots

DROPPED = 0  # a window group's page given back (page 0 is never handed out)
SHARED: Hashable = None  # the namespace of requests that name none (the tests', and a model without adapters)


@dataclass(eq=False)
class PageNode:
    key: bytes  # the page's token ids, int32
    pages: list[int]  # per layer group; DROPPED where a window group's page was given back
    parent: "PageNode | None"
    children: dict[bytes, "PageNode"] = field(default_factory=dict)
    last_use: int = 0  # the cache's clock when a request last matched or inserted it
    state: int = NO_STATE  # the linear-attention state after its page: a checkpoint slot


def first_visible_page(position: int, window: int, page_size: int) -> int:
    """The first page a query at `position` reads in a layer of `window` (0: full attention, page 0)."""
    return max(position - window + 1, 0) // page_size if window else 0


class PrefixCache:
    def __init__(self, pages: PagePool, windows: list[int], enabled: bool = True, states: StateSlots | None = None):
        """`windows`: each layer group's window (0: full attention); `states`: the linear-attention state slots, for
        a model that has such layers."""
        self.pages = pages
        self.page_size = pages.page_size
        self.windows = windows
        self.states = states
        self.enabled = enabled
        self.roots: dict[Hashable, PageNode] = {}  # a tree per namespace
        self.epoch = 0  # bumped by flush: requests whose KV is older insert nothing
        self.nodes = 0
        self.cached_pages = 0  # over every group
        self._clock = 0

    def _keys(self, tokens: np.ndarray, pages: int) -> list[bytes]:
        data = np.ascontiguousarray(tokens[:pages * self.page_size], dtype=np.int32).tobytes()
        step = self.page_size * 4
        return [data[i * step:(i + 1) * step] for i in range(pages)]

    def match(self, tokens: np.ndarray, limit: int, namespace: Hashable = SHARED) -> tuple[list[list[int]], int]:
        """Each group's page table of the longest prefix of tokens[:limit] cached in `namespace` that every group
        can resume from (DROPPED before a window group's window), and the checkpoint of the linear-attention state
        there (NO_STATE: none, or no such layers); each page and the checkpoint held once more for the caller (who
        releases them with the rest of its tables)."""
        tables: list[list[int]] = [[] for _ in self.windows]
        if not self.enabled:
            return tables, NO_STATE
        path: list[PageNode] = []
        node: PageNode | None = self.roots.get(namespace)
        for key in self._keys(tokens, limit // self.page_size):
            if node is None or (node := node.children.get(key)) is None:
                break
            path.append(node)
        length = next(n for n in range(len(path), -1, -1) if self._resumable(path, n))
        self._clock += 1
        for node in path[:length]:
            node.last_use = self._clock
        for group, window in enumerate(self.windows):
            first = first_visible_page(length * self.page_size, window, self.page_size)
            tables[group] = [DROPPED] * first + [node.pages[group] for node in path[first:length]]
            self.pages.retain(tables[group][first:])
        state = path[length - 1].state if length and self.states is not None else NO_STATE
        if state != NO_STATE:
            self.states.retain(state)  # type: ignore[union-attr]
        return tables, state

    def _resumable(self, path: list[PageNode], length: int) -> bool:
        """Whether a request can resume after the first `length` pages of `path`: each window group holds the
        pages its next query sees, and the node there keeps the linear-attention state, if the model has such
        layers."""
        if self.states is not None and length and path[length - 1].state == NO_STATE:
            return False
        for group, window in enumerate(self.windows):
            first = first_visible_page(length * self.page_size, window, self.page_size)
            if window and any(node.pages[group] == DROPPED for node in path[first:length]):
                return False
        return True

    def insert(self, tokens: np.ndarray, tables: list[list[int]], full_pages: int,
               state: tuple[int, int] | None = None, namespace: Hashable = SHARED) -> bool:
        """Cache, in `namespace`, the first `full_pages` pages of a request's tables, whose tokens
        (tokens[:full_pages * page_size]) have their KV computed. A page whose tokens another request cached first
        is a duplicate: the request's table takes the cached page instead, and lets go of its own; a window page the
        node had given back is taken from the request. `state`: (pages, slot) a checkpoint of the linear-attention
        state after that many pages, kept by their node (with the caller's hold) unless it has one: whether it
        was."""
        if not self.enabled:
            return False
        self._clock += 1
        node = self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = PageNode(b"", [], None)
        kept = False
        for i, key in enumerate(self._keys(tokens, full_pages)):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = PageNode(key, [DROPPED] * len(tables), node)
                self.nodes += 1
            for group, table in enumerate(tables):
                mine, cached = table[i], child.pages[group]
                if mine == DROPPED or mine == cached:
                    continue
                if cached == DROPPED:
                    child.pages[group] = mine
                    self.pages.cache(mine)
                    self.cached_pages += 1
                else:
                    self.pages.retain([cached])
                    self.pages.release([mine])
                    table[i] = cached
            child.last_use = self._clock
            node = child
            if state is not None and state[0] == i + 1 and child.state == NO_STATE:
                child.state, kept = state[1], True
        return kept

    def evict_state(self) -> bool:
        """Give back the checkpoint that only the tree holds and was used least recently; whether there was one."""
        if self.states is None:
            return False
        held = [n for n in self._nodes() if n.state != NO_STATE and self.states.refs[n.state] == 1]
        if not held:
            return False
        node = min(held, key=lambda n: n.last_use)
        self.states.release(node.state)
        node.state = NO_STATE
        return True

    def evict(self, count: int) -> int:
        """Give back up to `count` pages that only the tree holds: the window pages of nodes that stay (interior, or
        held by a request) first, then whole leaves (a parent becomes a leaf once its children are gone); least
        recently used first. How many were given back."""
        if count <= 0 or not self.pages.evictable:
            return 0
        nodes = self._nodes()
        freed = 0
        windowed = [group for group, window in enumerate(self.windows) if window]
        if windowed:
            staying = sorted((n for n in nodes if n.children or not self._only_cached(n)), key=lambda n: n.last_use)
            for node in staying:
                for group in windowed:
                    page = node.pages[group]
                    if freed < count and page != DROPPED and self.pages.refs[page] == 1:
                        self._uncache(node, group)
                        freed += 1
                if freed >= count:
                    return freed
        leaves = [(n.last_use, id(n), n) for n in nodes if not n.children and self._only_cached(n)]
        heapq.heapify(leaves)
        while leaves and freed < count:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            freed += self._drop(node)
            if parent.parent is not None and not parent.children and self._only_cached(parent):
                heapq.heappush(leaves, (parent.last_use, id(parent), parent))
        self.roots = {namespace: root for namespace, root in self.roots.items() if root.children}
        return freed

    def flush(self) -> None:
        """Forget every cached page (requests that hold some keep them until they end) and start a new epoch."""
        for node in self._nodes():
            self._drop(node)
        self.roots = {}
        self.epoch += 1

    def forget(self, which: Callable[[Hashable], bool]) -> None:
        """Forget the namespaces `which` says, whole (their requests keep the pages they hold until they end)."""
        for namespace in [namespace for namespace in self.roots if which(namespace)]:
            for node in self._nodes(self.roots.pop(namespace)):
                self._drop(node)

    def _drop(self, node: PageNode) -> int:
        """Let go of a node removed from the tree; how many of its pages that frees."""
        if node.state != NO_STATE and self.states is not None:
            self.states.release(node.state)
            node.state = NO_STATE
        freed = 0
        for group, page in enumerate(node.pages):
            if page != DROPPED:
                freed += self.pages.refs[page] == 1
                self._uncache(node, group)
        self.nodes -= 1
        return freed

    def _uncache(self, node: PageNode, group: int) -> None:
        self.pages.uncache(node.pages[group])
        node.pages[group] = DROPPED
        self.cached_pages -= 1

    def _only_cached(self, node: PageNode) -> bool:
        return all(page == DROPPED or self.pages.refs[page] == 1 for page in node.pages)

    def _nodes(self, root: PageNode | None = None) -> list[PageNode]:
        """Every node below `root` (None: below every namespace's root)."""
        roots = self.roots.values() if root is None else [root]
        found, stack = [], [node for root in roots for node in root.children.values()]
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found
