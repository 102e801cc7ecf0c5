"""How the target's forward passes run, decided once, when the target is built: :class:`ForwardPlan`.

Everything that decides which code a forward pass of ours runs is a field of the plan, built from the model by
:meth:`ForwardPlan.build` and held by the :class:`~eagle.model.base.target.Target`; nothing is looked up in a
registry or switched around a pass, so two threads running the same model at once compute what each computes
alone. The data of one pass reach the code that reads them explicitly:

- the attention function and the query positions go down the model call as a keyword argument
  (:class:`~eagle.model.backends.attention.OurPass`), which transformers passes to the attention function
  registered when the plan was built (:mod:`eagle.model.backends.attention`);
- which rows of a pass are real (:func:`~eagle.model.backends.linear.real_rows_only`) is the one exception: the
  linear layers read it from a context variable, since transformers' modules call them with the hidden states
  alone; a context variable is the calling thread's own.

A model changed after its target was built (its linear layers moved to or off the GGUF kernels, its attention
implementation set anew) needs a new plan: :meth:`~eagle.model.base.target.Target.replan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from eagle.kernels.linear import QuantLinear
from eagle.model.backends.attention import (PASS_ARGUMENT, OurPass, QueryTemperature, base_attention, pass_attention,
                                            select_our_attention)
from eagle.model.base.model_call import ForwardOutput, ModelCall
from eagle.model.base.native_decoder import NativeDecoder, native_decoder


def runs_on_kernels(model) -> bool:
    """Whether ``model``'s linear layers compute on the GGUF kernels (:mod:`eagle.model.backends.gguf`)."""
    return any(isinstance(m, QuantLinear) and m.uses_kernels for m in model.modules())


@dataclass(frozen=True)
class ForwardPlan:
    """What a forward pass of ours over one model runs.

    ``call``: the model's forward signature (:class:`~eagle.model.base.model_call.ModelCall`). ``config``: its
    text config, naming ``attention``, our registered attention function (None: a forward written for
    transformers 4, or one that takes no more keyword arguments, called as it is, with its own attention).
    ``attend``: the attention function our passes run behind it (tree SDPA, the model's eager attention, or the
    GGUF position-ordered kernel); ``kernel_attention`` says whether it is the kernel. ``temperature``: the
    attention modules whose query temperature our attention applies to the positions a pass gives (Llama 4's NoPE
    layers; empty: none). ``native``: the :class:`~eagle.model.base.native_decoder.NativeDecoder` that runs the
    whole forward instead of the model, or None.
    """

    call: ModelCall
    config: object
    attention: str | None
    attend: Callable | None
    kernel_attention: bool
    temperature: tuple
    native: NativeDecoder | None

    @classmethod
    def build(cls, model, kernel_attention: bool | None = None) -> "ForwardPlan":
        """The plan for ``model``: the kernel's attention where ``kernel_attention`` says so (None: where its
        linear layers compute on the GGUF kernels), except for a model with a query temperature, which the kernel
        does not apply. Selects our attention in the model's config (once; see
        :func:`~eagle.model.backends.attention.select_our_attention`) and takes its query temperature over."""
        config = model.config.get_text_config()
        call = ModelCall(model)
        if call.legacy or not call.takes_extra:  # a forward that passes no pass of ours down: its own attention
            return cls(call, config, None, None, False, (), None)
        own = base_attention(config._attn_implementation_internal)
        temperature = QueryTemperature(model)
        temperature.take_over()
        kernel = (runs_on_kernels(model) if kernel_attention is None else kernel_attention) and not temperature
        native = native_decoder(model, kernel) if kernel else None
        return cls(call, config, select_our_attention(config), pass_attention(own, kernel), kernel,
                   tuple(temperature.modules), native)

    def run(self, model, *, input_ids, attention_mask, position_ids, cache, output_hidden_states, logits_to_keep,
            query_positions) -> ForwardOutput:
        """One forward pass of ours over ``model`` (as :class:`~eagle.model.base.model_call.ModelCall` takes it);
        ``query_positions`` (B, T): the positions of the new tokens, for the query temperature."""
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                      output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep)
        if self.native is not None:
            return self.native(**inputs)
        if self.attention is None:
            return self.call(model, **inputs)
        if self.config._attn_implementation_internal != self.attention:
            raise ValueError(f"The model's attention implementation was set to "
                             f"{self.config._attn_implementation_internal!r} after its target was built; call the "
                             "target's replan() to run on it.")
        ours = OurPass(self.attend, query_positions if self.temperature else None)
        return self.call(model, **inputs, extra={PASS_ARGUMENT: ours})
