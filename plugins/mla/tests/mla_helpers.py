"""Shared helpers of kvcore-mla's tests: devices, random batches, cross-layer views, tolerances."""

from __future__ import annotations

import zlib

import torch

from kvcore.testing import random_block_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: (atol, rtol) of a kernel's output against the float64 reference, per input dtype. Under the
#: interpreter everything is computed in float32; on a GPU, bf16/fp16 dots round ``p`` too.
TOLERANCE = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def generator(*key: object) -> torch.Generator:
    """A CPU generator seeded from ``key`` (a test's parameters), stable across runs."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator,
          scale: float = 1.0) -> torch.Tensor:
    """Random normal data of any dtype (fp8 included) on :data:`DEVICE`."""
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


def random_bytes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(DEVICE)


def block_tables(seq_lens: list[int], page_size: int, num_pages: int,
                 gen: torch.Generator) -> torch.Tensor:
    """``(num_seqs, max_pages)`` int32 tables of distinct random page ids covering each request
    (:func:`kvcore.testing.random_block_tables`), zero-padded, on the test device."""
    tables = random_block_tables(seq_lens, page_size, num_pages, gen)
    table = torch.zeros(len(seq_lens), max(max(map(len, tables)), 1), dtype=torch.int32)
    for i, ids in enumerate(tables):
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return table.to(DEVICE)


def cross_layer_view(per_layer_shape: tuple[int, ...], num_layers: int, layer: int,
                     dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``(num_blocks, num_layers, *rest)`` pool and its layer ``layer`` view.

    The view has the per-layer shape ``(num_blocks, *rest)`` and a block stride ``num_layers``
    times the page size, exactly what a cross-layer allocation hands a kernel. The other layers
    hold random data, so a kernel that assumes packed pages reads or writes the wrong bytes.
    """
    num_blocks, *rest = per_layer_shape
    if dtype == torch.uint8:
        pool = random_bytes((num_blocks, num_layers, *rest), gen)
    else:
        pool = randn((num_blocks, num_layers, *rest), dtype, gen)
    return pool, pool[:, layer]


def other_layers(pool: torch.Tensor, layer: int) -> torch.Tensor:
    """Every layer of a ``(num_blocks, num_layers, ...)`` pool except ``layer``, as raw bytes."""
    keep = [i for i in range(pool.shape[1]) if i != layer]
    return pool[:, keep].contiguous().view(torch.uint8)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 what: str) -> None:
    """``actual`` within the per-dtype :data:`TOLERANCE` of the float64 ``expected``.

    Element-wise ``|err| <= atol + rtol * |expected|``, and the error's norm at most ``rtol``
    of the expected values' norm: attention outputs averaged over thousands of keys are small,
    and an absolute tolerance alone would pass a wrong kernel.
    """
    atol, rtol = TOLERANCE[dtype]
    a = actual.double()
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(a), finite), f"{what}: non-finite entries differ"
    err = (a[finite] - expected[finite]).abs()
    if err.numel() == 0:
        return
    bound = atol + rtol * expected[finite].abs()
    assert (err <= bound).all(), (
        f"{what}: max |err| {err.max().item():.3g} exceeds atol={atol} rtol={rtol}")
    relative = err.norm().item() / max(expected[finite].norm().item(), 1e-30)
    assert relative <= rtol, f"{what}: relative error {relative:.3g} exceeds {rtol}"


#: Latent and rope widths of the decode-kernel tests: 512 + 64 scaled down so the interpreter
#: stays fast.
DECODE_RANK, DECODE_ROPE = 64, 16


def decode_case(gen: torch.Generator, heads: int, page: int, lens: list[int],
                dtype: torch.dtype = torch.float32, rank: int = DECODE_RANK
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode batch: latent queries ``(len(lens), heads, rank + DECODE_ROPE)``, a random
    latent cache of pages of ``page`` tokens (3 more pages than the requests use), their block
    table and ``seq_lens``."""
    pages = sum(-(-n // page) for n in lens) + 3
    cache = randn((pages, page, rank + DECODE_ROPE), dtype, gen)
    table = block_tables(lens, page, pages, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return randn((len(lens), heads, rank + DECODE_ROPE), dtype, gen), cache, table, seq_lens


#: DeepSeek's sizes for the real-size GPU tests: latent 512 + rope 64, pages of 64 tokens, and
#: the softmax scale of its 128 + 64 query dims.
REAL_RANK, REAL_ROPE, REAL_PAGE = 512, 64, 64
REAL_SCALE = (128 + REAL_ROPE) ** -0.5


def real_size_decode_case(gen: torch.Generator
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A real-size decode batch on :data:`DEVICE`: 4 requests of 1024 tokens (one of 1000,
    ending inside a page), 128 heads, bf16; ``(q, cache, table, seq_lens)`` as
    :func:`decode_case` gives them."""
    lens = [1024, 1024, 1000, 1024]
    pages = sum(-(-n // REAL_PAGE) for n in lens) + 4
    cache = randn((pages, REAL_PAGE, REAL_RANK + REAL_ROPE), torch.bfloat16, gen)
    table = block_tables(lens, REAL_PAGE, pages, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return randn((len(lens), 128, REAL_RANK + REAL_ROPE), torch.bfloat16, gen), cache, table, \
        seq_lens


def run_decode(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
               splits: int, config=None, rank: int = DECODE_RANK, scale: float = 0.1,
               **scales) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_attention_fwd`` of the MLA decode kernel on NaN-filled outputs: (o, lse)."""
    from kvcore_mla.ops.triton_mla_attention import decode_attention_fwd

    batch, heads, _ = q.shape
    o = torch.full((batch, heads, rank), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((batch, heads), float("nan"), dtype=torch.float32, device=q.device)
    logits = torch.full((batch, heads, splits, rank + 1), float("nan"), dtype=torch.float32,
                        device=q.device)
    decode_attention_fwd(q, cache, cache[..., :rank], o, lse, table, lens, logits, splits,
                         scale, cache.shape[1], True, config=config, **scales)
    return o, lse


def decode_reference(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                     lens: torch.Tensor, rank: int = DECODE_RANK, scale: float = 0.1
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 reference of :func:`run_decode`: (o, lse)."""
    from kvcore_mla.ops import decode_attention_ref

    batch, heads, _ = q.shape
    c = cache.double()
    o = torch.empty(batch, heads, rank, dtype=torch.float64, device=q.device)
    lse = torch.empty(batch, heads, dtype=torch.float64, device=q.device)
    decode_attention_ref(q.double(), c, c[..., :rank], o, lse, table, lens, None, 1, scale,
                         cache.shape[1], True)
    return o, lse


def assert_decode_close(o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor,
                        cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                        dtype: torch.dtype, rank: int = DECODE_RANK, scale: float = 0.1) -> None:
    """``(o, lse)`` of :func:`run_decode` against :func:`decode_reference` on ``cache`` (the
    values the kernel should see), within ``dtype``'s tolerance."""
    o_ref, lse_ref = decode_reference(q, cache, table, lens, rank=rank, scale=scale)
    assert_close(o, o_ref, dtype, "o")
    assert_close(lse, lse_ref, dtype, "lse")
