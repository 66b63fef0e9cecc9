"""Make the Triton CPU interpreter fast enough for CI (test infrastructure only).

The interpreter re-patches `triton.language` on every call of a device function (each
`tl.sum`, `tl.zeros`, and every helper of ours), which costs about a millisecond per
call and dominates a kernel test. A launch patches the language for its whole duration,
so the nested re-patching is redundant once the launch has patched both `tl` and
`tl.core`. `install()` makes the launch do that and the nested calls skip it.

It also memoizes the interpreter's map from Triton dtypes to numpy dtypes, which rebuilds
a dict of 19 entries on every call (about 6% of a kernel test's time, profiled).

It touches private interpreter functions: if they are not what it expects, it leaves them
alone (the tests then only run slower).
"""

from __future__ import annotations

import types


def install() -> bool:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_oscarkv_fast", False):
        return False
    both = types.FunctionType((lambda: None).__code__, {"tl": tl, "core": tl.core})
    state = {"depth": 0}

    class _NoScope:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        if state["depth"]:
            return _NoScope()
        scope = original(both)
        state["depth"] = 1
        restore = scope.restore

        def restore_and_reset() -> None:
            state["depth"] = 0
            restore()

        scope.restore = restore_and_reset
        return scope

    patch_lang._oscarkv_fast = True
    interpreter._patch_lang = patch_lang
    _memoize_np_dtype(interpreter, tl)
    return True


def _memoize_np_dtype(interpreter, tl) -> None:
    """`_get_np_dtype` maps a pointer (or a block of pointers) to uint64, and any other block to the
    numpy dtype of its element; the same answers, from a table filled on first use."""
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or not hasattr(tl, "block_type") or not hasattr(tl, "pointer_type"):
        return
    table = {}

    def get_np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return table[element]
        except KeyError:
            table[element] = found = original(element)
            return found
        except TypeError:  # an unhashable dtype: ask the original
            return original(tt_dtype)

    interpreter._get_np_dtype = get_np_dtype
