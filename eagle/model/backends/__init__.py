"""What the base model's and the draft head's forward passes run on: linear-layer backends (``linear``: the
interface and the real-rows context; ``onednn``: packed CPU weights; ``gguf``: a GGUF file's blocks on the native
kernels; ``registry``: the backends by name) and the attention path under tree masks (``attention``, the one module
touching transformers' attention internals)."""
