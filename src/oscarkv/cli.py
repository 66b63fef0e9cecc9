"""The `oscarkv` command line: demo, calibrate, eval (ppl, niah, code), bench (attention, decode, serve), serve,
model-dir, info."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .errors import OscarError

DEMO_TEXT_CALIBRATION = "wiki"
DEMO_TEXT_EVALUATION = "news"


def _add_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kernel", choices=("auto", "paged", "reference"), default="auto",
                        help="auto: the paged GPU kernels on CUDA where the method allows, else the torch reference "
                             "cache; reference: always the reference cache")
    parser.add_argument("--key-centering", choices=("auto", "rope", "fixed"), default="auto",
                        help="fixed: every key minus the calibrated key mean (SPEC §6); rope: history keys minus that "
                             "mean turned by RoPE to their block of positions, added back when read (exact); auto "
                             "(default): rope where the artifact and model allow it, else fixed")


def _add_quant_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--group-size", type=int, default=None,
                        help="channels per INT2 scale/zero group (default: the artifact's, else min(128, head_dim))")
    parser.add_argument("--clip-k", type=float, default=None, help="key clip ratio (default 0.96; 0 disables)")
    parser.add_argument("--clip-v", type=float, default=None, help="value clip ratio (default 0.92; 0 disables)")


def _quant_config(args, head_dim: int, artifact=None):
    from .config import QuantConfig

    base = QuantConfig.for_head_dim(head_dim) if artifact is None else QuantConfig(
        artifact.group_size, artifact.clip_ratio_k, artifact.clip_ratio_v)
    return QuantConfig(
        group_size=args.group_size or base.group_size,
        clip_ratio_k=base.clip_ratio_k if args.clip_k is None else args.clip_k,
        clip_ratio_v=base.clip_ratio_v if args.clip_v is None else args.clip_v,
    )


def _checked_quant(config, quant_args, artifact=None):
    """`_quant_config` from a model's transformers config (`models.model_config`), with the group size checked
    against its head_dim, and an artifact against its shapes: a bad --group-size or clip ratio, or an artifact
    of another architecture, is reported before the model's weights load (the weights' fingerprint is checked
    after)."""
    from .models import attention_shape, check_artifact_shapes

    check_artifact_shapes(artifact, config)
    head_dim = attention_shape(config).head_dim
    quant = _quant_config(quant_args, head_dim, artifact)
    quant.check_head_dim(head_dim)
    return quant


def _read_texts(sources: list[str]) -> str:
    """The texts (built-in names or files) joined, read before any model loads: a missing or empty file is the
    error to report first, not after minutes of loading."""
    from .assets import load_text

    text = "\n\n".join(load_text(s) for s in sources)
    if not text.strip():
        raise OscarError(f"the text {sources} is empty; pass a file with prose in it.")
    return text


def _tokens(tokenizer, text: str):
    return tokenizer(text, return_tensors="pt").input_ids[0]


def cmd_calibrate(args) -> int:
    from .calibration.calibrate import CalibrationConfig, calibrate
    from .models import load_model, model_config, required_bos

    started = time.time()
    config = CalibrationConfig(method=args.method, chunk_tokens=args.chunk_tokens, max_chunks=args.max_chunks,
                               max_bits=args.max_bits, budget_context=args.budget_context,
                               clip_grid_k=_ratios(args.clip_grid_k), clip_grid_v=_ratios(args.clip_grid_v),
                               value_weights=getattr(args, "value_weights", "proxy"),
                               positions=getattr(args, "positions", "start"),
                               retrieval_probe=getattr(args, "retrieval_probe", True),
                               key_rotations=getattr(args, "key_rotations", "layer"),
                               levels=getattr(args, "levels", "uniform"), inner=getattr(args, "inner", None))
    quant = _checked_quant(model_config(args.model), args)  # the options first: loading a model takes minutes
    prose = _read_texts(args.text)
    model, tokenizer = load_model(args.model, device=args.device)
    artifact = calibrate(model, _tokens(tokenizer, prose), quant, config, sources=args.text,
                         bos_id=required_bos(model, tokenizer))
    if artifact.method == "oscar":
        print_calibration_report(artifact)
    path = artifact.save(args.out)
    info = artifact.calibration
    print(f"wrote {path}: method {artifact.method}, {artifact.model.num_layers} layers, head_dim "
          f"{artifact.model.head_dim}, group {quant.group_size}, {info.get('tokens', 0)} calibration tokens, "
          f"{time.time() - started:.0f} s")
    return 0


def _ratios(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise OscarError(f"clip grid {text!r} is not a comma-separated list of numbers (e.g. 0,0.94,0.96).") from exc


def _inner_tag(layer, kind: str) -> str:
    inner = layer.inner(kind)
    return f" L{inner:.2f}".replace("L0.", "L.") if inner is not None else ""


def print_calibration_report(artifact) -> None:
    """Per-layer table of the choices and predicted errors, the budget, and warnings."""
    from .calibration.calibrate import DRIFT_MIN, DRIFT_RATIO, HIGH_ERROR
    from .calibration.selection import DEFAULT_EXTRA_BITS, key_transform_name, predicted_error, streams_to_fix
    from .report import format_table

    rows = []
    for i, layer in enumerate(artifact.layers):
        c = layer.choice
        rows.append({
            "layer": str(i),
            "k": f"{'c-' if c['k_centered'] else ''}{key_transform_name(c)}@{layer.clip('k', 0.0):g}{_inner_tag(layer, 'k')}",
            "v": f"{'c-' if c['v_centered'] else ''}{c['v_transform']}@{layer.clip('v', 0.0):g}{_inner_tag(layer, 'v')}",
            "bits": f"{layer.key_bits}/{layer.value_bits}", "error": predicted_error(c),
            "int2": c["error_k"] + c["error_v"], "int4": c["error_k_int4"] + c["error_v_int4"],
            "probe_k": c.get("retrieval_error_k"), "int4_cost": c.get("int4_cost_bits_k"),
            "paper": (c["paper_error_k"] or 0.0) + (c["paper_error_v"] or 0.0),
            "k_near": c["error_k"], "k_far": c.get("error_k_far"), "k_far_rope": c.get("error_k_far_rope"),
        })
    per_head = " (per-head: each KV head's transform, I/H/O = identity/Hadamard/OSCAR, o = its own OSCAR)" \
        if artifact.calibration.get("key_rotations") == "head" else ""
    levels = " L.37 = Lloyd-Max inner levels at 0.37 of the range;" \
        if artifact.calibration.get("levels") == "lloyd" else ""
    print(f"\nper-layer choice{per_head} (c- = centered;{levels} bits: keys/values; errors: relative squared error of the "
          "attention output on held-apart tokens; K probe: the INT2 key error on the retrieval probe; paper = uncentered "
          "OSCAR of SPEC §1-§4; INT4 +bits/elt: the cost of one stream in INT4)")
    print(format_table(rows, [("layer", "layer", "s"), ("k", "K transform@clip", "s"), ("v", "V transform@clip", "s"),
                              ("bits", "bits", "s"), ("error", "error", ".2e"), ("int2", "INT2", ".2e"),
                              ("int4", "INT4", ".2e"), ("probe_k", "K probe", ".2e"),
                              ("int4_cost", "INT4 +bits/elt", ".3f"),
                              ("paper", "paper", ".2e"), ("k_near", "K INT2", ".2e"),
                              ("k_far", "K INT2 far", ".2e"), ("k_far_rope", "K far, rope", ".2e")]))
    far = artifact.calibration.get("drift_check_offset", 0)
    if far:
        print(f"K INT2 far: the key error of the same held-apart tokens at positions {far}..{far + artifact.calibration['chunk_tokens'] - 1}, "
              "centered by the fixed mean; K far, rope: centered by the mean turned by RoPE to those positions "
              "(key_centering='rope', the cache's default)")
    budget = artifact.calibration["budget"]
    print(f"bits per element at {budget['context']} tokens: {budget['bits_per_element']:.3f} (pure INT2 "
          f"{budget['pure_int2_bits_per_element']:.3f}, budget {budget['max_bits']:.3f}); INT4 keys on layers "
          f"{budget['int4_keys'] or 'none'}, INT4 values on layers {budget['int4_values'] or 'none'}")
    if budget.get("reserved_keys"):
        print(f"default budget of a model with sliding-window layers: the keys of its full-attention layers "
              f"{budget['reserved_keys']} are INT4 first, then + {DEFAULT_EXTRA_BITS} bits per element go to the "
              "streams that gain most (--max-bits 0: pure INT2; --max-bits B: B bits, no reserved streams)")
    high = [str(i) for i, layer in enumerate(artifact.layers) if predicted_error(layer.choice) > HIGH_ERROR]
    if high:
        fix = streams_to_fix(artifact, HIGH_ERROR)
        costs = [artifact.layers[i].choice.get(f"int4_cost_bits_{kind}") for i, kind in fix]
        hint = "raise --max-bits to move them to INT4"
        if fix and None not in costs:
            names = ", ".join(f"the {'keys' if kind == 'k' else 'values'} of layer {i}" for i, kind in fix)
            hint = (f"--max-bits {budget['bits_per_element'] + sum(costs):.2f} leaves room for {names} in INT4 "
                    f"(+{sum(costs):.3f} bits per element)")
        print(f"warning: layers {', '.join(high)} keep a predicted attention error above {HIGH_ERROR:g} within this "
              f"budget; {hint}.", file=sys.stderr)
    drifting = [f"{i} ({c['error_k_far'] / max(c['error_k'], 1e-12):.0f}x)"
                for i, c in enumerate(layer.choice for layer in artifact.layers)
                if c.get("error_k_far", 0.0) > max(DRIFT_RATIO * c["error_k"], DRIFT_MIN)]
    if drifting:
        turned = [c["error_k_far_rope"] / max(c["error_k"], 1e-12) for c in (layer.choice for layer in artifact.layers)
                  if "error_k_far_rope" in c]
        after = (f" With the mean turned by RoPE (key_centering='rope', the cache's default) the far error is at most "
                 f"{max(turned):.1f}x the near one in every centered layer." if turned else "")
        print(f"note: the key mean drifts with position: at positions {far}+ the INT2 key error with the fixed mean "
              f"grows in layers {', '.join(drifting)}.{after} Qwen2.5-Coder NIAH at 28K-32K: 0-8% with "
              "key_centering='fixed', 100% with 'rope' (docs/accuracy.md).", file=sys.stderr)


def run_ppl(model_name: str, methods: list[str], rotations: str | None, text: list[str], context: int,
            max_tokens: int | None, quant_args, device: str | None, as_json: bool, plot: str | None,
            max_bits: float | None = None, key_centering: str = "auto", kernel: str = "auto") -> list[dict]:
    from .calibration.artifact import RotationArtifact
    from .config import CacheConfig
    from .evaluation.ppl import check_context, check_windows, evaluate_methods
    from .models import attention_shape, load_model, model_config, required_bos

    artifact = RotationArtifact.load(rotations) if rotations else None
    config = model_config(model_name)
    check_context(config, context)
    cache = CacheConfig(key_centering=key_centering, kernel=kernel)
    check_windows(context, cache)
    quant = _checked_quant(config, quant_args, artifact)
    prose = _read_texts(text)
    model, tokenizer = load_model(model_name, device=device)
    if max_bits is not None and artifact is not None:
        from .calibration.selection import apply_budget

        apply_budget(artifact, attention_shape(model), CacheConfig(), max_bits,
                     artifact.calibration.get("budget", {}).get("context", 32768))
    results = evaluate_methods(model, _tokens(tokenizer, prose), methods, quant, cache, context,
                               max_tokens, artifact, required_bos(model, tokenizer))
    reference = next((r.ppl for r in results if r.method == "bf16"), None)
    rows = []
    for r in results:
        row = r.as_dict()
        row["ppl_ratio"] = r.ppl / reference if reference else None
        row["key_centering"] = key_centering
        rows.append(row)
        if as_json:
            print(json.dumps(row), flush=True)
    if not as_json:
        from .report import format_table

        print(f"\nperplexity of {model_name} on {', '.join(text)}: context {context}, group {quant.group_size}, "
              f"clip K {quant.clip_ratio_k} / V {quant.clip_ratio_v}; scored positions >= 320 only")
        print(format_table(rows, [("method", "method", "s"), ("ppl", "ppl", ".3f"), ("ppl_ratio", "÷ bf16", ".3f"),
                                  ("bits_per_element", "bits/elt", ".2f"), ("kv_bytes", "KV bytes/window", ",d"),
                                  ("tokens", "tokens", ",d")]))
    if plot and reference:
        from .report import plot_ppl

        path = plot_ppl(rows, plot, f"{model_name}: ctx {context}, group {quant.group_size}")
        print(f"plot: {path}", file=sys.stderr)
    return rows


def _methods(args) -> list[str]:
    """--methods as a list, checked before anything loads (`methods.check_methods`), after the model's name
    (`models.check_model_name`: a mistyped model is the error to report first)."""
    from .methods import check_methods
    from .models import check_model_name

    check_model_name(args.model)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    check_methods(methods, args.rotations is not None, how="pass --rotations FILE")
    return methods


def cmd_eval_ppl(args) -> int:
    methods = _methods(args)
    run_ppl(args.model, methods, args.rotations, args.text, args.context, args.max_tokens, args, args.device,
            args.json, args.plot, args.max_bits, args.key_centering, args.kernel)
    return 0


def _numbers(text: str, kind: type, option: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        example = "0,0.5,1" if kind is float else "4096,8192"
        raise OscarError(f"{option} {text!r}: expected {kind.__name__}s separated by commas, such as {example}.") \
            from None


def _floats(text: str, option: str) -> list[float]:
    return _numbers(text, float, option)


def _ints(text: str, option: str) -> list[int]:
    return _numbers(text, int, option)


def _print_json_lines(results: list, rows: list[dict], kind: str, **summary_fields) -> None:
    """One JSON object per result (marked `kind`), then one per summary row (marked "summary")."""
    for r in results:
        print(json.dumps(dict(r.as_dict(), kind=kind)), flush=True)
    for row in rows:
        print(json.dumps(dict(row, kind="summary", **summary_fields)), flush=True)


def cmd_eval_niah(args) -> int:
    depths, lengths = _floats(args.depths, "--depths"), _ints(args.lengths, "--lengths")  # before anything loads
    if any(not 0 <= d <= 1 for d in depths):
        raise OscarError(f"--depths {args.depths}: each depth is a fraction of the haystack, between 0 and 1.")
    if not depths or not lengths:
        raise OscarError(f"{'--depths' if not depths else '--lengths'} is empty; give at least one value.")
    methods = _methods(args)
    from .calibration.artifact import RotationArtifact
    from .config import CacheConfig
    from .evaluation.niah import build_cases, check_lengths, evaluate_niah, summarise
    from .models import load_model, model_config, required_bos

    artifact = RotationArtifact.load(args.rotations) if args.rotations else None
    config = model_config(args.model)
    check_lengths(config, lengths)
    quant = _checked_quant(config, args, artifact)
    haystack = _read_texts([args.text])  # before the model: a missing or empty file is reported first
    model, tokenizer = load_model(args.model, device=args.device)
    cache = CacheConfig(key_centering=args.key_centering, kernel=args.kernel)
    cases = build_cases(tokenizer, haystack, lengths, depths, args.trials, cache,
                        required_bos(model, tokenizer), args.seed)
    results = evaluate_niah(model, tokenizer, cases, methods, quant, cache, artifact)
    rows = summarise(results)
    if args.json:
        _print_json_lines(results, rows, "case", key_centering=args.key_centering)
    else:
        from .report import format_table

        print(f"\nneedle in a haystack, {args.model}, haystack '{args.text}', depths {args.depths}, "
              f"{args.trials} trial(s), group {quant.group_size}")
        print(format_table(rows, [("method", "method", "s"), ("length", "length", "d"), ("cases", "cases", "d"),
                                  ("accuracy", "exact match %", ".0f"), ("history_cases", "needles in INT2", "d"),
                                  ("history_accuracy", "their exact match %", ".0f")]))
        print("exact match: the first six digits generated equal the passcode. Needles within the first "
              f"{cache.sink_tokens} or last {cache.recent_tokens} prompt tokens stay in BF16 in every method; "
              "'needles in INT2' counts the others.")
    if args.plot:
        from .report import plot_niah

        print(f"plot: {plot_niah(rows, args.plot, f'{args.model}: needle in a haystack')}", file=sys.stderr)
    return 0


def cmd_eval_code(args) -> int:
    methods = _methods(args)
    from .calibration.artifact import RotationArtifact
    from .config import CacheConfig
    from .evaluation.code import evaluate_code, load_problems, summarise
    from .models import load_model, model_config

    artifact = RotationArtifact.load(args.rotations) if args.rotations else None
    cache = CacheConfig(sink_tokens=args.sink, recent_tokens=args.recent, key_centering=args.key_centering,
                        kernel=args.kernel)
    quant = _checked_quant(model_config(args.model), args, artifact)
    problems = load_problems(args.limit)  # fetches HumanEval the first time: after the arguments are checked
    model, tokenizer = load_model(args.model, device=args.device)
    results = evaluate_code(model, tokenizer, problems, methods, quant, cache, artifact, args.max_new_tokens,
                            args.batch_size)
    rows = summarise(results)
    if args.json:
        _print_json_lines(results, rows, "problem", sink=args.sink, recent=args.recent)
    else:
        from .report import format_table

        print(f"\nHumanEval pass@1 (greedy), {args.model}, {len(problems)} problems, windows {args.sink} sink + "
              f"{args.recent} recent, group {quant.group_size}")
        print(format_table(rows, [("method", "method", "s"), ("passed", "passed", "d"), ("problems", "problems", "d"),
                                  ("pass_at_1", "pass@1 %", ".1f"), ("mean_tokens", "tokens/problem", ".0f"),
                                  ("history_share", "% of tokens in history", ".1f")]))
        print("pass@1: the share of problems whose unit tests pass on the greedy completion. '% of tokens in "
              "history': prompt and completion tokens that aged past both BF16 windows and were stored by the "
              "method (the rest stay in BF16 in every method).")
    if args.plot:
        from .report import plot_pass_rate

        print(f"plot: {plot_pass_rate(rows, args.plot, f'{args.model}: HumanEval pass@1, windows {args.sink}+{args.recent}')}",
              file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    """Calibrate on Wikipedia prose, evaluate on held-out news: BF16 vs OSCAR vs baselines."""
    started = time.time()
    out = Path(args.out)
    rotations = out / "smollm2-135m.rot.safetensors"
    print(f"oscarkv demo: {args.model}, calibrate on '{DEMO_TEXT_CALIBRATION}', evaluate on '{DEMO_TEXT_EVALUATION}'")
    calibrate_args = argparse.Namespace(model=args.model, device=args.device, method="oscar", text=[DEMO_TEXT_CALIBRATION],
                                        chunk_tokens=1024, max_chunks=args.calibration_chunks, out=str(rotations),
                                        group_size=args.group_size, clip_k=None, clip_v=None, max_bits=0,
                                        budget_context=32768, clip_grid_k="0,0.96", clip_grid_v="0,0.92")
    cmd_calibrate(calibrate_args)
    quant_args = argparse.Namespace(group_size=args.group_size, clip_k=None, clip_v=None)
    run_ppl(args.model, ["bf16", "oscar", "oscar-paper", "naive", "hadamard"], str(rotations), [DEMO_TEXT_EVALUATION],
            args.context,
            args.max_tokens, quant_args, args.device, False, str(out / "demo_ppl.png"))
    print(f"\nWhat the numbers mean: ppl is the perplexity of the held-out news text with the KV history stored by "
          f"each method; '÷ bf16' is its ratio to the BF16 cache (1.000 = no loss); bits/elt is the measured "
          f"storage of one {args.context}-token window per K/V element, BF16 windows included. oscar = this "
          f"package's method (centering and a per-layer transform and clip, pure INT2 here); oscar-paper = the "
          f"published method; naive = INT2 without rotation; hadamard = INT2 after a Walsh-Hadamard rotation "
          f"(QuaRot-style).")
    print(f"demo finished in {time.time() - started:.0f} s; rotations in {rotations}")
    return 0


def cmd_model_dir(args) -> int:
    """The local Hugging Face directory of MODEL (what `vllm` and other engines load)."""
    from .models import resolve_model

    print(resolve_model(args.model))
    return 0


def cmd_info(args) -> int:
    from .calibration.artifact import RotationArtifact

    artifact = RotationArtifact.load(args.rotations)
    print(json.dumps(artifact.metadata(), indent=2))
    return 0


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    """"1x8192,32x32768" -> [(1, 8192), (32, 32768)] (batch x context)."""
    try:
        return [tuple(int(x) for x in item.lower().split("x")) for item in text.split(",") if item]
    except ValueError:
        raise OscarError(f"--shapes {text!r}: write BATCHxCONTEXT pairs separated by commas, e.g. 1x8192,32x32768.")


def cmd_bench_attention(args) -> int:
    from .benchmarks import attention

    shapes = _parse_shapes(args.shapes)
    layer = attention.layer_shape(args.model) if args.model else attention.QWEN3_LAYER
    results = attention.run(shapes, args.write_tokens, args.lloyd_inner, layer, args.key_shifts)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{results['device']}  copy bandwidth {results['copy_bandwidth_gbs']:.0f} GB/s  torch {results['torch']}")
    print(f"one layer{' of ' + args.model if args.model else ''}: {layer.describe()}")
    lloyd = args.lloyd_inner is not None
    print(f"{'batch':>5} {'context':>8} {'SDPA us':>9} {'INT2 us':>9} {'speedup':>8} {'SDPA* us':>9} {'speedup*':>8} "
          f"{'INT2 GB/s':>10} {'% copy BW':>9} {'copy us':>8} {'% copy':>7} {'read us':>8} {'read BW':>7} "
          f"{'ceiling':>8} {'max err':>8} {'history':>7}"
          + (f" {'Lloyd us':>9} {'cost':>6} {'max err':>8}" if lloyd else "")
          + (f" {'shifts us':>9} {'cost':>6} {'max err':>8}" if args.key_shifts else ""))
    for r in results["decode"]:
        extra = (f" {r['lloyd_us']:>9.1f} {r['lloyd_us'] / r['int2_us']:>5.2f}x {r['lloyd_max_abs_error']:>8.1e}"
                 if lloyd else "")
        extra += (f" {r['shifts_us']:>9.1f} {r['shifts_us'] / r['int2_us']:>5.2f}x {r['shifts_max_abs_error']:>8.1e}"
                  if args.key_shifts else "")
        print(f"{r['batch']:>5} {r['context']:>8} {r['sdpa_us']:>9.1f} {r['int2_us']:>9.1f} {r['speedup']:>7.2f}x "
              f"{r['sdpa_any_backend_us']:>9.1f} {r['speedup_over_fastest_sdpa']:>7.2f}x "
              f"{r['int2_bandwidth_gbs']:>10.0f} {100 * r['int2_bandwidth_fraction']:>8.1f}% "
              f"{r['same_bytes_copy_us']:>8.1f} {100 * r['int2_fraction_of_same_bytes_copy']:>6.1f}% "
              + (f"{r['same_bytes_read_us']:>8.1f} {100 * r['same_bytes_read_fraction']:>6.1f}% "
                 f"{r['speedup_ceiling']:>7.2f}x " if r.get('same_bytes_read_us') else f"{'-':>8} {'-':>7} {'-':>8} ")
              + f"{r['max_abs_error']:>8.1e} {r.get('history_kernel') or '-':>7}" + extra)
    w = results["write"]
    print(f"write path: {w['tokens']} tokens in {w['microseconds']:.0f} us = {w['tokens_per_s'] / 1e6:.1f} M tokens/s, "
          f"{w['bandwidth_gbs']:.0f} GB/s ({100 * w['bandwidth_fraction']:.0f}% of copy bandwidth; CUDA graph), "
          f"{w['eager_microseconds']:.0f} us launched eagerly from Python"
          + (f"; with Lloyd-Max levels {w['lloyd_microseconds']:.0f} us" if lloyd else "")
          + (f"; with key shifts {w['shifts_microseconds']:.0f} us" if args.key_shifts else ""))
    print("SDPA us: torch SDPA, flash backend, over the same contents (the issue's baseline); SDPA* us: SDPA with its "
          "own backend choice; speedup*: against the faster of the two")
    print("% copy BW: INT2 GB/s against the 2 GiB copy; copy us: a copy moving the bytes the kernel reads (half "
          "read, half written), timed the same way; % copy: copy us / INT2 us; history: the kernel of the decode "
          "history launch (gluon: oscarkv.kernels.gluon_history, else triton)")
    print("read us: the fastest plain read of the bytes the kernel reads (oscarkv.benchmarks.stream_read), about the "
          "best any kernel could do at this shape; read BW: its share of the copy bandwidth, the most '% copy BW' can "
          "reach; ceiling: SDPA us / read us, the most 'speedup' can reach")
    if lloyd:
        print(f"Lloyd us: the same steps on the same codes read at Lloyd-Max levels (inner {args.lloyd_inner}); "
              "cost = Lloyd us / INT2 us")
    if args.key_shifts:
        print("shifts us: the same steps with the key shifts of a calibrated, centered artifact (key_centering 'rope': "
              "history keys stored minus their block's RoPE-turned mean, read plus it); cost = shifts us / INT2 us")
    return 0


def cmd_bench_decode(args) -> int:
    from .report import decode_tables, plot_decode

    if args.from_json:
        results = [json.loads(Path(f).read_text()) for f in args.from_json]
    else:
        from tqdm import tqdm

        from .benchmarks import require_cuda
        from .benchmarks.decode import FROM_JSON_HINT, Settings, run

        require_cuda("bench decode", FROM_JSON_HINT)  # before the bar
        contexts, batch_contexts = _ints(args.contexts, "--contexts"), _ints(args.batch_contexts, "--batch-contexts")
        settings = Settings(args.model, tuple(contexts), args.batch, tuple(batch_contexts),
                            not args.no_largest, args.prefill, steps=args.steps,
                            compile_small_ops=not args.eager_small_ops, decode_gemv=not args.cublas,
                            centered=args.centered)
        with tqdm(desc="bench decode", bar_format="{desc}: {elapsed} {postfix}", disable=args.json) as bar:
            results = [run(settings, progress=lambda message: bar.set_postfix_str(message))]
        if args.save:
            Path(args.save).write_text(json.dumps(results[0], indent=2))
    if args.plot:
        print(f"plot: {plot_decode(results, args.plot)}", file=sys.stderr)
    print(json.dumps(results if len(results) > 1 else results[0], indent=2) if args.json else
          "\n\n".join(decode_tables(r) for r in results))
    return 0


def _warm_up_with_bar(engine) -> bool:
    """`engine.warm_up` with a progress bar: it compiles and captures for a minute or more on a fresh GPU machine."""
    from tqdm import tqdm

    with tqdm(desc="oscarkv serve: warming up (prompt chunks, then each batch size)", unit="step",
              leave=False, mininterval=0) as bar:  # a step takes a second or more: draw each one
        def show(done: int, total: int) -> None:
            bar.total = total
            if done == bar.n:
                bar.refresh()  # the first report: show the total
            else:
                bar.update(done - bar.n)

        return engine.warm_up(progress=show)


def _api_key(args) -> str | None:
    """--api-key, else the OSCARKV_API_KEY environment variable (which keeps the key out of the process list)."""
    return args.api_key or os.environ.get("OSCARKV_API_KEY") or None


def cmd_serve(args) -> int:
    import uvicorn

    from .calibration.artifact import RotationArtifact
    from .config import CacheConfig
    from .methods import check_methods
    from .models import check_artifact_shapes, load_model, model_config
    from .serving.api import create_app
    from .serving.build import build_engine, check_address, check_max_context
    from .serving.engine import EngineConfig

    check_methods([args.method], args.rotations is not None, how="pass --rotations FILE, or serve --method bf16")
    check_address(args.host, args.port)
    # The artifact and the limits against the model's config first: its weights may take minutes to load.
    settings = model_config(args.model)
    artifact = RotationArtifact.load(args.rotations) if args.rotations else None
    check_artifact_shapes(artifact, settings)
    config = EngineConfig(max_seqs=args.max_seqs, max_context=args.max_context or min(
        4096, getattr(settings, "max_position_embeddings", 4096)), prefill_chunk=args.prefill_chunk,
        solo_prefill_chunk=args.solo_prefill_chunk, max_waiting=args.max_waiting, cuda_graphs=not args.no_cuda_graphs,
        prefix_reuse=not args.no_prefix_reuse)
    check_max_context(config, settings)
    model, tokenizer = load_model(args.model, device=args.device)
    budget = None if args.kv_memory is None else int(args.kv_memory * 2**30)
    engine = build_engine(model, tokenizer, args.method, artifact, config, budget,
                          cache=CacheConfig(compile_small_ops=not args.eager_small_ops, decode_gemv=not args.cublas))
    if model.device.type == "cuda" and not args.no_warm_up:
        started = time.time()
        warmed = _warm_up_with_bar(engine)
        print(f"oscarkv serve: kernels warmed up for batch sizes 1..{config.max_seqs} in {time.time() - started:.0f} s"
              if warmed else "oscarkv serve: no warm-up (the cache cannot hold its throw-away sequences)",
              file=sys.stderr)
    usage = engine.cache.usage()
    api_key = _api_key(args)
    pages = f", {usage.pages_total} INT2 pages" if usage.pages_total else ""
    print(f"oscarkv serve: {args.model} ({args.method} cache on {model.device}{pages}, "
          f"{usage.bytes_total / 2**20:.0f} MiB of KV tensors), {config.max_seqs} slots x {config.max_context} tokens; "
          f"http://{args.host}:{args.port}/v1{' (an API key is required)' if api_key else ''}", file=sys.stderr)
    uvicorn.run(create_app(engine, args.served_name or args.model, api_key=api_key), host=args.host,
                port=args.port, log_level=args.log_level)
    return 0


def cmd_bench_serve(args) -> int:
    import httpx

    # The load test's prose, read first: a missing or empty text is refused before anything is sent.
    words = None if args.prompt_tokens else _read_texts([args.text]).split()
    try:
        httpx.get(args.url.rstrip("/") + "/health", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        raise OscarError(f"no healthy oscarkv server answers at {args.url} ({exc}); start one with "
                         "`oscarkv serve MODEL` and pass its address with --url.")
    return _bench_serve(args, words)


def _bench_serve(args, words: list[str] | None) -> int:
    """The throughput run (--prompt-tokens) or the load test, whose prompts are cut from `words`."""
    import asyncio

    from tqdm import tqdm

    from .serving.loadtest import LoadConfig, format_report, run_load

    if args.prompt_tokens:
        from .serving.loadtest import measure_throughput

        result = asyncio.run(measure_throughput(args.url.rstrip("/"), args.clients, args.prompt_tokens,
                                                args.max_tokens, args.vocab, temperature=args.temperature,
                                                top_p=args.top_p, choices=args.choices, api_key=_api_key(args)))
        print(json.dumps(result.to_dict(), indent=2) if args.json else
              f"{result.clients} requests of {result.prompt_tokens} prompt tokens"
              f"{f' ({result.choices} choices each)' if result.choices > 1 else ''} running together: "
              f"{result.decode_tokens_per_s:.0f} generated tokens/s over {result.window_s:.1f} s "
              f"({result.window_tokens} tokens); all prompts read after {result.all_started_s:.1f} s; "
              f"KV in use {result.kv_bytes_used_peak / 2**30:.2f} GiB of {result.kv_bytes_total / 2**30:.2f} GiB")
        return 0 if result.failed == 0 else 1
    config = LoadConfig(args.url.rstrip("/"), args.clients, args.duration, args.prompt_words, args.max_tokens,
                        args.disconnect_every, args.probe_interval, api_key=_api_key(args))
    with tqdm(desc="completed requests", unit="req", disable=args.json) as progress:
        report = asyncio.run(run_load(config, words, progress))
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1


def version_line() -> str:
    """oscarkv's version and those of the libraries it runs on, from their installed metadata (the libraries are not
    imported)."""
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    def installed(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} not installed"

    return f"oscarkv {__version__} ({', '.join(installed(name) for name in ('torch', 'transformers', 'triton'))})"


def _eval_parser(eval_sub, name: str, help_text: str, methods: str = "bf16,oscar,naive",
                 methods_help: str = "comma-separated methods, as for `eval ppl`") -> argparse.ArgumentParser:
    """An `oscarkv eval NAME` parser with what every evaluation takes first: the model, the artifact, the methods."""
    e = eval_sub.add_parser(name, help=help_text)
    e.add_argument("model")
    e.add_argument("--rotations", default=None, help="artifact from `oscarkv calibrate` (needed for 'oscar')")
    e.add_argument("--methods", default=methods, help=methods_help)
    return e


def _eval_outputs(e: argparse.ArgumentParser, json_help: str, plot_help: str, func) -> None:
    """What every evaluation takes last: its outputs, the device, the quantization and cache options, the command."""
    e.add_argument("--json", action="store_true", help=json_help)
    e.add_argument("--plot", default=None, help=plot_help)
    e.add_argument("--device", default=None)
    _add_quant_args(e)
    _add_cache_args(e)
    e.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oscarkv", description=__doc__)
    parser.add_argument("--version", action="version", version=version_line(),  # metadata only: about 3 ms
                        help="print the versions of oscarkv, torch, transformers and triton, and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("calibrate", help="compute rotations for a model from text")
    p.add_argument("model", help="built-in alias (smollm2-135m), HF directory or .gguf file")
    p.add_argument("--text", nargs="+", default=[DEMO_TEXT_CALIBRATION],
                   help="text files or built-in texts (wiki, news); default: wiki")
    p.add_argument("--out", required=True, help="output .safetensors artifact")
    p.add_argument("--method", default="oscar", choices=["oscar", "oscar-paper", "ktk", "vtv", "hadamard", "identity"])
    p.add_argument("--max-bits", type=float, default=None,
                   help="bits per element allowed (default: pure INT2 + 0.25, letting the streams - keys or "
                        "values of a layer - that gain most use INT4; in a model with sliding-window layers, the "
                        "keys of its full-attention layers take INT4 first, on top; 0 = pure INT2)")
    p.add_argument("--no-retrieval-probe", dest="retrieval_probe", action="store_false",
                   help="spend the budget by the error on held-apart text alone, without the retrieval probe "
                        "(the held-apart chunk's first half twice); an ablation")
    p.add_argument("--budget-context", type=int, default=32768, help="context at which the budget is counted")
    p.add_argument("--clip-grid-k", default="0,0.9,0.93,0.96,0.98",
                   help="key clip ratios tried per layer (method oscar; default %(default)s)")
    p.add_argument("--clip-grid-v", default="0,0.88,0.92,0.95,0.98",
                   help="value clip ratios tried per layer (method oscar; default %(default)s)")
    p.add_argument("--value-weights", choices=("proxy", "attention"), default="proxy",
                   help="token weights of the value covariance C_S: proxy = k C_Q k^T (the paper); attention = "
                        "the attention probability each key receives on the calibration text (OSCAR+)")
    p.add_argument("--key-rotations", choices=("layer", "head"), default="layer",
                   help="layer = one key rotation per layer (the paper); head = also an OSCAR rotation from each "
                        "KV head's own queries, and each KV head picks its own key transform (OSCAR+)")
    p.add_argument("--levels", choices=("uniform", "lloyd"), default="uniform",
                   help="INT2 levels: uniform = 0, 1/3, 2/3, 1 of each group's range (the paper); lloyd = each "
                        "layer's INT2 keys and values may move the inner two outwards (Lloyd-Max, searched with "
                        "the clip ratio on the calibration text; OSCAR+)")
    p.add_argument("--inner", type=float, default=None, metavar="A",
                   help="with --levels lloyd: every INT2 stream takes inner level A (e.g. 0.36) instead of a per-layer "
                        "search; transform and clip are chosen on the uniform grid")
    p.add_argument("--positions", choices=("start", "spread"), default="start",
                   help="positions the calibration chunks run at: start = 0..chunk-1 (the paper); spread = "
                        "offsets spread over the model's context, so the key mean holds at every position")
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--max-chunks", type=int, default=16, help="chunks used after the skipped warm-up chunk")
    p.add_argument("--device", default=None)
    _add_quant_args(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("eval", help="accuracy evaluations")
    eval_sub = p.add_subparsers(dest="eval_command", required=True)
    from .methods import DESCRIPTIONS, SERVE_METHODS

    e = _eval_parser(eval_sub, "ppl", "perplexity per method on the same text and positions",
                     "bf16,oscar,oscar-paper,naive,hadamard",
                     "comma-separated: " + "; ".join(f"{name}: {text}" for name, text in DESCRIPTIONS.items()))
    e.add_argument("--max-bits", type=float, default=None,
                   help="re-apply a bit budget to the artifact's per-layer errors (0 = pure INT2)")
    e.add_argument("--text", nargs="+", default=[DEMO_TEXT_EVALUATION])
    e.add_argument("--context", type=int, default=2048)
    e.add_argument("--max-tokens", type=int, default=None, help="stop after scoring about this many tokens")
    _eval_outputs(e, "one JSON object per method per line", "write a PNG bar chart here", cmd_eval_ppl)

    e = _eval_parser(eval_sub, "niah", "needle-in-a-haystack retrieval per method (greedy, exact match)")
    e.add_argument("--lengths", default="1024,2048", help="prompt lengths in tokens")
    e.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths, fractions of the haystack")
    e.add_argument("--trials", type=int, default=2, help="needles (and haystack offsets) per length and depth")
    e.add_argument("--text", default=DEMO_TEXT_EVALUATION, help="haystack: a built-in text or a file")
    e.add_argument("--seed", type=int, default=0)
    _eval_outputs(e, "one JSON object per case, then one per method and length", "write a PNG plot here",
                  cmd_eval_niah)

    e = _eval_parser(eval_sub, "code", "HumanEval pass@1 per method (greedy completions, unit tests in a subprocess)")
    e.add_argument("--limit", type=int, default=None, help="only the first N of the 164 problems")
    e.add_argument("--max-new-tokens", type=int, default=384)
    e.add_argument("--batch-size", type=int, default=32, help="prompts generated together (left-padded; kivi2: prompts of equal length)")
    e.add_argument("--sink", type=int, default=64, help="BF16 sink window, tokens")
    e.add_argument("--recent", type=int, default=256, help="BF16 recent window, tokens")
    _eval_outputs(e, "one JSON object per problem, then one per method", "write a PNG bar chart here", cmd_eval_code)

    p = sub.add_parser("demo", help="calibrate + evaluate the embedded model (a few minutes on a CPU)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="oscarkv-demo")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=5000)
    p.add_argument("--calibration-chunks", type=int, default=8)
    p.add_argument("--device", default=None)
    p.set_defaults(func=cmd_demo, output_dirs=("out",))

    p = sub.add_parser("bench", help="benchmarks: attention and decode (CUDA GPU), serve (a running server)")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    b = bench_sub.add_parser("attention",
                             help="INT2 decode kernel vs BF16 SDPA on one layer (Qwen3 shapes, or --model's)")
    b.add_argument("--shapes", default="1x8192,1x32768,1x65536,1x131072,32x8192,32x32768",
                   help="BATCHxCONTEXT pairs (default %(default)s)")
    b.add_argument("--model", default=None,
                   help="time the layer shape of this model (its config only: heads, head_dim, and its default group "
                        "size), e.g. random:smollm2-135m (default: Qwen3-4B/8B's, 32 query / 8 KV heads, head_dim 128)")
    b.add_argument("--write-tokens", type=int, default=32768, help="prompt length for the write-path throughput")
    b.add_argument("--lloyd-inner", type=float, default=None, metavar="A",
                   help="also time every step with Lloyd-Max INT2 levels at inner level A (e.g. 0.38), same codes")
    b.add_argument("--key-shifts", action="store_true",
                   help="also time every step and the write path with the key shifts that a calibrated, centered "
                        "artifact runs by default (key_centering 'rope'), same contents")
    b.add_argument("--json", action="store_true", help="print the results as JSON")
    b.set_defaults(func=cmd_bench_attention)
    b = bench_sub.add_parser("serve", help="load and fault test of a running OpenAI-compatible server (any device)")
    b.add_argument("--url", default="http://127.0.0.1:8000")
    b.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    b.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    b.add_argument("--prompt-words", type=int, default=600, help="words of prose per prompt")
    b.add_argument("--max-tokens", type=int, default=32)
    b.add_argument("--disconnect-every", type=int, default=5, help="every Nth request of a client hangs up (0: none)")
    b.add_argument("--probe-interval", type=float, default=2.0, help="seconds between bad-request probes")
    b.add_argument("--text", default="news", help="prose for the prompts: a built-in text or a file")
    b.add_argument("--prompt-tokens", type=int, default=0,
                   help="throughput mode: --clients requests of this many random token ids sent at once; "
                        "prints the decode tokens/s while all of them run")
    b.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this (throughput mode)")
    b.add_argument("--temperature", type=float, default=0.0, help="throughput mode: 0 is greedy, else sampled")
    b.add_argument("--top-p", type=float, default=1.0, help="throughput mode: top_p of sampled requests")
    b.add_argument("--choices", type=int, default=1, help="throughput mode: n, the choices of every request")
    b.add_argument("--api-key", default=None, help="the server's API key (default: OSCARKV_API_KEY, else none)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_serve)

    b = bench_sub.add_parser("decode", help="whole-model decode, BF16 vs INT2 cache, same static path (CUDA GPU)")
    b.add_argument("--model", default="random:qwen3-4b",
                   help="random:qwen3-4b (default), random:qwen3-8b, random:smollm2-135m or any loadable model")
    b.add_argument("--contexts", default="30000,60000,100000", help="batch-1 context lengths (default %(default)s)")
    b.add_argument("--batch", type=int, default=32, help="INT2 batch of the equal-memory comparison")
    b.add_argument("--batch-contexts", default="8192,32768", help="contexts of the batch runs (default %(default)s)")
    b.add_argument("--no-largest", action="store_true", help="skip the runs at the largest batch that fits")
    b.add_argument("--prefill", type=int, default=32768, help="prompt tokens of the prefill timing (0: skip)")
    b.add_argument("--steps", type=int, default=128, help="decode steps timed per run")
    b.add_argument("--eager-small-ops", action="store_true",
                   help="run the norms, MLPs, rotary embedding and residual adds as eager PyTorch in the decode "
                        "steps, and the prompts' norms too (default: compiled by torch.compile, the RMSNorms as a "
                        "Triton kernel with the residual adds, also in prompt forwards of 4096 tokens or more; "
                        "CacheConfig.compile_small_ops)")
    b.add_argument("--cublas", action="store_true",
                   help="run the decode steps' linear layers through cuBLAS (default: Triton kernels at batch 1 "
                        "to 32, CacheConfig.decode_gemv)")
    b.add_argument("--centered", action="store_true",
                   help="run the INT2 cache as a calibrated oscar artifact does: keys and values centered, the keys "
                        "with RoPE-following shifts (a synthetic artifact; default: the hadamard method, no centering)")
    b.add_argument("--save", default=None, help="write the results to this JSON file")
    b.add_argument("--plot", default=None, help="write the tokens/s vs context plot to this PNG")
    b.add_argument("--from-json", nargs="+", default=None,
                   help="print tables (and --plot) from saved results instead of measuring")
    b.add_argument("--json", action="store_true", help="print the results as JSON")
    b.set_defaults(func=cmd_bench_decode)

    p = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching over the INT2 cache")
    p.add_argument("model", help="built-in alias, HF directory or .gguf file")
    p.add_argument("--rotations", default=None, help="artifact from `oscarkv calibrate` (needed for oscar)")
    p.add_argument("--method", default="oscar", choices=SERVE_METHODS,
                   help="KV cache: oscar (default; paged INT2), another INT method, or bf16 (the baseline)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-name", default=None, help="model name in the API (default: MODEL as given)")
    p.add_argument("--max-seqs", type=int, default=32, help="sequences decoded together (default %(default)s)")
    p.add_argument("--max-context", type=int, default=None,
                   help="prompt + output tokens per request (default: the model's, at most 4096)")
    p.add_argument("--kv-memory", type=float, default=None,
                   help="GiB for the KV cache (default: enough for every slot at --max-context)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill step (default: 2048 on CUDA, 512 on the CPU)")
    p.add_argument("--solo-prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill step while no request is decoding (default: 4x --prefill-chunk "
                        "on CUDA, --prefill-chunk on the CPU)")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before HTTP 503")
    p.add_argument("--device", default=None)
    p.add_argument("--no-prefix-reuse", action="store_true",
                   help="close each finished sequence's slot at once instead of keeping its cache for a next request "
                        "whose prompt begins with its tokens (a conversation's next turn)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on CUDA, run every decode step eagerly instead of replaying a CUDA graph per batch size")
    p.add_argument("--eager-small-ops", action="store_true",
                   help="on CUDA, run the model's norms, MLPs, rotary embedding and residual adds as eager "
                        "PyTorch in the decode graphs, and the prompts' norms too (default: compiled by torch.compile, "
                        "the RMSNorms as a Triton kernel with the residual adds, also in prompt chunks of 4096 tokens "
                        "or more; with --cublas, eager gives transformers' rounding exactly)")
    p.add_argument("--cublas", action="store_true",
                   help="on CUDA, run the decode steps' linear layers through cuBLAS (default: Triton kernels "
                        "at batch 1 to 32, CacheConfig.decode_gemv)")
    p.add_argument("--no-warm-up", action="store_true",
                   help="on CUDA, skip running every batch size once before serving (kernels then compile "
                        "during the first requests)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every /v1, /tokenize and /detokenize request (401 "
                        "without it); default: the "
                        "OSCARKV_API_KEY environment variable, else no key")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("model-dir", help="print a model's local Hugging Face directory (a GGUF is converted once), "
                                         "e.g. to serve it with vLLM")
    p.add_argument("model")
    p.set_defaults(func=cmd_model_dir)

    p = sub.add_parser("info", help="print an artifact's metadata")
    p.add_argument("rotations")
    p.set_defaults(func=cmd_info)
    return parser


# The options that name what a command writes after its work, with a file name to suggest in a directory.
OUTPUT_OPTIONS = {"out": "rot.safetensors", "plot": "plot.png", "save": "results.json"}


def check_outputs(args) -> None:
    """Refuse an output path that cannot be written before the work that fills it (a calibration or an
    evaluation takes minutes, and its results would be lost): a directory where a file goes, a file where a
    directory goes (the demo's --out, `output_dirs`), or a directory this user cannot write in."""
    for name, example in OUTPUT_OPTIONS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        path, option, as_dir = Path(value), f"--{name} {value}", name in getattr(args, "output_dirs", ())
        if as_dir and path.exists() and not path.is_dir():
            raise OscarError(f"{option}: a file of that name exists; pass a directory.")
        if not as_dir and path.is_dir():
            raise OscarError(f"{option}: is a directory; pass a file name, such as {path / example}.")
        nearest = path if as_dir else path.parent
        while not nearest.exists():  # the directories that do not exist yet are made when the command writes
            nearest = nearest.parent
        if not nearest.is_dir():
            raise OscarError(f"{option}: {nearest} is a file, not a directory; pass another path.")
        if not os.access(nearest, os.W_OK | os.X_OK) or (path.is_file() and not os.access(path, os.W_OK)):
            raise OscarError(f"{option}: cannot write there (no permission); pass a path in a writable directory.")


# Numeric options that count something (at least 1) or measure an amount (more than 0), whichever command has them;
# checked before any work, as the output paths are (options where 0 means "none" are not listed).
COUNT_OPTIONS = ("max_tokens", "trials", "max_new_tokens", "batch_size", "calibration_chunks", "max_chunks",
                 "write_tokens", "clients", "prompt_words", "steps", "batch", "choices")
AMOUNT_OPTIONS = ("kv_memory", "duration", "probe_interval")


def check_counts(args) -> None:
    """Refuse a count below 1 or an amount not above 0 (`COUNT_OPTIONS`, `AMOUNT_OPTIONS`) before the command starts:
    `demo --max-tokens 0` calibrated for minutes before its evaluation refused it."""
    for name in COUNT_OPTIONS + AMOUNT_OPTIONS:
        value = getattr(args, name, None)
        if value is not None and (value < 1 if name in COUNT_OPTIONS else value <= 0):
            limit = "at least 1" if name in COUNT_OPTIONS else "more than 0"
            raise OscarError(f"--{name.replace('_', '-')} {value}: must be {limit}.")


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end has closed (poll reports an error on it); True where this cannot
    be asked (no poll, no file descriptor)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_outputs(args)
        check_counts(args)
        return args.func(args)
    except OscarError as exc:
        print(f"oscarkv: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a pipe of something else: not ours to hide
        # the reader of our output left (`oscarkv ... | head`): stop quietly, as command-line tools do, with
        # stdout pointed at /dev/null so that the interpreter's own flush at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
