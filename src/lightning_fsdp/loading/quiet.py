"""Silence the deprecation warnings that torch emits from inside this package's own calls, and nothing else.

torch 2.13 warns, on every sharded save or load, that ``ShardedTensor``, ``FSDP.state_dict_type()``,
``_get_pg_default_device`` and DCP's ``load_state_dict`` are deprecated: about 80 lines a load, all about torch's
internals, none that a user can act on. They are filtered by category and message, only while one of our calls runs;
the same warnings from the user's own code still show.

Layer: an extension of the package (docs/source-fabric/upstream.rst), not part of the core.
"""

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

#: (category, message pattern) of each warning that torch emits from inside our own calls.
_TORCH_INTERNAL_WARNINGS = (
    (FutureWarning, r".*we are deprecating ShardedTensor"),
    (FutureWarning, r"FSDP\.state_dict_type\(\) and FSDP\.set_state_dict_type\(\) are being deprecated"),
    (UserWarning, r"`_get_pg_default_device` will be deprecated"),
    (UserWarning, r"Multiple backends are registered with this ProcessGroup"),
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed in future versions"),
)


@contextmanager
def torch_internal_warnings_silenced() -> Iterator[None]:
    """Run the block with torch's warnings about its own deprecated internals filtered out."""
    with warnings.catch_warnings():
        for category, message in _TORCH_INTERNAL_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield
