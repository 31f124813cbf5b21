"""The prefix cache: a radix tree over token ids at page granularity (SGLang's RadixCache, with a page per node).

Each node below the root is one full page of tokens: its key is those `page_size` token ids, its value the KV page
that holds them, and its path from the root the tokens before them. A request starts from the longest cached
prefix of its tokens (`match`: only their KV beyond it is computed), and its full pages go into the tree as soon
as their KV is computed (`insert`: after a prefill, when it is retracted, when it ends), so that n samples of
one prompt, or the next turn of a conversation, find them. The tree holds each of its pages once (PagePool);
pages that no request holds are given back least recently used first when pages run short (`evict`).

Only full pages are shared: a partly filled last page stays its request's own. A weight update or a new weight
version flushes the tree (`flush`, a new `epoch`): KV computed by the old weights never serves a new request.
"""

import heapq
from dataclasses import dataclass, field

import numpy as np

from services.scheduler.kv.pages import PagePool


@dataclass(eq=False)
class PageNode:
    key: bytes  # the page's token ids, int32
    page: int
    parent: "PageNode | None"
    children: dict[bytes, "PageNode"] = field(default_factory=dict)
    last_use: int = 0  # the cache's clock when a request last matched or inserted it


class PrefixCache:
    def __init__(self, pages: PagePool, enabled: bool = True):
        self.pages = pages
        self.page_size = pages.page_size
        self.enabled = enabled
        self.root = PageNode(b"", 0, None)
        self.epoch = 0  # bumped by flush: requests whose KV is older insert nothing
        self.nodes = 0  # cached pages
        self._clock = 0

    def _keys(self, tokens: np.ndarray, pages: int) -> list[bytes]:
        data = np.ascontiguousarray(tokens[:pages * self.page_size], dtype=np.int32).tobytes()
        step = self.page_size * 4
        return [data[i * step:(i + 1) * step] for i in range(pages)]

    def match(self, tokens: np.ndarray, limit: int) -> list[int]:
        """The pages of the longest cached prefix of tokens[:limit], in order, each held once more for the
        caller (who releases them with the rest of its page table)."""
        if not self.enabled:
            return []
        self._clock += 1
        node, found = self.root, []
        for key in self._keys(tokens, limit // self.page_size):
            child = node.children.get(key)
            if child is None:
                break
            child.last_use = self._clock
            found.append(child.page)
            node = child
        self.pages.retain(found)
        return found

    def insert(self, tokens: np.ndarray, page_table: list[int], full_pages: int) -> None:
        """Cache the first `full_pages` pages of a request's page table, whose tokens (tokens[:full_pages *
        page_size]) have their KV computed. A page whose tokens another request cached first is a duplicate: the
        request's page table takes the cached page instead, and lets go of its own."""
        if not self.enabled:
            return
        self._clock += 1
        node = self.root
        for i, key in enumerate(self._keys(tokens, full_pages)):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = PageNode(key, page_table[i], node)
                self.pages.cache(child.page)
                self.nodes += 1
            elif child.page != page_table[i]:
                self.pages.retain([child.page])
                self.pages.release([page_table[i]])
                page_table[i] = child.page
            child.last_use = self._clock
            node = child

    def evict(self, count: int) -> int:
        """Give back up to `count` pages that only the tree holds, least recently used leaves first (a parent
        becomes a leaf once its children are gone); how many were given back."""
        if count <= 0 or not self.pages.evictable:
            return 0
        leaves = [(n.last_use, id(n), n) for n in self._nodes() if not n.children and self._only_cached(n)]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < count:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            self.pages.uncache(node.page)
            self.nodes -= 1
            freed += 1
            if parent is not self.root and not parent.children and self._only_cached(parent):
                heapq.heappush(leaves, (parent.last_use, id(parent), parent))
        return freed

    def flush(self) -> None:
        """Forget every cached page (requests that hold some keep them until they end) and start a new epoch."""
        for node in self._nodes():
            self.pages.uncache(node.page)
        self.root = PageNode(b"", 0, None)
        self.nodes = 0
        self.epoch += 1

    def _only_cached(self, node: PageNode) -> bool:
        return self.pages.refs[node.page] == 1

    def _nodes(self) -> list[PageNode]:
        found, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found
