"""Tuned tile configurations: the CSV tables and their lookup (``table``), and the tuner that measures them
(``tuner``, ``python -m qsa_aiter tune``).
"""
