"""FLASHINFER's page lists: kvcore's block table as FlashInfer's ragged ``(indptr, indices,
last_page_len)`` on the device (:func:`flashinfer_page_table`), and one step's lists computed
on the host from its host-side lengths (:class:`HostPages`), which
:class:`~kvcore_nvidia.backends.flashinfer_builder.FlashInferMetadataBuilder` fills in
page-locked staging slots."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvcore import AttentionMetadata
from kvcore_nvidia.backends.common import cumulative, used_blocks

__all__ = ["HostPages", "flashinfer_page_table"]


def flashinfer_page_table(
    attn_metadata: AttentionMetadata, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kvcore's block table as FlashInfer's ragged page lists.

    Returns:
        ``(indptr, indices, last_page_len)``: ``(num_seqs + 1,)`` cumulative page counts,
        ``(indptr[-1],)`` the used block-table entries request after request, and
        ``(num_seqs,)`` tokens in each request's last page (0 for a request with no tokens);
        all int32 on the block table's device.
    """
    seq_lens = attn_metadata.seq_lens.to(torch.int32)
    pages, indices = used_blocks(seq_lens, attn_metadata.block_table, block_size)
    last_page_len = torch.where(pages > 0, seq_lens - (pages - 1) * block_size, 0)
    return cumulative(pages), indices, last_page_len.to(torch.int32)


def _put(tensor: torch.Tensor, array: np.ndarray, values: torch.Tensor | np.ndarray) -> None:
    """``values`` into the first entries of a list (``tensor`` and its numpy view
    ``array``): one torch copy when a tensor fills it (no numpy view of the tensor to make)."""
    n = values.shape[0]
    if isinstance(values, torch.Tensor):
        if n == tensor.shape[0]:
            tensor.copy_(values)
            return
        values = values.numpy()
    array[:n] = values


@dataclasses.dataclass(eq=False)
class HostPages:
    """One step's FlashInfer page lists on the host (all int32, CPU).

    Attributes:
        qo_indptr: ``(n + 1,)`` cumulative query tokens.
        seq_lens: ``(n,)`` cached + new tokens per request.
        pages: ``(n,)`` block-table entries each request uses.
        indptr: ``(n + 1,)`` cumulative ``pages``.
        last_page_len: ``(n,)`` tokens in each request's last page (0 for an empty request).
    """

    qo_indptr: torch.Tensor
    seq_lens: torch.Tensor
    pages: torch.Tensor
    indptr: torch.Tensor
    last_page_len: torch.Tensor
    # (2n + 2,) int32 beside the lists, where tail() writes its rebased offsets (so they are
    # page-locked when the lists are); None: tail() allocates.
    _spare: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    # numpy views of the five lists (the same memory), made once.
    _arrays: tuple[np.ndarray, ...] = dataclasses.field(default=(), repr=False)
    # What refill() may keep from the last refill: the page counts (bytes) indptr holds the
    # cumulative sum of, and whether qo_indptr holds 0, 1, ..., n (a uniform decode's).
    _indptr_of: bytes | None = dataclasses.field(default=None, repr=False)
    _counting: bool = dataclasses.field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not self._arrays:
            lists = (self.qo_indptr, self.seq_lens, self.pages, self.indptr, self.last_page_len)
            self._arrays = tuple(t.numpy() for t in lists)

    @staticmethod
    def words(size: int) -> int:
        """int32 elements the lists of ``size`` requests take in a buffer (see :meth:`of`)."""
        return 7 * size + 4

    @classmethod
    def in_buffer(cls, size: int, out: torch.Tensor) -> HostPages:
        """Lists of ``size`` requests laid out in ``out`` (a contiguous int32 CPU tensor of at
        least :meth:`words` ``(size)`` elements), to be filled by :meth:`refill`: a builder
        keeps one per staging slot and batch size, so a step only recomputes the values."""
        words = cls.words(size)
        if out.dtype != torch.int32 or out.dim() != 1 or out.shape[0] < words:
            raise ValueError(f"out must be a 1-D int32 tensor of at least {words} elements "
                             f"for {size} requests, got {out.dtype} {tuple(out.shape)}")
        # qo_indptr, seq_lens, pages, indptr, last_page_len, then tail()'s spare
        sizes = (size + 1, size, size, size + 1, size, 2 * size + 2)
        return cls(*out.split_with_sizes((*sizes, out.shape[0] - words))[:6])

    @classmethod
    def of(cls, qo_indptr: torch.Tensor | np.ndarray, seq_lens: torch.Tensor | np.ndarray,
           block_size: int, *, size: int | None = None,
           out: torch.Tensor | None = None) -> HostPages:
        """The lists of a step with these host lengths (see :meth:`refill`), padded to
        ``size`` requests (default ``n``), as views of ``out`` (see :meth:`in_buffer`; e.g.
        a page-locked staging slot, so copies to the device run asynchronously; default: a
        new tensor)."""
        n = seq_lens.shape[0]
        size = n if size is None else size
        if out is None:
            out = torch.empty(cls.words(size), dtype=torch.int32)
        return cls.in_buffer(size, out).refill(qo_indptr, seq_lens, block_size)

    def refill(self, qo_indptr: torch.Tensor | np.ndarray | None,
               seq_lens: torch.Tensor | np.ndarray, block_size: int) -> HostPages:
        """Compute the lists of a step in place, from its host lengths (``(n + 1,)`` and
        ``(n,)`` integers on the CPU, ``n`` at most :attr:`num_seqs`), padded to
        :attr:`num_seqs` requests of one new token and one cached token each (the padding
        requests of :class:`kvcore.PersistentMetadataBuilder`); returns ``self``.
        ``qo_indptr`` ``None``: a uniform decode (request ``i``'s one new token is row ``i``).

        A few numpy calls on numpy views of the lists' memory (the host lengths copied in by
        torch when they fill a list): no new host tensor. What the last refill left and this
        one would write again is kept:
        ``qo_indptr`` of one uniform decode after another, ``indptr`` while the page counts
        stay (call :meth:`forget` when anything else wrote the memory).
        """
        n, size = seq_lens.shape[0], self.num_seqs
        if size < n:
            raise ValueError(f"these lists hold {size} requests, fewer than the {n} of "
                             "seq_lens")
        qo, seq, pages, indptr, last = self._arrays
        if qo_indptr is None:
            if not self._counting:
                qo[:] = np.arange(size + 1, dtype=np.int32)
                self._counting = True
        else:
            _put(self.qo_indptr, qo, qo_indptr)
            if size > n:
                np.add(np.arange(1, size - n + 1, dtype=np.int32), qo[n], out=qo[n + 1:])
            self._counting = False
        _put(self.seq_lens, seq, seq_lens)
        if size > n:
            seq[n:] = 1
        # pages = ceil(seq / block_size) and the remainder r of seq + block_size - 1, so
        # last = r + 1 = seq - (pages - 1) * block_size; its minimum with seq makes it 0 for
        # a request without pages (elsewhere it is at most seq already)
        np.add(seq, block_size - 1, out=last)
        np.divmod(last, block_size, out=(pages, last))
        last += 1
        np.minimum(last, seq, out=last)
        counts = pages.tobytes()
        if counts != self._indptr_of:
            indptr[0] = 0
            np.add.accumulate(pages, out=indptr[1:])
            self._indptr_of = counts
        return self

    def forget(self) -> None:
        """Something else wrote the lists' memory (another layout of the same buffer): the
        next :meth:`refill` computes every list."""
        self._indptr_of = None
        self._counting = False

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def page_counts_key(self) -> bytes:
        """The page counts as bytes: equal keys, equal request and page counts (a cheap
        comparison with a step planned before)."""
        return self._arrays[2].tobytes()

    def leading_decodes(self) -> int:
        """How many requests at the front have exactly one query token."""
        other = np.flatnonzero(np.diff(self._arrays[0]) != 1)
        return int(other[0]) if other.size else self.num_seqs

    def tail(self, k: int) -> HostPages:
        """The lists of requests ``k..n-1``, offsets rebased to 0 (``indices`` start at
        ``indptr[k]``); the rebased offsets are written beside the lists (a later ``tail``
        overwrites them)."""
        if k == 0:
            return self
        m = self.num_seqs - k + 1
        spare = self._spare if self._spare is not None else torch.empty(2 * m,
                                                                          dtype=torch.int32)
        qo_indptr, indptr = spare[:m], spare[m:2 * m]
        qo_array, indptr_array = qo_indptr.numpy(), indptr.numpy()
        qo, seq, pages, full_indptr, last = self._arrays
        np.subtract(qo[k:], qo[k], out=qo_array)
        np.subtract(full_indptr[k:], full_indptr[k], out=indptr_array)
        return HostPages(qo_indptr, self.seq_lens[k:], self.pages[k:], indptr,
                         self.last_page_len[k:], _arrays=(qo_array, seq[k:], pages[k:],
                                                          indptr_array, last[k:]))
