"""Selection: the block top-k over scored groups, their expansion to token indices, and the whole indexer step
(``qsa_select_paged_tokens``: score, top-k, expand). ``SPECS`` lists the selection kernels (Triton);
``native_topk`` declares the CUDA top-k compiled at run time by NVRTC (``native_topk.cu``), ``grid_topk`` the grid
select (``grid_topk.cu``: a row split across the CTAs of one cooperative grid)."""

from . import expand, maxima, topk

SPECS = (topk.SPEC, maxima.SPEC, expand.SPEC)
