"""Tensor-parallel facts of the KV heads: which heads a rank holds, which source ranks a
destination rank reads them from, and which destination ranks read one source rank.

With ``K`` KV heads over ``tp`` ranks, rank ``r`` holds heads ``r*K/tp .. (r+1)*K/tp - 1``
when ``K >= tp`` (``K % tp == 0``), else the one head ``r // (tp / K)`` (heads replicated,
``tp % K == 0``). A destination rank reads each of its heads from the lowest source rank that
holds it (:func:`source_ranks`), so with replicated heads one source rank may serve several
destination ranks (:func:`reader_ranks`): TP 1 -> 2 has both decode ranks read rank 0. An MLA
latent is the same on every rank: it reads like one replicated head.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TPRank", "as_tp_rank", "heads_of_rank", "reader_ranks", "source_ranks"]


@dataclass(frozen=True)
class TPRank:
    """One side's tensor-parallel degree and this side's rank in it."""

    degree: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        for name, value in (("degree", self.degree), ("rank", self.rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"TPRank.{name} must be an int, got {value!r}")
        if self.degree < 1:
            raise ValueError(f"TPRank.degree={self.degree} must be >= 1")
        if not 0 <= self.rank < self.degree:
            raise ValueError(f"TPRank.rank={self.rank} is outside the tensor-parallel degree "
                             f"{self.degree} (valid ranks: 0..{self.degree - 1})")

    def __str__(self) -> str:
        return f"TP{self.degree} rank {self.rank}"


def heads_of_rank(num_kv_heads: int, tp: TPRank) -> tuple[int, ...]:
    """The global KV heads rank ``tp.rank`` holds when ``num_kv_heads`` are split over
    ``tp.degree`` ranks (replicated when there are fewer heads than ranks).

    Raises:
        ValueError: neither of ``num_kv_heads`` and ``tp.degree`` divides the other.
    """
    k, n = num_kv_heads, tp.degree
    if k >= n:
        if k % n:
            raise ValueError(f"{k} KV heads cannot be split evenly over tensor-parallel degree "
                             f"{n}: the degree must divide the head count (or the head count "
                             "the degree, heads then replicated)")
        per = k // n
        return tuple(range(tp.rank * per, (tp.rank + 1) * per))
    if n % k:
        raise ValueError(f"{k} KV heads cannot be replicated over tensor-parallel degree {n}: "
                         "with fewer heads than ranks the head count must divide the degree")
    return (tp.rank // (n // k),)



def as_tp_rank(value: TPRank | tuple[int, int] | None, name: str = "tp") -> TPRank:
    """A connector's ``tp`` option as a :class:`TPRank`: ``None`` (TP 1), a ``TPRank`` or a
    ``(degree, rank)`` pair.

    Raises:
        TypeError, ValueError: naming ``name``, e.g. a rank outside the degree.
    """
    if value is None:
        return TPRank()
    if isinstance(value, TPRank):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        try:
            return TPRank(*value)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}={tuple(value)!r} (degree, rank): {exc}") from None
    raise TypeError(f"{name}={value!r} must be None (TP 1), a TPRank or a (degree, rank) pair")


def source_ranks(num_kv_heads: int, dst: TPRank, src_degree: int) -> tuple[int, ...]:
    """The source ranks (of ``src_degree``) destination rank ``dst`` reads its heads from:
    for each of its heads, the lowest source rank that holds it.

    Raises:
        ValueError: a head count that does not split over one of the degrees.
    """
    return tuple(sorted({next(r for r in range(src_degree)
                              if g in heads_of_rank(num_kv_heads, TPRank(src_degree, r)))
                         for g in heads_of_rank(num_kv_heads, dst)}))


def reader_ranks(num_kv_heads: int, src: TPRank, dst_degree: int) -> tuple[int, ...]:
    """The destination ranks (of ``dst_degree``) that read source rank ``src``: how many
    consumers each of its published blocks waits for (a producer's ``readers``).

    Raises:
        ValueError: a head count that does not split over one of the degrees.
    """
    return tuple(d for d in range(dst_degree)
                 if src.rank in source_ranks(num_kv_heads, TPRank(dst_degree, d), src.degree))
