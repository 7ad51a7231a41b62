"""The rules of the backend contract that the conformance suite checks.

Each rule has a stable id, one sentence stating it, and the place it is documented: a section
of ``docs/conformance.md`` whose heading is the rule id. A failing check raises
:class:`ConformanceError` naming the backend, the rule, that sentence and the doc anchor, so a
backend author reads what was broken and where the contract explains it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RULES", "ConformanceError", "Rule"]

DOC = "docs/conformance.md"


@dataclass(frozen=True)
class Rule:
    """One rule of the contract: ``id`` is also the heading of its section in the docs."""

    id: str
    statement: str

    @property
    def doc(self) -> str:
        """Where the rule is documented, e.g. ``docs/conformance.md#shape-blocks-first``."""
        return f"{DOC}#{self.id}"


_RULES = (
    Rule("backend-identity",
         "get_name() is a non-empty upper-case name, get_impl_cls() returns an AttentionImpl "
         "subclass, and PLATFORMS names at least one platform"),
    Rule("shape-blocks-first",
         "get_kv_cache_shape returns the blocks-first shape (num_blocks, 2, block_size, "
         "num_kv_heads, head_size), or (num_blocks, block_size, head_size) for MLA; only a "
         "backend that opts out of KV connectors may keep the legacy (2, num_blocks, ...) shape"),
    Rule("stride-order-permutation",
         "get_kv_cache_stride_order(False) is a permutation of the logical dims and "
         "get_kv_cache_stride_order(True) a permutation of those dims plus the leading layer dim"),
    Rule("cross-layer-claim",
         "get_kv_cache_stride_order(True) either keeps the layer dim outermost (no cross-layer) "
         "or puts the block dim first and the layer dim second (cross-layer), with the per-layer "
         "order unchanged behind them; supports_cross_layer() agrees with it"),
    Rule("kv-connector-claim",
         "a backend that supports KV connectors keeps each block of a layer one contiguous page "
         "(block dim outermost in memory); one that does not says why in a sentence and has "
         "use_kv_connector=True refused by validate_configuration"),
    Rule("validation-reasons",
         "validate_configuration never raises and refuses every configuration outside the "
         "declared capabilities with non-empty, one-line reasons that name the field"),
    Rule("validation-accepts-declared",
         "validate_configuration accepts a configuration built from the declared capabilities "
         "(reasons for it must come from check_combination and name the clashing fields with "
         "their values, each of which is accepted with another declared value of the others)"),
    Rule("validation-refuses-before-kernel",
         "a configuration validate_configuration accepts runs: an unsupported one is refused "
         "there, never by an exception (or a crash) inside do_kv_cache_update or forward"),
    Rule("cache-write-reference",
         "do_kv_cache_update writes each new token's K and V into exactly the slot slot_mapping "
         "names (skipping negative slots) and leaves every other byte of the cache unchanged"),
    Rule("forward-reference",
         "forward over a mixed batch (decode, prefill with a cached prefix, fresh prefill, "
         "padding rows) matches the float64 reference within the backend's element-wise "
         "tolerances and, token by token, within the model dtype's rounding "
         "(NORM_TOLERANCES), for every declared configuration, sliding window and attention "
         "type; it writes into the given output and leaves the KV cache unchanged"),
    Rule("undeclared-features-refused",
         "an AttentionImpl given sinks or a logits_soft_cap its backend does not declare "
         "(SUPPORTS_SINK, SUPPORTS_LOGITS_SOFT_CAP) raises at construction with a sentence "
         "saying so, never runs without the feature"),
    Rule("window-non-causal",
         "a sliding window on a non-causal layer (causal=False, or an encoder attention type) "
         "is symmetric: forward matches the float64 reference with |q_pos - k_pos| < "
         "sliding_window, unless the backend declares NON_CAUSAL_WINDOW_UNSUPPORTED and "
         "refuses the combination with a ValueError carrying that reason"),
    Rule("stale-bytes-masked",
         "forward reads only the tokens each request owns: NaN bit patterns in the unused tail "
         "of a request's last block and in blocks it does not own leave its output unchanged "
         "(masked loads, not a multiply by zero)"),
    Rule("strided-step-tensors",
         "do_kv_cache_update and forward read slot_mapping, query_start_loc, seq_lens and "
         "block_table through their strides: views of larger engine buffers (values at stride "
         "2, other values between them) give the cache and output of dense tensors, directly "
         "and through the builder"),
    Rule("engine-metadata",
         "the backend's builder and forward fed metadata made from an engine's own tensors "
         "(kvcore.attention_metadata_from_engine: a wider block table with stale ids, padded "
         "requests, padding rows of slot -1, int32 slots, strided views) give bit for bit the "
         "cache and output of kvcore's own metadata of the step, and leave the padding rows of "
         "the output untouched"),
    Rule("batch-invariant",
         "a backend declaring SUPPORTS_BATCH_INVARIANT gives every request bit-identical "
         "results whether it runs alone or in a batch"),
    Rule("cross-layer-untouched-neighbours",
         "on a per-layer view of a cross-layer allocation, do_kv_cache_update and forward touch "
         "no byte of the neighbouring layers"),
    Rule("cross-layer-bit-exact",
         "on a per-layer view of a cross-layer allocation, do_kv_cache_update and forward give "
         "results bit-identical to the same call on a contiguous per-layer cache (kernels take "
         "the page stride from the tensor, never from the sizes)"),
    Rule("adopted-orders",
         "on a cache adopted (kvcore.adopt_kv_caches) in each per-layer stride order of "
         "EXTRA_STRIDE_ORDERS, do_kv_cache_update and forward give, compared through the "
         "logical views, the cache and output bit-identical to those of a cache in the "
         "backend's own order holding the same data, and touch no byte around the cache"),
    Rule("builder-reference",
         "forward with the metadata of the backend's builder (get_builder_cls(), build() once "
         "per step) matches the float64 reference, and one builder serves steps of different "
         "shapes one after another"),
    Rule("overlapping-new-tokens-refused",
         "the backend's builder refuses, with a ValueError from build(), a step whose new "
         "tokens are written to slots the same step reads as context or to one slot twice "
         "(the write would replace a key attention reads)"),
    Rule("builder-persistent-buffers",
         "a backend declaring CUDA_GRAPH_SUPPORT other than NEVER has a builder with persistent "
         "buffers: steps built for one graph batch size give the same tensors (addresses, "
         "shapes, strides) and host values whatever their lengths and block tables, and the "
         "padded step gives the reference's rows"),
    Rule("cuda-graph-replay",
         "a decode step captured in a CUDA graph for a batch size and replayed after the "
         "builder was rebuilt with other lengths and block tables gives exactly the output of "
         "the same step run eagerly"),
    Rule("int64-offsets",
         "cache writes and attention address a cache larger than 2**31 elements correctly "
         "(all index arithmetic is int64)"),
)

#: Every rule by id.
RULES: dict[str, Rule] = {rule.id: rule for rule in _RULES}


class ConformanceError(AssertionError):
    """A backend broke a rule of the contract.

    The message names the backend, the rule id and statement, where the rule is documented,
    and the specific finding (``detail``).
    """

    def __init__(self, backend: str, rule: str, detail: str) -> None:
        self.backend = backend
        self.rule = RULES[rule]
        self.detail = detail
        super().__init__(
            f"{backend} broke conformance rule {rule!r} (documented in {self.rule.doc}): "
            f"{self.rule.statement}.\n{detail}"
        )
