"""The method contract: a `Method` (validated hyperparameters) builds a `KVCache` of its own cache layers.

Three levels, as in transformers' cache_utils:
- `Method`: a dataclass of hyperparameters, checked in `__post_init__`; `make_cache(model, dictionaries)` builds a cache.
- `KVCache(transformers.Cache)`: one layer per model layer, plus the hooks the engine calls for every method alike:
  `model_kwargs()` (passes the cache to kvzip's attention function), `on_step(token_ids, texts)` after every sampled
  token (a method that segments thoughts watches the text there), `memory()` and `stats()`.
- `KVLayer(CacheLayerMixin)`: owns one layer's state. A layer that needs the query implements `attend(module, query,
  key, value, mask, scaling, state) -> (B, q, Hq, d)`, called with the cache's `ForwardState` for this forward (from
  `before_forward`): what a layer needs from beyond itself arrives there, what it hands back it leaves with `record`.

Memory is reported by tier, in bytes, as what is really held (a dense tier's spare room, `DenseLayer.SPARE`, aside):
`device` dense K/V on the compute device, `codes` coded tokens (indices + coefficients), `dictionary` per-sequence
dictionary state, `host` detail kept off the device; `full_same_dtype` and `fp16_full`, what a full cache would hold
for the same tokens, give every report a ratio. Every layer of every method (`full` and transformers' quantized layers,
the peers, included) satisfies `CacheLayer`: `memory()` by tier, and `full_bytes()` from `FullBytes`, the one place
the full-cache equivalent (sliding windows included) is counted.
"""

from __future__ import annotations

import dataclasses
import operator
import typing
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvzip.errors import UserError
from kvzip.methods.buffer import Buffer
from kvzip.methods.fields import check_choice, check_positive, convert_option, model_layout  # noqa: F401  (re-exported)
from kvzip.rope import full_tokens

TIERS = ("device", "codes", "dictionary", "host")


def tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def kv_report(peak: dict, last: dict) -> dict:
    """The one memory report every command and workload prints: peak and last bytes of a cache, by tier, against
    what `full` holds for the same tokens in the same dtype (`kv_bytes_full`, so `full` reads 1.00) and, apart,
    against an fp16 full cache. `peak` and `last` are `KVCache.memory()` dicts (peak: the per-key maximum).
    Total counts every tier (the host tier is memory too); device counts what attention needs resident."""
    full, fp16 = last.get("full_same_dtype", 0), last.get("fp16_full", 0)
    total, device = peak.get("total", 0), peak.get("on_device", 0)
    ratio = lambda n, d: round(n / d, 4) if d else None  # noqa: E731
    return {
        "kv_bytes_peak": total,
        "kv_bytes_device_peak": device,
        "kv_bytes_host_peak": peak.get("host", 0),
        "kv_bytes_final": last.get("total", 0),
        "kv_bytes_by_tier": {t: last.get(t, 0) for t in TIERS},
        "kv_bytes_full": full,
        "kv_bytes_fp16_full": fp16,
        "kv_ratio_vs_full": ratio(total, full),
        "kv_device_ratio_vs_full": ratio(device, full),
        "kv_ratio_vs_fp16_full": ratio(total, fp16),
    }


@typing.runtime_checkable
class CacheLayer(typing.Protocol):
    """What `KVCache.memory()` reads from each layer, whatever the method: its bytes by tier (keys of `TIERS`) and
    what a full cache would hold for the tokens it has seen, at `element_size` bytes per value."""

    is_initialized: bool
    dtype: torch.dtype

    def memory(self) -> dict[str, int]: ...

    def full_bytes(self, element_size: int) -> int: ...


class FullBytes:
    """Mixin: `full_bytes` for any layer that knows its shape (`batch`, `kv_heads`, `head_dim`), its length
    (`get_seq_length()`, the tokens seen) and its sliding window (`sliding`, None for full attention). A full cache
    holds K and V of every token seen, or on a sliding-window layer of the last window - 1 (`rope.full_tokens`)."""

    batch = kv_heads = head_dim = 0
    sliding: int | None = None

    def full_bytes(self, element_size: int) -> int:
        tokens = full_tokens(self.get_seq_length(), self.sliding)
        return 2 * self.batch * self.kv_heads * tokens * self.head_dim * element_size


def record_shape(layer, key_states: torch.Tensor) -> None:
    """Keep what `FullBytes` and `KVCache.memory` read from the first keys a layer sees (B, Hkv, T, d)."""
    layer.batch, layer.kv_heads, _, layer.head_dim = key_states.shape
    layer.dtype = key_states.dtype


class KVLayer(FullBytes, CacheLayerMixin):
    """Base for kvzip cache layers: counts tokens seen and reports memory. Subclasses store what they keep."""

    def __init__(self, sliding: int | None = None):
        super().__init__()
        self.seen = 0  # tokens written to this layer (virtual length, what the mask and RoPE positions count)
        self.sliding = sliding  # the layer's own sliding window (None: full attention)
        self.dtype = torch.float32

    def lazy_initialization(self, key_states, value_states):
        record_shape(self, key_states)
        self.device = key_states.device
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask covers every virtual position; layers that keep fewer tokens gather its columns in `attend`.
        return self.seen + query_length, 0

    def memory(self) -> dict[str, int]:
        raise NotImplementedError

    def reset(self) -> None:
        """Back to the state before the first forward: every per-token tensor is made anew by `lazy_initialization`
        from the next keys the layer sees."""
        self.is_initialized, self.seen = False, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Refused unless a subclass knows every per-row tensor it holds (`DenseLayer` does)."""
        raise UserError(f"{type(self).__name__} cannot reorder its rows (beam search): its per-row state is not only "
                        "keys and values; decode with one row per sequence instead")


class DenseLayer(KVLayer):
    """A layer that keeps some tokens dense: keys and values (B, Hkv, S, d) and their virtual positions (B, S), new
    tokens appended by `update`. What it evicts, codes or moves off the device is the subclass's; `dense_dtype`
    says what the dense tokens are kept in (the model's dtype unless a subclass stores them smaller).

    Each per-token tensor lives in a `Buffer` of its own (kvzip.methods.buffer): preallocated storage with spare room
    along the token axis, written by index. `extend` appends, `prepend` puts slots in front, `keep` compacts what an
    eviction keeps in place and `drop` lets the oldest go; each sets the attribute to the buffer's view. A subclass
    may still assign an attribute anything (a gather, a rebuilt row): the buffer sees that the attribute is no longer
    its view, and the next call on that name adopts the new tensor (an append then allocates room once). `memory()` counts the
    stored tokens, not the spare slots (`SPARE` or 1/16 more at allocation), as it does not count DynamicCache's
    transient copy in its `cat`."""

    SPARE = 16  # slots of spare room at least (or 1/16 of those stored), allocated beyond the stored tokens
    # the per-row tensors (batch first) `reorder_cache` moves; a subclass adds what else it keeps per row, or refuses
    ROW_TENSORS: typing.ClassVar[tuple[str, ...]] = ("keys", "values", "positions")

    def dense_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        b, h, _, d = key_states.shape
        dtype = self.dense_dtype(key_states.dtype)
        self.keys = torch.zeros(b, h, 0, d, dtype=dtype, device=self.device)
        self.values = torch.zeros(b, h, 0, d, dtype=dtype, device=self.device)
        self.positions = torch.zeros(b, 0, dtype=torch.long, device=self.device)
        self.buffers: dict[str, Buffer] = {}  # name -> the buffer its attribute is a view of

    @staticmethod
    def _token_axis(x: torch.Tensor) -> int:
        return 2 if x.dim() == 4 else 1  # keys, values (B, H, S, d); positions (B, S)

    def _get(self, name: str) -> torch.Tensor:
        """The tensor `extend` and `prepend` work on: an attribute of the layer, or of an object it holds (a dotted
        name, e.g. fadkv's `coded_keys.codes.idx`)."""
        return operator.attrgetter(name)(self)

    def _set(self, name: str, value: torch.Tensor) -> None:
        holder, _, attr = name.rpartition(".")
        setattr(operator.attrgetter(holder)(self) if holder else self, attr, value)

    def _buffer(self, name: str) -> Buffer:
        """The buffer behind attribute `name`: its own while the attribute is still the view it handed out, else a
        new one that adopts the attribute as it is."""
        cur, buffer = self._get(name), self.buffers.get(name)
        if buffer is None or buffer.last is not cur:
            buffer = self.buffers[name] = Buffer(cur, self._token_axis(cur), self.SPARE)
        return buffer

    def extend(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """Attribute `name` with `new` appended along the token axis (`Buffer.append`)."""
        view = self._buffer(name).append(new)
        self._set(name, view)
        return view

    def prepend(self, name: str, count: int, fill) -> torch.Tensor:
        """Attribute `name` with `count` slots set to `fill` put in front (`Buffer.prepend`)."""
        view = self._buffer(name).prepend(count, fill)
        self._set(name, view)
        return view

    def keep(self, names: tuple[str, ...], index: torch.Tensor) -> None:
        """Attributes `names`, which hold the same tokens, each reduced in place to its tokens `index` (B, K) or
        (B, H, K), in that order (`Buffer.keep`, the slots to write found once for all)."""
        moves = Buffer.moves(index, self._buffer(names[0]).length)
        for name in names:
            self._set(name, self._buffer(name).keep(index, moves))

    def drop(self, name: str, count: int) -> torch.Tensor:
        """Attribute `name` without its first `count` tokens, in the same storage (`Buffer.drop`)."""
        view = self._buffer(name).drop(count)
        self._set(name, view)
        return view

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows reordered (or repeated) as `beam_idx` (B',) says, every per-row tensor of `ROW_TENSORS` alike; a layer
        that keeps per-row state beyond them sets `ROW_TENSORS = ()` and refuses."""
        if not self.ROW_TENSORS:
            return super().reorder_cache(beam_idx)
        if not self.is_initialized:
            return
        for name in self.ROW_TENSORS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, beam_idx.to(value.device)))
        self.batch = len(beam_idx)

    def memory(self) -> dict[str, int]:
        """The dense tier on the device; a subclass that keeps more (scores, codes, a host tier) adds its own."""
        return {"device": tensor_bytes(self.keys, self.values)}

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        self.extend("keys", key_states.to(self.keys.dtype))
        self.extend("values", value_states.to(self.values.dtype))
        self.extend("positions", self.new_positions(q))
        self.seen += q
        return self.keys, self.values

    def new_positions(self, q: int) -> torch.Tensor:
        """The positions of q new tokens, laid out as `positions` is: (B, q) here, one position set per row."""
        return torch.arange(self.seen, self.seen + q, device=self.device).expand(self.batch, q)


class ForwardState:
    """What one forward hands every layer's `attend`, built once by the cache's `before_forward`, and the one place a
    layer leaves what the cache reads back in `after_forward`. A method that needs more (RoPE tables, the rows'
    thought state) subclasses it; a layer reads what it is handed here and never reaches its cache."""

    def __init__(self, attention_mask: torch.Tensor | None, new_tokens: int):
        self.attention_mask, self.new_tokens = attention_mask, new_tokens  # the 2D mask (B, past + new) and q
        self.records: dict[int, typing.Any] = {}  # layer index -> what that layer handed back this forward

    def record(self, layer_idx: int, value) -> None:
        self.records[layer_idx] = value


class KVCache(Cache):
    """A transformers Cache of kvzip layers, with the hooks the engine calls for every method alike."""

    def __init__(self, layers: list[CacheLayerMixin], method: "Method"):
        super().__init__(layers=layers)
        self.method = method
        self.state: ForwardState | None = None  # this forward's, from before_forward; None outside a forward

    def model_kwargs(self) -> dict:
        """Extra keyword arguments for the model's forward: hands this cache to kvzip's attention function."""
        return {"kvzip_cache": self}

    def on_prefill(self, attention_mask: torch.Tensor) -> None:
        """Called before a prompt's forward with the 2D mask (B, past + T): tells layers each row's left padding."""
        padding = (attention_mask.cumsum(-1) == 0).sum(-1)  # (B,) leading zeros
        for layer in self.layers:
            set_padding = getattr(layer, "set_padding", None)
            if set_padding is not None:
                set_padding(padding)

    def on_step(self, token_ids: torch.Tensor, texts: list[str]) -> None:
        """Called after each sampled token: token_ids (B,), texts the decoded delta per row. No-op by default."""

    def before_forward(self, attention_mask: torch.Tensor, new_tokens: int) -> None:
        """Called before every forward with the 2D mask (B, past + new_tokens) the forward will get: cache-wide
        work for the tokens about to be fed (plans, rebuilds, evictions) runs here, never inside a layer's forward.
        Builds `state`, what every layer's `attend` is handed; a subclass calls this first, or sets its own."""
        self.state = ForwardState(attention_mask, new_tokens)

    def after_forward(self) -> None:
        """Called after every forward, once every layer has stored its new tokens and attended: cache-wide work that
        reads what this forward wrote (coding, finishing thoughts, votes) runs here. No-op by default."""

    def reset(self) -> None:
        """Forget every token: each layer goes back to its state before the first forward (transformers' `reset`
        zeroes keys and values alone, which would leave positions, codes and thought state stale)."""
        for layer in self.layers:
            layer.reset()
            layer.is_initialized = False  # transformers' own layers (full, the peers) start afresh on the next update

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder (or repeat) the rows, as beam search asks; every layer does it or refuses in one line."""
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def for_scoring(self) -> bool:
        """Called before a pass that only scores (teacher forcing): a cache may then spend process memory to save
        time, never changing its numbers or its memory report. True when it did (the pass's speed is then not the
        method's). No-op by default."""
        return False

    def memory(self) -> dict[str, int]:
        """Bytes by tier summed over layers, plus the full-cache bytes for the same tokens."""
        total = dict.fromkeys(TIERS, 0)
        full_same = fp16 = 0
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            for tier, n in layer.memory().items():
                total[tier] += n
            full_same += layer.full_bytes(torch.empty(0, dtype=layer.dtype).element_size())
            fp16 += layer.full_bytes(2)
        total["total"] = sum(total[t] for t in TIERS)
        total["on_device"] = total["total"] - total["host"]
        total["full_same_dtype"] = full_same
        total["fp16_full"] = fp16
        return total

    def stats(self) -> dict:
        """Method-specific statistics for the live display and bench (empty by default)."""
        return {}


@dataclass
class Method:
    """Base of all methods: a dataclass of hyperparameters. Subclasses set `name` and implement `make_cache`."""

    name: typing.ClassVar[str] = ""
    summary: typing.ClassVar[str] = ""
    needs_dictionary: typing.ClassVar[bool] = False
    # Small options under which the method compresses within a few dozen tokens of a tiny model: the test matrix
    # (tests/matrix.py) reads them, so a new method is covered without editing any test.
    test_options: typing.ClassVar[dict[str, str]] = {}
    # A method that keeps every prompt token by design (it compresses what the model writes): the bench's `prompt`
    # workload, which measures prompt compression, skips it.
    keeps_prompt: typing.ClassVar[bool] = False
    # Options under which the method keeps every token (a budget beyond any test sequence), so it must equal `full`;
    # None for a method that has no such setting (hf-fp8 quantizes every token).
    lossless_options: typing.ClassVar[dict[str, str] | None] = {}

    def make_cache(self, model, dictionaries=None) -> KVCache:
        raise NotImplementedError

    def plan_budget(self, budget, fixed: frozenset[str]):
        """This method's options at `budget` (a `kvzip.budget.Budget`: F of full's bytes for so many tokens, on a
        tier) as a `kvzip.budget.Plan`, leaving the options named in `fixed` (the user's) as they are. Each method
        says here how F becomes its options, and why in its docs page; the test matrix holds every method to it."""
        raise NotImplementedError(f"method '{self.name}' has no budget mapping (Method.plan_budget)")

    def dictionary_keys(self) -> tuple[str, ...]:
        """The key modes (`kvzip.sparse.KEY_MODES`) of the dictionaries this method, with its options, runs on, the
        one to look for first first; () when it uses no dictionary. kvzip.dictionary_lookup picks the default file by it."""
        return ("post-rope",) if self.needs_dictionary else ()

    @classmethod
    def options(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}

    @classmethod
    def from_options(cls, opts: dict[str, str]) -> "Method":
        """Build from `--opt key=value` strings, converting each to its field's type; UserError on anything wrong."""
        fields = cls.options()
        kwargs = {}
        hints = typing.get_type_hints(cls)
        for key, raw in opts.items():
            if key not in fields:
                allowed = ", ".join(f"{k} (default {f.default})" for k, f in fields.items()) or "none"
                raise UserError(f"method '{cls.name}' has no option '{key}'; its options: {allowed}")
            kwargs[key] = convert_option(raw, hints[key], f"{cls.name}.{key}")
        try:
            return cls(**kwargs)
        except ValueError as exc:
            raise UserError(f"method '{cls.name}': {exc}") from None

    def describe(self) -> dict:
        return {"method": self.name, "options": dataclasses.asdict(self)}
