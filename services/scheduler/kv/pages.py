"""The KV memory's pages: which are free, and who holds the others.

The KV pool (pool.py) is `num_pages` pages of `page_size` token slots in every layer; a request's
KV lives in the pages of its page table, token p at slot page_table[p // page_size] * page_size + p % page_size.
A page is held by the requests whose page tables name it and, once its tokens are cached, by the prefix cache
(prefix_cache.py): `refs` counts the holders, and a page is free again when the last one lets go. A cached page
that no request holds is `evictable`: the cache can give it back when pages run short. Page 0 is never handed
out: padded rows of a step point at it (a page of zeros, so that a masked key never carries NaN).
"""


class OutOfPages(Exception):
    """Not enough free pages for an allocation (the policy evicts and retracts before it gets here)."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages  # page 0 included
        self.page_size = page_size
        self.refs = [0] * num_pages
        self._cached = bytearray(num_pages)  # 1: the prefix cache holds it
        self._free = list(range(num_pages - 1, 0, -1))  # popped from the end: low pages first
        self.evictable = 0  # cached pages no request holds

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def usable(self) -> int:
        """Pages that can hold KV (all but page 0)."""
        return self.num_pages - 1

    @property
    def capacity_tokens(self) -> int:
        return self.usable * self.page_size

    def pages_for(self, tokens: int) -> int:
        """Pages that `tokens` tokens take."""
        return -(-tokens // self.page_size)

    def allocate(self, count: int) -> list[int]:
        """`count` free pages, held once each by the caller."""
        if count > len(self._free):
            raise OutOfPages(f"{count} pages asked for, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self.refs[page] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] += 1
            if self._cached[page] and self.refs[page] == 2:  # a request takes a page only the cache held
                self.evictable -= 1

    def release(self, pages: list[int]) -> None:
        """Let go of one hold on each page; a page nobody holds is free."""
        for page in pages:
            refs = self.refs[page] = self.refs[page] - 1
            assert refs >= 0, f"page {page} released more often than held"
            if self._cached[page] and refs == 1:
                self.evictable += 1
            elif refs == 0:
                self._free.append(page)

    # -- the prefix cache's hold (one per cached page) --

    def cache(self, page: int) -> None:
        """The prefix cache takes a hold on a page (one a request holds: its tokens were just computed)."""
        self._cached[page] = 1
        self.refs[page] += 1
        if self.refs[page] == 1:
            self.evictable += 1

    def uncache(self, page: int) -> None:
        """The prefix cache lets go of its hold on a page."""
        if self.refs[page] == 1:
            self.evictable -= 1
        self._cached[page] = 0
        self.release([page])
