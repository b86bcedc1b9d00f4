"""Scoring: the public op ``qsa_paged_mqa_logits``, its torch reference, and the scoring kernels.

``SPECS`` lists the kernels (one module each, declared by its ``SPEC``); the registry, warm-up, the ahead-of-time
builds, the tuner, the benchmark and the tests iterate over it. A new scorer is a module plus a line here.
"""

from . import keys_major, rowwise, stacked, tiled

SPECS = (tiled.SPEC, stacked.SPEC, keys_major.SPEC, rowwise.SPEC)
