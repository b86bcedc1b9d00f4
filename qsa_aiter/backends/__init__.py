"""Other libraries' kernels behind this library's contracts: the ROCm candidates (``rocm``: AITER's QSA op and top-k,
ATOM's FlyDSL prefill scorer).
"""
