"""Per-layer choice of transform, clip ratio and bits by the error of the attention output.

For one layer and held-apart calibration tokens (q, k, v after RoPE / q-k-norm), a
candidate is scored by the relative error of the attention output when the keys (or the
values) go through the cache exactly as at run time: centered, rotated, clipped,
quantized, read back. The mixed layout is respected: a key reaches the history only once
it is older than the recent window and outside the sink, so only those pairs carry error.
Keys and values are scored separately (their errors add to first order).

The bit budget then moves single streams (the keys or the values of one layer) to INT4, those
that remove the most predicted error per bit first. Besides the held-apart text, the error
counts a retrieval probe (`retrieval_probe`): the same tokens twice in a row, so that the
second copy is predicted by attending to the first, far back in the history. Ordinary text
barely uses the history in the later layers of small models; the probe does, and shows which
streams a needle-in-a-haystack lookup depends on (docs/accuracy.md).
"""

from __future__ import annotations

import torch

from ..quant.format import dequantize, quantize
from .artifact import stream_bits

# Clip ratios tried per layer. The finer grids won on Qwen2.5-Coder-1.5B (docs/results.md);
# the demo passes the two-point grids (no clip, or the paper's ratio) to stay fast on a CPU.
CLIP_GRID_K = (0.0, 0.9, 0.93, 0.96, 0.98)
CLIP_GRID_V = (0.0, 0.88, 0.92, 0.95, 0.98)
# Lloyd–Max inner levels tried per layer and INT2 stream (`--levels lloyd`), with every clip ratio of
# the grid: moving the inner levels outwards and clipping both trade the tails against the middle.
LLOYD_INNER_GRID = (0.35, 0.37, 0.39, 0.41)
SCORED_QUERIES = 256
DEFAULT_EXTRA_BITS = 0.25  # default budget: pure INT2 + this many bits per element


def roundtrip(x: torch.Tensor, mean: torch.Tensor | None, rotation: torch.Tensor, bits: int, group_size: int,
              clip: float, inner: float | None = None) -> torch.Tensor:
    """x [Hkv, T, d] as read back from the cache: ((x - μ)·R) quantized, then ·Rᵀ + μ.

    rotation: [d, d] for the layer, or [Hkv, d, d], one per KV head. inner: Lloyd–Max inner level."""
    rotation = rotation.to(device=x.device, dtype=x.dtype)
    mean = mean.to(device=x.device, dtype=x.dtype) if mean is not None else None
    centered = x - mean[:, None, :] if mean is not None else x
    rotated = centered @ rotation
    restored = dequantize(quantize(rotated, bits, group_size, clip, inner=inner), x.dtype) @ rotation.transpose(-1, -2)
    return restored + mean[:, None, :] if mean is not None else restored


def history_mask(tokens: int, sink: int, recent: int, device) -> torch.Tensor:
    """[T, T] bool: query t reads key j from the history (j >= sink and j <= t - recent)."""
    t = torch.arange(tokens, device=device)[:, None]
    j = torch.arange(tokens, device=device)[None, :]
    return (j >= sink) & (j <= t - recent)


def attention_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hist: torch.Tensor, v_hist: torch.Tensor,
                      lo: torch.Tensor, visible: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Attention [Hq, R, d] of the query positions `rows`, reading history pairs from k_hist/v_hist.

    q: [Hq, T, d]; k, v, k_hist, v_hist: [Hkv, T, d]; lo, visible: [T, T] masks; rows: [R] long.
    """
    hq, t, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    r = rows.numel()
    qg = q[:, rows].reshape(hkv, g * r, d)
    lo_q = lo[rows]
    scores_hi = (qg @ k.transpose(1, 2)).reshape(hkv, g, r, t)
    scores_lo = (qg @ k_hist.transpose(1, 2)).reshape(hkv, g, r, t)
    scores = torch.where(lo_q, scores_lo, scores_hi) * d**-0.5
    probs = torch.softmax(scores.masked_fill(~visible[rows], float("-inf")), dim=-1)
    out = (probs * ~lo_q) @ v[:, None] + (probs * lo_q) @ v_hist[:, None]
    return out.reshape(hq, r, d)


class LayerScorer:
    """Scores K and V candidates of one layer on held-apart q, k, v."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: int, recent: int,
                 group_size: int, sliding_window: int | None = None) -> None:
        # q: [Hq, T, d], k, v: [Hkv, T, d]; float32 is ample for relative errors of 1e-5 and up
        self.q, self.k, self.v = q.float(), k.float(), v.float()
        self.group_size = group_size
        tokens = q.shape[1]
        # Queries that read some history, at most SCORED_QUERIES of them spread evenly: the
        # estimate needs no more, and this keeps CPU calibration fast.
        first_query = min(tokens - 1, sink + recent)
        count = min(SCORED_QUERIES, tokens - first_query)
        self.rows = torch.linspace(first_query, tokens - 1, count, device=q.device).round().long()
        self.lo = history_mask(tokens, sink, recent, q.device)
        self.visible = torch.ones(tokens, tokens, dtype=torch.bool, device=q.device).tril()
        if sliding_window:
            self.visible = self.visible.triu(-(sliding_window - 1))
        self.exact = self._attend(self.k, self.v)
        self.norm = self.exact.double().pow(2).sum().clamp(min=1e-30)

    def _attend(self, k_hist: torch.Tensor, v_hist: torch.Tensor) -> torch.Tensor:
        return attention_outputs(self.q, self.k, self.v, k_hist, v_hist, self.lo, self.visible, self.rows)

    def _error(self, k_hist: torch.Tensor, v_hist: torch.Tensor) -> float:
        out = self._attend(k_hist, v_hist)
        return float((out - self.exact).double().pow(2).sum() / self.norm)

    def _head_errors(self, k_hist: torch.Tensor, v_hist: torch.Tensor) -> torch.Tensor:
        """[Hkv] float64: each KV head's share of `_error` (the squared error of the outputs of its
        query heads over the norm of all outputs); they add up to `_error`."""
        out = self._attend(k_hist, v_hist)
        per_query_head = (out - self.exact).double().pow(2).sum(dim=(1, 2))
        return per_query_head.reshape(self.k.shape[0], -1).sum(1) / self.norm

    def key_error(self, rotation: torch.Tensor, mean: torch.Tensor | None, clip: float, bits: int,
                  inner: float | None = None) -> float:
        return self._error(roundtrip(self.k, mean, rotation, bits, self.group_size, clip, inner), self.v)

    def key_head_errors(self, rotation: torch.Tensor, mean: torch.Tensor | None, clip: float,
                        bits: int) -> torch.Tensor:
        """[Hkv]: the key error of each KV head. A key of KV head h reaches only the query heads of
        its group, so the heads' errors are independent and a per-head choice adds them up."""
        return self._head_errors(roundtrip(self.k, mean, rotation, bits, self.group_size, clip), self.v)

    def value_error(self, rotation: torch.Tensor, mean: torch.Tensor | None, clip: float, bits: int,
                    inner: float | None = None) -> float:
        return self._error(self.k, roundtrip(self.v, mean, rotation, bits, self.group_size, clip, inner))


# One-letter names of the key transforms in a per-head pick (the calibration report prints them).
HEAD_TRANSFORM_LETTERS = {"identity": "I", "hadamard": "H", "oscar": "O", "oscar-head": "o"}


def key_transform_name(choice: dict) -> str:
    """The key transform of a layer's choice, a per-head pick spelled out: "per-head(o/H/o)"."""
    heads = choice.get("k_head_transforms")
    if choice["k_transform"] != "per-head" or not heads:
        return choice["k_transform"]
    return f"per-head({'/'.join(HEAD_TRANSFORM_LETTERS[name] for name in heads)})"


def _per_head_picks(head_scored: dict, names: list[str]) -> dict:
    """For each (centered, clip) of the key candidates, every KV head's best transform.

    head_scored: (centered, name, clip) -> [Hkv] errors. Returns (centered, clip) -> (per-head
    names, total error): the heads' errors are independent, so the pick's error is their sum."""
    picks = {}
    for centered, clip in dict.fromkeys((c, cl) for c, _, cl in head_scored):
        errors = torch.stack([head_scored[(centered, name, clip)] for name in names])  # [names, Hkv]
        best, index = errors.min(dim=0)
        picks[(centered, clip)] = ([names[i] for i in index.tolist()], float(best.sum()))
    return picks


def choose_layer(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, quant, cache,
                 sliding_window: int | None = None, clip_grid_k: tuple[float, ...] = CLIP_GRID_K,
                 clip_grid_v: tuple[float, ...] = CLIP_GRID_V, head_k_rotation: torch.Tensor | None = None,
                 inner_grid: tuple[float, ...] = (), inner_fixed: float | None = None) -> dict:
    """Pick, for K and for V of one layer, centering, transform and clip; sets the layer's rotations and means.

    q: [Hq, T, d], k, v: [Hkv, T, d] of held-apart tokens. Candidates: centered or not ×
    identity / Hadamard / OSCAR (the uncentered OSCAR is the paper's) × the clip grid. Returns
    the layer's choice record: the picks, bits = 2, and the predicted errors at INT2 and INT4
    and of the paper method (uncentered OSCAR with the configured clip ratios).

    head_k_rotation: [Hkv, d, d], OSCAR rotations from each KV head's own C_Q (`--key-rotations
    head`). The keys then also try it ("oscar-head"), and each KV head may take its own
    transform ("per-head": k_rotation becomes [Hkv, d, d], `k_head_transforms` names them);
    centering and clip stay one per layer.

    inner_grid: Lloyd–Max inner levels (`quant.format`) to try with the chosen transform and every
    clip ratio; a stream takes them where they lower its INT2 error (`inner_{kind}`, else None).
    inner_fixed: instead, every INT2 stream takes this inner level, with the transform and clip
    chosen on the uniform grid.
    """
    from .rotations import hadamard

    d = k.shape[-1]
    scorer = LayerScorer(q, k, v, cache.sink_tokens, cache.recent_tokens, quant.group_size, sliding_window)
    eye, had = torch.eye(d, dtype=torch.float64), hadamard(d)
    streams = (
        ("k", clip_grid_k, layer.k_mean, scorer.key_error, layer.k_rotation, layer.paper_k_rotation,
         quant.clip_ratio_k),
        ("v", clip_grid_v, layer.v_mean, scorer.value_error, layer.v_rotation, layer.paper_v_rotation,
         quant.clip_ratio_v),
    )
    choice: dict = {"bits_k": 2, "bits_v": 2}
    for kind, grid, mean, error, centered_oscar, paper, paper_clip in streams:
        options = {}  # (centered, transform) -> rotation
        per_head = kind == "k" and head_k_rotation is not None
        for centered, oscar in ((True, centered_oscar), (False, paper)):
            options.update({(centered, "identity"): eye, (centered, "hadamard"): had,
                            (centered, "oscar"): oscar.double()})
            if per_head:
                options[(centered, "oscar-head")] = head_k_rotation.double()
        if per_head:
            head_scored = {(centered, name, clip): scorer.key_head_errors(rotation, mean if centered else None, clip, 2)
                           for (centered, name), rotation in options.items() for clip in grid}
            scored = {key: float(errors.sum()) for key, errors in head_scored.items()}
            names = list(dict.fromkeys(name for _, name in options))
            picks = _per_head_picks(head_scored, names)
            # A mix of transforms over the heads (listed after the uniform candidates, so that a
            # tie keeps the uniform one).
            scored.update({(centered, "per-head", clip): total for (centered, clip), (_, total) in picks.items()})
        else:
            scored = {(centered, name, clip): error(rotation, mean if centered else None, clip, 2)
                      for (centered, name), rotation in options.items() for clip in grid}
        (centered, name, clip), best = min(scored.items(), key=lambda item: item[1])
        if name == "per-head":
            head_names = picks[(centered, clip)][0]
            rotation = torch.stack([options[(centered, n)][h] if n == "oscar-head" else options[(centered, n)]
                                    for h, n in enumerate(head_names)])
            choice["k_head_transforms"] = head_names
        else:
            rotation = options[(centered, name)]
        inner, uniform_error = None, best
        if inner_fixed is not None:
            inner, best = inner_fixed, error(rotation, mean if centered else None, clip, 2, inner_fixed)
        elif inner_grid:
            lloyd = {(c, a): error(rotation, mean if centered else None, c, 2, a) for c in grid for a in inner_grid}
            (lloyd_clip, lloyd_inner), lloyd_error = min(lloyd.items(), key=lambda item: item[1])
            if lloyd_error < best:
                clip, inner, best = lloyd_clip, lloyd_inner, lloyd_error
        # The paper method is one of the candidates when its clip ratio is on the grid.
        paper_key = (False, "oscar", paper_clip)
        paper_error = scored[paper_key] if paper_key in scored else error(paper.double(), None, paper_clip, 2)
        # A stream moved to INT4 keeps the transform but takes its own clip: a clip that pays at
        # INT2 (where the grid is coarse) mostly costs accuracy at INT4.
        int4 = {c: error(rotation, mean if centered else None, c, 4) for c in grid}
        clip_int4 = min(int4, key=int4.get)
        choice.update({
            f"{kind}_centered": centered,
            f"{kind}_transform": name,
            f"clip_{kind}": clip,
            f"error_{kind}": best,
            f"inner_{kind}": inner,
            f"uniform_error_{kind}": uniform_error,
            f"clip_{kind}_int4": clip_int4,
            f"error_{kind}_int4": int4[clip_int4],
            f"paper_error_{kind}": paper_error,
            f"candidates_{kind}": {f"{'c' if c else 'u'}:{n}@{cl:g}": e for (c, n, cl), e in scored.items()},
        })
        setattr(layer, f"{kind}_rotation", rotation.float())
        if not centered:
            setattr(layer, f"{kind}_mean", None)
    return choice


def retrieval_probe(tokens: torch.Tensor, bos_id: int | None = None) -> torch.Tensor:
    """The retrieval probe of a held-apart chunk [T]: its first half twice (after the BOS token
    the model needs, if any), so that every token of the second copy can be read off the first."""
    body = tokens[1:] if bos_id is not None else tokens
    half = body[: body.numel() // 2]
    parts = ([tokens[:1]] if bos_id is not None else []) + [half, half]
    return torch.cat(parts)


def retrieval_errors(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, quant, cache,
                     sliding_window: int | None = None) -> dict:
    """Predicted errors of the layer's chosen keys and values at INT2 and INT4 on the retrieval
    probe (q, k, v of `retrieval_probe` tokens); the layer must have been through `choose_layer`."""
    scorer = LayerScorer(q, k, v, cache.sink_tokens, cache.recent_tokens, quant.group_size, sliding_window)
    choice = layer.choice
    errors = {}
    for kind, error, rotation, mean in (("k", scorer.key_error, layer.k_rotation, layer.k_mean),
                                        ("v", scorer.value_error, layer.v_rotation, layer.v_mean)):
        errors[f"retrieval_error_{kind}"] = error(rotation.double(), mean, choice[f"clip_{kind}"], 2,
                                                  choice.get(f"inner_{kind}"))
        errors[f"retrieval_error_{kind}_int4"] = error(rotation.double(), mean, choice[f"clip_{kind}_int4"], 4)
    return errors


def chosen_key_error(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, quant, cache,
                     sliding_window: int | None = None, mean: torch.Tensor | None = None) -> float:
    """Predicted INT2 key error of the layer's chosen centering, transform and clip on other tokens.

    q: [Hq, T, d], k, v: [Hkv, T, d]; the layer must have been through `choose_layer`. mean: the
    key mean to center by instead of the layer's (e.g. turned by RoPE to the tokens' positions)."""
    scorer = LayerScorer(q, k, v, cache.sink_tokens, cache.recent_tokens, quant.group_size, sliding_window)
    return scorer.key_error(layer.k_rotation.double(), layer.k_mean if mean is None else mean,
                            layer.choice["clip_k"], 2, layer.choice.get("inner_k"))


def held_tokens(shape, cache, context: int) -> tuple[list[int], list[int]]:
    """Per layer: (history tokens, BF16 window tokens) one sequence of `context` tokens holds."""
    history, windows = [], []
    for layer_type in shape.layer_types:
        held = context
        if layer_type == "sliding_attention" and shape.sliding_window:
            held = min(context, shape.sliding_window + cache.sink_tokens)
        window = min(held, cache.sink_tokens + cache.recent_tokens)
        history.append(held - window)
        windows.append(window)
    return history, windows


def apply_budget(artifact, shape, cache, max_bits: float | None, context: int) -> dict:
    """Move to INT4 the streams (keys or values of a layer) whose INT4 removes the most predicted
    error per bit, within the budget.

    max_bits: None = the default: pure INT2 + 0.25 bits per element, and in a hybrid model (sliding-
    window and full-attention layers) first INT4 keys on every full-attention layer (`reserved_keys`);
    0 = pure INT2. Counted in bytes over what each layer really holds at `context` tokens. The
    error of a stream is its error on the held-apart text plus, where calibration recorded one, on
    the retrieval probe. Records and returns the budget summary.
    """
    from ..config import QuantConfig
    from ..errors import CalibrationError
    from ..quant.accounting import layers_bits_per_element

    history, windows = held_tokens(shape, cache, context)
    quant = QuantConfig(group_size=artifact.group_size)
    layers = artifact.layers

    def cost(bits: dict) -> float:
        widths = [(bits[(i, "k")] + bits[(i, "v")]) / 2 for i in range(len(layers))]
        return layers_bits_per_element(history, windows, widths, cache, quant)

    int2 = {(i, kind): 2 for i in range(len(layers)) for kind in "kv"}
    pure = cost(int2)
    reserved = reserved_keys(shape) if max_bits is None else []
    fixed = {(i, "k") for i in reserved}
    bits = {**int2, **dict.fromkeys(fixed, 4)}
    if max_bits is None:
        budget = cost(bits) + DEFAULT_EXTRA_BITS
    elif max_bits == 0:
        budget = pure
    elif max_bits < pure - 1e-9:
        raise CalibrationError(
            f"--max-bits {max_bits} is below pure INT2, which takes {pure:.3f} bits per element at context "
            f"{context}; pass --max-bits 0 for pure INT2 or a value >= {pure:.3f}."
        )
    else:
        budget = max_bits
    if any("error_k" not in layer.choice for layer in layers):
        raise CalibrationError("this artifact has no per-layer errors to apply a bit budget to; re-run "
                               "`oscarkv calibrate` with the default method 'oscar'.")
    # Greedy by predicted error removed per bit spent (a sliding-window layer holds fewer tokens,
    # so it costs less): the streams whose INT4 buys the most go first.
    extra = {stream: cost({**int2, stream: 4}) - pure for stream in bits}
    gain = {(i, kind): stream_gain(layers[i].choice, kind) for (i, kind) in bits}
    free = [stream for stream in bits if stream not in fixed]  # in layer order: ties stay deterministic
    for stream in sorted(free, key=lambda st: -gain[st] / max(extra[st], 1e-12)):
        bits[stream] = 4
        if cost(bits) > budget + 1e-9:
            bits[stream] = 2
    for i, layer in enumerate(layers):
        layer.choice.pop("bits", None)  # an older artifact's one width for both streams
        for kind in "kv":
            layer.choice[f"bits_{kind}"] = bits[(i, kind)]
            layer.choice[f"int4_cost_bits_{kind}"] = extra[(i, kind)]
    summary = {
        "max_bits": budget,
        "context": context,
        "pure_int2_bits_per_element": pure,
        "bits_per_element": cost(bits),
        "int4_keys": [i for i in range(len(layers)) if bits[(i, "k")] == 4],
        "int4_values": [i for i in range(len(layers)) if bits[(i, "v")] == 4],
        "reserved_keys": reserved,
    }
    artifact.calibration["budget"] = summary
    return summary


def reserved_keys(shape) -> list[int]:
    """The layers whose keys the default budget puts in INT4 before any other stream: in a hybrid
    model, the full-attention layers. There the few full-attention layers do all the reading from
    far back, and they hold nearly all the bytes at long context, so their INT2 key error decides
    retrieval while a stream of theirs costs more than the +0.25 bits of the default budget. On
    Gemma3-270M, needle retrieval at 2K-32K rises from 0-33% (default budget without this rule)
    to 92-100%, within 5 points of BF16 (docs/accuracy.md). Models with one kind of layer: none."""
    kinds = set(shape.layer_types)
    if not {"sliding_attention", "full_attention"} <= kinds:
        return []
    return [i for i, kind in enumerate(shape.layer_types) if kind == "full_attention"]


def streams_to_fix(artifact, threshold: float) -> list[tuple[int, str]]:
    """(layer, "k" or "v") of the INT2 streams that keep a layer's predicted error on the held-apart
    text above `threshold` after the budget: in each such layer, every INT2 stream holding at least
    half of that error."""
    streams = []
    for i, layer in enumerate(artifact.layers):
        choice = layer.choice
        total = predicted_error(choice)
        if total > threshold:
            streams += [(i, kind) for kind in "kv"
                        if stream_bits(choice, kind) == 2 and stream_error(choice, kind) >= total / 2]
    return streams


def stream_gain(choice: dict, kind: str) -> float:
    """Predicted error that INT4 removes from stream `kind` ("k" or "v") of a layer: on the
    held-apart text, plus on the retrieval probe where it was measured."""
    gain = choice[f"error_{kind}"] - choice[f"error_{kind}_int4"]
    if f"retrieval_error_{kind}" in choice:
        gain += choice[f"retrieval_error_{kind}"] - choice[f"retrieval_error_{kind}_int4"]
    return gain


def stream_error(choice: dict, kind: str) -> float:
    """Predicted attention-output error of stream `kind` of a layer on the held-apart text, at its bits."""
    return choice[f"error_{kind}{'_int4' if stream_bits(choice, kind) == 4 else ''}"]


def predicted_error(choice: dict) -> float:
    """Predicted attention-output error of a layer on the held-apart text at the bits it was given."""
    return sum(stream_error(choice, kind) for kind in "kv")
