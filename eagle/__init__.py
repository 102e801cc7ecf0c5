"""EAGLE: lossless speculative decoding with draft heads (EAGLE-1, EAGLE-2 dynamic trees, EAGLE-3)."""

__version__ = "3.0.0"
