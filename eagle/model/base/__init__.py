"""The base model as the generation loop sees it: forward passes under tree masks over a preallocated cache, the
features a draft head reads. The backends those passes run on (linear layers, attention) are
:mod:`eagle.model.backends`, beside this package: the draft heads use them too."""

from eagle.model.base.target import LazyLogits, Target, TargetOutput, eagle3_layer_ids

__all__ = ["LazyLogits", "Target", "TargetOutput", "eagle3_layer_ids"]
