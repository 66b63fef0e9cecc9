"""Resolve a MODEL argument and load it; describe its attention layers.

MODEL is a built-in alias (`smollm2-135m`), a local Hugging Face directory, or a GGUF
file. A GGUF is converted once into a safetensors HF directory under the cache
directory, so later loads take seconds (GGUF tokenizer conversion is the slow part).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .assets import GEMMA3_GGUF, QWEN25_CODER_GGUF, SMOLLM2_GGUF, PartedAsset, asset_path, assembled_path, cache_dir, cache_lock
from .calibration.artifact import ModelIdentity
from .errors import AssetError, OscarError, TokenizerError, UnsupportedModelError
from .random_models import CONFIGS as RANDOM_CONFIGS
from .random_models import PREFIX as RANDOM_PREFIX
from .random_models import random_config, random_model

ALIASES = {"smollm2-135m": SMOLLM2_GGUF, "gemma3-270m": GEMMA3_GGUF, "qwen2.5-coder-1.5b": QWEN25_CODER_GGUF}
DEFAULT_MODEL = "smollm2-135m"
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


@dataclass(frozen=True)
class AttentionShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_positions: int
    layer_types: tuple[str, ...]  # "full_attention" / "sliding_attention" per layer
    sliding_window: int | None


def text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config(decoder=True)


def attention_shape(model_or_config) -> AttentionShape:
    config = text_config(model_or_config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = config.num_hidden_layers
    types = tuple(getattr(config, "layer_types", None) or ["full_attention"] * layers)
    return AttentionShape(
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        max_positions=getattr(config, "max_position_embeddings", 0) or 0,
        layer_types=types,
        sliding_window=getattr(config, "sliding_window", None),
    )


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules, in layer order (each has q/k/v/o projections and layer_idx)."""
    found = {}
    for module in model.modules():
        if all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "layer_idx")):
            found[module.layer_idx] = module
    shape = attention_shape(model)
    if sorted(found) != list(range(shape.num_layers)):
        raise UnsupportedModelError(
            f"found attention modules for layers {sorted(found)} but the config has {shape.num_layers} layers; "
            f"oscarkv supports {', '.join(SUPPORTED_TYPES)}-style attention (q/k/v/o projections)."
        )
    return [found[i] for i in range(shape.num_layers)]


def required_bos(model: nn.Module, tokenizer) -> int | None:
    """The token every sequence must start with, when the family needs one the tokenizer does not add.

    Gemma models are trained with <bos> first and produce garbage without it (perplexity
    ~10^4 on prose); GGUF tokenizers do not add it. Other families here need none.
    """
    if text_config(model).model_type.startswith("gemma") and tokenizer.bos_token_id is not None:
        return int(tokenizer.bos_token_id)
    return None


def check_supported(model: nn.Module) -> None:
    config = text_config(model)
    if config.model_type not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"model type {config.model_type!r} is not supported; oscarkv supports {', '.join(SUPPORTED_TYPES)}."
        )
    for module in attention_modules(model):
        if getattr(module, "v_norm", None) is not None:
            raise UnsupportedModelError(
                "this model normalises values (v_norm); R_V cannot be absorbed into v_proj for it."
            )


def model_identity(model: nn.Module) -> ModelIdentity:
    """Shapes plus a fingerprint of the k_proj weights of the first and last layer (unchanged by patching)."""
    identity = shape_identity(model)
    modules = attention_modules(model)
    signature = k_proj_signature([modules[i].k_proj.weight for i in (0, identity.num_layers - 1)])
    return dataclasses.replace(identity, weight_signature=signature)


def check_artifact_shapes(artifact, config) -> None:
    """Refuse an artifact (None passes) made for another architecture than a model's transformers `config`, before
    the model's weights load; the weights' fingerprint is checked once they have (`model_identity`)."""
    if artifact is not None:
        artifact.check_model(shape_identity(config), shapes_only=True)


def shape_identity(model_or_config) -> ModelIdentity:
    """The shapes of a model or of its config, without a weight fingerprint
    (`RotationArtifact.check_model(..., shapes_only=True)`)."""
    shape = attention_shape(model_or_config)
    return ModelIdentity(
        model_type=text_config(model_or_config).model_type,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        hidden_size=shape.hidden_size,
    )


def k_proj_signature(weights: list[torch.Tensor]) -> tuple[float, ...]:
    """The fingerprint of `ModelIdentity`: the first 8 rows of each k_proj weight (of the first
    and the last layer) projected on a fixed ±1 vector. Serving engines that fuse q/k/v pass the
    k rows of their fused weight."""
    signature = []
    for weight in weights:
        weight = weight.detach().double().cpu()
        probe = torch.randint(0, 2, (weight.shape[1],), generator=torch.Generator().manual_seed(1234)).double() * 2 - 1
        signature += [round(float(x), 6) for x in (weight[:8] @ probe)]
    return tuple(signature)


# --- tokenizer sanity -----------------------------------------------------------------------

# Common words that every English-capable vocabulary of 30K+ entries holds as one token.
PROBE_SENTENCE = (
    "The people of the world said that the government would work with the city because of the new water system."
)
WORD_PREFIXES = ("\u2581", "\u0120")  # SentencePiece "▁word", byte-level BPE "Ġword"


def split_vocabulary_words(tokenizer) -> tuple[list[str], list[str]]:
    """(probe words the vocabulary holds whole, those of them the tokenizer still splits)."""
    vocab = tokenizer.get_vocab()
    tokens = set(tokenizer.convert_ids_to_tokens(tokenizer(PROBE_SENTENCE, add_special_tokens=False)["input_ids"]))
    whole, split = [], []
    for word in dict.fromkeys(PROBE_SENTENCE.rstrip(".").split()[1:]):
        forms = [prefix + word for prefix in WORD_PREFIXES if prefix + word in vocab]
        if forms:
            whole.append(word)
            if not tokens.intersection(forms):
                split.append(word)
    return whole, split


def check_tokenizer(tokenizer, source: str) -> None:
    """Refuse a tokenizer that splits common words its own vocabulary holds whole.

    Some transformers versions (5.17 among them) rebuild a SentencePiece GGUF tokenizer
    (Gemma 3) without its merge rules: every word then comes out in fragments, the model
    sees text it was never trained on, and perplexity is ~30x too high with no error.
    """
    import transformers

    whole, split = split_vocabulary_words(tokenizer)
    if len(whole) >= 4 and len(split) * 2 > len(whole):
        example = tokenizer.tokenize(" " + split[0])
        raise TokenizerError(
            f"the tokenizer of {source} splits common words that its own vocabulary holds whole "
            f"({len(split)} of {len(whole)} probe words, e.g. {split[0]!r} -> {example}); the model would "
            f"read text it was never trained on. This is a known bug of the GGUF tokenizer conversion in "
            f"transformers {transformers.__version__} (5.17 is affected, 5.23 is not): upgrade transformers "
            f"(pip install -U 'transformers>=5.23') and delete the converted copy under {cache_dir() / 'models'}."
        )


# --- loading -------------------------------------------------------------------------------


# Bumped when what a conversion writes changes, so that directories converted before are not reused
# (2: the GGUF's EOS and pad tokens, `set_gguf_special_tokens`).
CONVERSION = 2


def _converted_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERSION}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def set_gguf_special_tokens(tokenizer, gguf: Path) -> None:
    """Give the tokenizer the end-of-sequence token that the GGUF file declares (`tokenizer.ggml.eos_token_id`), and
    its pad token (`tokenizer.ggml.padding_token_id`) where it has none. transformers 5.17 converts SmolLM2's GGUF
    with <|im_start|> as its EOS and no pad token, so such a tokenizer cannot pad a batch (`tokenizer(texts,
    padding=True)` raises) and ends completions at the wrong token; later releases read both keys. With this the same
    GGUF gives the same tokenizer on every supported transformers."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields

    def declared(key: str) -> str | None:
        field = fields.get(key)
        if field is None or not field.data:
            return None
        token_id = int(field.parts[field.data[0]][0])
        return tokenizer.convert_ids_to_tokens(token_id) if 0 <= token_id < len(tokenizer) else None

    eos, pad = declared("tokenizer.ggml.eos_token_id"), declared("tokenizer.ggml.padding_token_id")
    if eos is not None and tokenizer.eos_token != eos:
        tokenizer.eos_token = eos
    if pad is not None and tokenizer.pad_token_id is None:
        tokenizer.pad_token = pad


def _convert_gguf(gguf: Path) -> Path:
    """GGUF -> safetensors HF directory (once; dequantized weights, tokenizer, config)."""
    target = _converted_dir(gguf)
    with cache_lock(f"model-{target.name}"):  # another process may be converting it now
        if not (target / "config.json").is_file():
            _write_converted(gguf, target)
    return target


def _write_converted(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"oscarkv: converting {gguf.name} to a safetensors model directory (once) ...")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    check_tokenizer(tokenizer, gguf.name)
    set_gguf_special_tokens(tokenizer, gguf)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=False)
    tmp = target.with_name(target.name + ".part")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    config_path = tmp / "config.json"
    data = json.loads(config_path.read_text())
    data.pop("quantization_config", None)  # vLLM and later loads reject a gguf entry here
    config_path.write_text(json.dumps(data, indent=2))
    tmp.rename(target)


def _not_a_model(name: str) -> AssetError:
    return AssetError(
        f"model {name!r} is not a built-in alias ({', '.join(ALIASES)}), a local Hugging Face directory "
        f"(with config.json), a .gguf file or a random-weight architecture "
        f"({', '.join(RANDOM_PREFIX + key for key in RANDOM_CONFIGS)}). Pass one of those; models are never downloaded "
        "from a hub."
    )


def _local_source(name: str) -> str | None:
    """What a MODEL argument names on this machine: "alias", "gguf" (a .gguf file), "directory" (with
    config.json), or None. Looks only; loads and converts nothing."""
    path = Path(name).expanduser()
    if name in ALIASES:
        return "alias"
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir() and (path / "config.json").is_file():
        return "directory"
    return None


def check_model_name(name: str) -> None:
    """Refuse a MODEL argument that names nothing `load_model` can load, without loading or converting anything
    (commands check it before their other arguments' errors)."""
    if not name.startswith(RANDOM_PREFIX) and _local_source(name) is None:
        raise _not_a_model(name)


def resolve_model(name: str) -> Path:
    """MODEL argument -> a local HF directory."""
    source = _local_source(name)
    if source == "alias":
        asset = ALIASES[name]
        return _convert_gguf(assembled_path(asset) if isinstance(asset, PartedAsset) else asset_path(asset))
    if source == "gguf":
        return _convert_gguf(Path(name).expanduser())
    if source == "directory":
        return Path(name).expanduser()
    raise _not_a_model(name)


def model_config(name: str):
    """The transformers config of MODEL, read without its weights, so that arguments that depend on the
    model's shapes (a group size, a context length) are checked before minutes of loading."""
    from transformers import AutoConfig

    if name.startswith(RANDOM_PREFIX):
        return random_config(name)
    return AutoConfig.from_pretrained(str(resolve_model(name)))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A device argument (None: `default_device`) as a torch.device, refused in one line where this machine
    cannot run it: a name torch does not know, CUDA without a visible GPU, or a GPU index past the last."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise OscarError(f"device {str(device)!r} is not a device name; use cpu, cuda or cuda:N.") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise OscarError(f"device {str(device)!r}: no CUDA GPU is visible on this machine; use cpu "
                             "(--device cpu), or run on a machine with a GPU.")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise OscarError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} visible CUDA "
                             f"GPU(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}.")
    return resolved


def load_model(name: str, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
    """Load (model, tokenizer) for MODEL; float32 on CPU, bfloat16 on CUDA unless `dtype` says otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    device = resolve_device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if name.startswith(RANDOM_PREFIX):
        model, tokenizer = random_model(name, device, dtype)
        model.oscar_source = name
        return model, tokenizer
    directory = resolve_model(name)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).to(device).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    check_supported(model)
    check_tokenizer(tokenizer, name)
    model.oscar_source = name
    return model, tokenizer
