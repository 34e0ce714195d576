"""transformers' own GGUF loading, for the tests that take it as their reference, without
two costs of its loader that change nothing it returns: it parses the whole file (the
tokenizer's ~49k strings and merges included) once for the config and again for the
weights or the tokenizer, and it builds gguf's tensor-name map afresh for every submodule
of the model (~400 for SmolLM2-135M). Both are pure functions of their arguments, so while
``memoized_gguf()`` is active each is computed once: the embedded SmolLM2's load took 13.8 s
on a 2-core machine, 6.9 s with these (the same state dict and config, checked equal)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock


@contextlib.contextmanager
def memoized_gguf() -> Iterator[None]:
    """transformers imports ``gguf.GGUFReader`` and ``gguf.get_tensor_name_map`` at each
    call, so patching the module's attributes reaches it. The readers are only read (a
    memory map of the file), so one per file serves every load in the block."""
    import gguf

    readers: dict[tuple[Any, ...], Any] = {}
    real_reader = gguf.GGUFReader

    def reader(path: Any, *args: Any, **kw: Any) -> Any:
        key = (os.path.realpath(path), os.stat(path).st_mtime_ns, args,
               tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kw)
        return readers[key]

    with mock.patch.object(gguf, "GGUFReader", reader), \
            mock.patch.object(gguf, "get_tensor_name_map",
                              functools.cache(gguf.get_tensor_name_map)):
        yield
