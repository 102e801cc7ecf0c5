"""The base model as the generation loop sees it: forward passes under tree masks over a preallocated cache, the
features a draft head reads, and the backends (linear layers, attention) those passes run on."""

from eagle.model.target.target import LazyLogits, Target, TargetOutput, eagle3_layer_ids

__all__ = ["LazyLogits", "Target", "TargetOutput", "eagle3_layer_ids"]
