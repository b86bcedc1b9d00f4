"""Index-cache formats: their layouts, quantisers and dequantisers (``formats``), the in-kernel decoders
(``dequant``: ``KV_KIND`` codes, paged key gathers, PTX and portable decoders) and selection quality (``quality``).
"""
