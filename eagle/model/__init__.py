"""Inference engine: ``EaModel`` and the draft heads."""


def __getattr__(name):
    # Lazy so that `import eagle.model.configs` does not import the whole engine.
    if name == "EaModel":
        from .ea_model import EaModel

        return EaModel
    raise AttributeError(f"module 'eagle.model' has no attribute {name!r}")


__all__ = ["EaModel"]
