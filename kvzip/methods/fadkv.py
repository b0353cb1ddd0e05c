"""`fadkv` and `lexico`: dictionary-coded KV caches with attention computed on the codes.

FAD-KV (Zhu et al., 2026) and its predecessor Lexico (Kim et al., ICML 2025; arXiv:2412.08890). Per layer and KV head:
- the first `sinks` tokens and the most recent `buffer` tokens stay dense (sinks draw outsized attention, so a
  coding error there costs the most; the buffer absorbs tokens between coding events, one after a prompt and one
  every `code_chunk` decode steps, where every row codes all beyond its sinks and buffer);
- older tokens are coded as `sparsity` atom indices (int16, or packed in 10 bits: `index_bits`) and coefficients
  (fp16, or 8 or 4 bits with a scale: `coef_format`) over the layer's key or value dictionary. The per-head key
  mean (stored in the dictionary file) is removed before coding. Keys are coded as the dictionary was trained:
  before RoPE (the default file; RoPE undone at coding time) or after it;
- decoding never keeps a dense copy of the past. Post-RoPE scores gather q·D by code and add one q·mean term;
  pre-RoPE scores rebuild one chunk of keys at a time (mean added back, RoPE applied, chunk dropped). Values are
  summed per atom and multiplied by the value dictionary once (kvzip/sparse/coded_attention.py).
FAD-KV's coder is screening (top-n candidates by |Dᵀx|, pursuit on the pool); Lexico's is OMP over all atoms.
With `zoom` (off by default) every token's exact K/V also goes off the device, and each decode step a layer reads back
the chunks its coded attention weighs most (ZoomR's retrieval over the codes: kvzip/methods/coded/zoom.py).

Fixed-size adaptation (FAD-KV): per sequence, a reference count per atom over live codes. When a coded vector's
relative residual exceeds `adapt_threshold`, its normalised residual becomes a new atom in place of an inactive one
(count zero, least recently used) and the vector is re-coded. The shared dictionary is never written: a sequence's replaced atoms
live in its own overlay (atom number -> vector), so batched rows cannot corrupt each other, and the dictionary size a
sequence sees stays N. `adapt=append` grows the overlay past N instead (the ablation the paper argues against);
`adapt=none` keeps the dictionary static. Each kind's state (codes, overlay, atom counts) is one
`kvzip.methods.coded.state.CodedKind`; coding and adaptation are kvzip/methods/coded/coding.py. The layer is
kvzip/methods/coded/layer.py, its attention coded/attend.py, and what each forward hands it (`CodedState`, built by
the cache's `before_forward`) coded/forward.py. Options and the measurements behind their defaults: docs/fadkv.md.

Models with more than one kind of layer: pre-RoPE keys are turned by each layer's own RoPE (kvzip.rope: Gemma 3's
local and global bases, Phi-3's partial rotary, where only the first channels turn), and a sliding-window layer drops
every token, coded or dense, that its next query can no longer see (the atoms those codes used are counted off).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import torch

from kvzip.errors import UserError
from kvzip.methods.base import KVCache, Method, check_choice, check_positive, model_layout, tensor_bytes
from kvzip.methods.fields import KERNELS
from kvzip.methods.coded.coding import ADAPT, CodingStats
from kvzip.methods.coded.compress import compress
from kvzip.methods.coded.forward import CodedState
from kvzip.methods.coded.layer import FadkvLayer
from kvzip.placement import layer_devices
from kvzip.rope import attention_windows, layer_ropes
from kvzip.sparse import CACHE_CODERS, KEY_MODES, KEY_OPTIONS, coded_attention as coded
from kvzip.sparse.dictionary import prepare_for_devices
from kvzip.sparse.screen import PICKS, SHOTS


class FadkvCache(KVCache):
    """The layers of one cache are coded together: after a prompt and after every `code_chunk`-th decode step, every
    layer's due tokens are coded in one pass (kvzip/methods/coded/compress.py); after every forward, sliding-window
    layers drop what their next query cannot see. Before every forward it builds what each layer is handed
    (`CodedState`: the fused kernel's choice, the mask's first visible positions, RoPE's tables), once for all."""

    def __init__(self, layers: list[FadkvLayer], method: "Fadkv", shared_bytes: int, devices: list | None = None):
        super().__init__(layers, method)
        self.shared_bytes = shared_bytes  # the shared dictionary: reported apart, not counted as cache, like weights
        self.coding, self.devices = CodingStats(), devices or [None] * len(layers)
        self.decoded = 0  # decode steps since the last prompt
        self.rope_tables: dict = {}  # (RoPE id, device) -> RoPE's cos and sin for the kernel, kept across forwards

    def reset(self) -> None:
        super().reset()
        self.coding, self.decoded = CodingStats(), 0

    def before_forward(self, attention_mask: torch.Tensor, new_tokens: int) -> None:
        self.decoded = 0 if new_tokens > 1 else self.decoded + 1
        self.state = CodedState.build(self.layers, attention_mask, new_tokens, self.rope_tables)

    def after_forward(self) -> None:
        if self.decoded % self.method.code_chunk == 0:  # after a prompt, and every code_chunk-th decode step
            for device in dict.fromkeys(self.devices):  # a model over devices: each one's layers (and atoms) apart
                compress([x for x, d in zip(self.layers, self.devices) if d == device], self.coding)
        for layer in self.layers:
            if layer.sliding is not None:
                layer._slide()

    def stats(self) -> dict:
        layers = [lay for lay in self.layers if lay.is_initialized]
        if not layers:
            return {}
        totals = self.coding
        coded_tokens = layers[0].coded_pos.shape[1]
        active = sum(int((kind.refcount > 0).sum()) for lay in layers for kind in lay.kinds)
        return {
            "tokens_coded": coded_tokens,
            "mean_residual": round(totals.residual_sum / max(totals.vectors, 1), 4),
            "atoms_replaced": totals.replaced,
            "atoms_active": round(active / (2 * len(layers) * layers[0].batch), 1),
            "dictionary_atoms": max(kind.n_total() for lay in layers for kind in lay.kinds),  # as a row sees it
            "coding_ms_per_token": round(1000 * totals.seconds / max(coded_tokens * layers[0].batch, 1), 3),
            "dictionary_shared_bytes": self.shared_bytes,
        }


@dataclass
class Fadkv(Method):
    """FAD-KV (Zhu et al., 2026): screening coder, fixed-size adaptive dictionary, attention on the codes."""

    name = "fadkv"
    summary = "FAD-KV: dictionary-coded K/V (screening coder, fixed-size adaptive dictionary), attention on codes"
    needs_dictionary = True
    test_options = {"sparsity": "4", "screen_pool": "8", "buffer": "8", "code_chunk": "4", "sinks": "2",
                    "adapt_threshold": "0.3"}
    lossless_options = {"buffer": "100000"}
    sparsity: int = 14  # with int4 coefficients and ten-bit numbers, the bytes 8 atoms took in int8 and int16
    value_sparsity: int = 0  # atoms per value vector; 0: the same as `sparsity` (keys)
    coef_format: str = "int4"  # four bits cost the key tokens nothing at 14 atoms (0.813 against int8's 0.800)
    index_bits: int = 0  # 0: packed in ten bits where the numbers fit (1,024 atoms, no adapt=append), else 16
    coder: str = "screen"
    screen_pool: int = 16
    screen_shots: int = 2
    screen_pick: str = "champions"
    adapt: str = "fixed"
    adapt_threshold: float = 0.5
    max_new_atoms: int = 4
    buffer: int = 128
    zoom: int = 0  # > 0: exact detail off the device, this many chunks of it read a step (kvzip/methods/coded/zoom.py)
    zoom_chunk: int = 32
    code_chunk: int = 32
    sinks: int = 4
    keys: str = "auto"  # auto: as the dictionary was trained; the default file is the pre-RoPE one when shipped
    kernel: str = "auto"  # auto: the fused CPU kernels where they are built (kvzip/kernels); torch: never
    preferred_keys: typing.ClassVar[str] = "pre-rope"

    def __post_init__(self):
        check_choice("coef_format", self.coef_format, coded.COEF_FORMATS)
        check_choice("keys", self.keys, KEY_OPTIONS)
        check_choice("coder", self.coder, CACHE_CODERS)
        check_choice("adapt", self.adapt, ADAPT)
        check_choice("screen_shots", self.screen_shots, SHOTS)
        check_choice("screen_pick", self.screen_pick, PICKS)
        check_choice("kernel", self.kernel, KERNELS)
        check_choice("index_bits", self.index_bits, (0, 16, 10))
        if self.index_bits == 10 and self.adapt == "append":
            raise ValueError("index_bits=10 holds the numbers of 1,024 atoms: adapt=append grows past them")
        if self.value_sparsity < 0:
            raise ValueError(f"value_sparsity must be >= 0 (0: the same as sparsity), got {self.value_sparsity}")
        check_positive(sparsity=self.sparsity, screen_pool=self.screen_pool, code_chunk=self.code_chunk,
                       max_new_atoms=self.max_new_atoms, adapt_threshold=self.adapt_threshold)
        if self.coef_format == "int4" and (self.sparsity % 2 or self.value_sparsity % 2):
            raise ValueError("coef_format=int4 packs two coefficients a byte: sparsity and value_sparsity must be even")
        if self.buffer < 0 or self.sinks < 0 or self.zoom < 0:
            raise ValueError(f"buffer, sinks and zoom must be >= 0, got {self.buffer}, {self.sinks}, {self.zoom}")
        check_positive(zoom_chunk=self.zoom_chunk)

    def plan_budget(self, budget, fixed):
        """Sparsity and buffer (why in docs/fadkv.md): the most atoms, from the default down, that leave a buffer of
        at least 16 tokens; the buffer takes whatever F leaves, past its default when F is large. With `zoom` the
        zoomed tokens come off F first."""
        from kvzip.budget import Plan

        t, shape = budget.tokens, budget.shape
        dense = (2 if shape.element_size == 4 else shape.element_size) / shape.element_size  # fp16 dense tier in fp32
        # A row's adapted atoms (the `dictionary` tier) are not planned: how many it holds depends on the text and the
        # sparsity (at 0.125 of a 2,048-token output, 0.008 of full's bytes at sparsity 6, 0.013 at 4; 0.2% at 8 over
        # results-2's 8k output); the bench measures them and marks a cell they push past the tolerance.

        def code(s: int) -> float:  # bytes of one coded vector against full's
            coef = {"fp16": 2, "int4": 0.5}.get(self.coef_format, 1)
            numbers = coded.packed_width(s) if self.packed_numbers() else 2 * s
            return (s * coef + numbers + (0 if self.coef_format == "fp16" else 2)) / shape.vector_bytes

        # with `zoom`: one step's zoomed tokens on the device, and every token's exact detail off it (in the model's
        # dtype, as `full` holds them), which only an all-tier budget counts
        zoomed = min(self.zoom * self.zoom_chunk, t) / t + (1.0 if self.zoom and budget.tier == "all" else 0.0)

        def expected(s: int, vs: int, buffer: int) -> float:
            held = min(self.sinks + buffer + self.code_chunk - 1, t)
            return (held * dense + (t - held) * (code(s) + code(vs)) / 2) / t + zoomed

        sparsities = [self.sparsity] if "sparsity" in fixed else list(range(self.sparsity, 1, -1))
        if self.coef_format == "int4":  # two coefficients a byte: even sparsities only
            sparsities = [x for x in sparsities if x % 2 == 0] or sparsities
        for s in sparsities:
            vs = self.value_sparsity if "value_sparsity" in fixed and self.value_sparsity else s
            if "buffer" in fixed:
                if expected(s, vs, self.buffer) <= budget.fraction:
                    return Plan({"sparsity": s}, expected(s, vs, self.buffer))
                continue
            per_token = dense - (code(s) + code(vs)) / 2  # what one more buffered token adds
            buffer = int(min((budget.fraction - expected(s, vs, 0)) * t / per_token, t))
            if buffer >= 16:
                return Plan({"sparsity": s, "buffer": buffer}, expected(s, vs, buffer))
        s, buffer = sparsities[-1], self.buffer if "buffer" in fixed else 16
        floor = expected(s, s, buffer)
        smallest = {k: v for k, v in (("sparsity", s), ("buffer", buffer)) if k not in fixed}
        why = ", every token's exact detail off the device: count the device tier" if self.zoom else ""
        return Plan(smallest, floor, f"holds at least {floor:.3f} of full's bytes (sparsity {s}, a {buffer}-token "
                                     f"buffer{why})")

    def dictionary_keys(self) -> tuple[str, ...]:
        """`keys` when set; with keys=auto the method's preferred mode first, then the other."""
        if self.keys != "auto":
            return (self.keys,)
        return (self.preferred_keys, *(m for m in KEY_MODES if m != self.preferred_keys))

    def make_cache(self, model, dictionaries=None) -> KVCache:
        if dictionaries is None:
            raise UserError(f"method '{self.name}' needs a dictionary trained for this model, and none was given")
        trained = dictionaries.meta.get("keys", "post-rope")
        if self.keys != "auto" and trained != self.keys:
            raise UserError(f"method '{self.name}' with keys={self.keys} needs a dictionary of {self.keys} keys; this one "
                            f"was trained on {trained} keys: use a dictionary trained on {self.keys} keys")
        ropes = layer_ropes(model, f"{self.name} with a pre-RoPE dictionary") if trained == "pre-rope" else None
        windows = attention_windows(model, self.name)
        layers, kv_heads, head_dim = model_layout(model)
        if max(self.sparsity, self.value_sparsity) > dictionaries.num_atoms:
            raise UserError(f"sparsity {max(self.sparsity, self.value_sparsity)} exceeds the dictionary's "
                            f"{dictionaries.num_atoms} atoms")
        if self.index_bits == 10 and dictionaries.num_atoms > coded.PACKED_ATOMS:
            raise UserError(f"index_bits=10 holds the numbers of {coded.PACKED_ATOMS} atoms; this dictionary has "
                            f"{dictionaries.num_atoms}: use index_bits=16")
        devices = layer_devices(model)  # a model split over devices: each layer's atoms, RoPE tables, coding there
        prepared = prepare_for_devices(dictionaries, devices, paired=[r.dim for r in ropes] if ropes else False)
        shared = sum(tensor_bytes(a) for a in (dictionaries.keys, dictionaries.values))
        return FadkvCache([FadkvLayer(self, prepared[i], rope=ropes[i] if ropes else None, sliding=windows[i], idx=i)
                           for i in range(layers)], self, shared, devices)

    def packed_numbers(self, atoms: int = coded.PACKED_ATOMS) -> bool:
        """Whether atom numbers are packed in ten bits for a dictionary of `atoms` (the shipped ones hold 1,024)."""
        if self.index_bits:
            return self.index_bits == 10
        return self.adapt != "append" and atoms <= coded.PACKED_ATOMS


@dataclass
class Lexico(Fadkv):
    """Lexico (Kim et al., ICML 2025): OMP over the whole dictionary, static dictionary."""

    name = "lexico"
    summary = "Lexico: dictionary-coded K/V with OMP and a static dictionary (the FAD-KV baseline)"
    test_options = {"sparsity": "4", "buffer": "8", "code_chunk": "4", "sinks": "2"}
    coder: str = "omp"
    adapt: str = "none"
    sparsity: int = 8  # Lexico's own format: int16 numbers, 8-bit coefficients
    coef_format: str = "int8"
    index_bits: int = 16
    preferred_keys: typing.ClassVar[str] = "post-rope"  # as Lexico codes them (q·D shared by every token)

