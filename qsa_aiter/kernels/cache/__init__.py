"""The index cache's writer: the public op ``qsa_write_index_cache``, its kernel and its torch reference.
``SPECS`` lists the cache kernels."""

from . import writer

SPECS = (writer.SPEC,)
