"""Make the Triton CPU interpreter fast enough for CI (test infrastructure only).

The interpreter re-patches `triton.language` on every call of a device function (each
`tl.sum`, `tl.zeros`, and every helper of ours), which costs about a millisecond per
call and dominates a kernel test. A launch patches the language for its whole duration,
so the nested re-patching is redundant once the launch has patched both `tl` and
`tl.core`. `install()` makes the launch do that and the nested calls skip it. It touches
private interpreter functions: if they are not what it expects, it leaves them alone
(the tests then only run slower).
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
    return True
