"""Chat web UI comparing EAGLE speculative decoding with plain decoding (``python -m eagle.application.webui``)."""
