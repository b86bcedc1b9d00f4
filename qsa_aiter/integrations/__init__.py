"""Adapters that let serving engines call qsa_aiter's ops in place of their own (see docs/integration.md)."""
