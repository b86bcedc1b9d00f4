"""Triton scoring kernels, one module each; ``common`` holds the device helpers and launch arguments they share."""
