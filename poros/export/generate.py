"""Try a trained adapter: text generation through the streamed model, with a KV cache on the device.

``poros generate --adapter DIR --prompt ...`` and ``PorosModel.generate`` / ``PorosTrainer.generate``
all come here. Generation is transformers' own ``generate`` on the wrapped (PEFT) model: the
decoding loop, logits processors, sampling and the KV cache (``DynamicCache``, or the family's
hybrid cache) are HF's. Poros changes only where the frozen blocks live: without grad the
streamed trunk runs HF's own forward with each decoder layer fetched just before it runs and
released after (``StreamingExecutor._trunk_without_grad``), so a model that does not fit the
device generates one block at a time, and the cache -- prompt and generated tokens -- stays on the
device. Greedy decoding gives the tokens the resident PEFT model gives (tested per family).

Notable choices:

* **Eval mode while generating.** ``generate`` switches the model to ``eval()`` (no dropout) and
  back to the mode it had; a training run can call it between steps.
* **Chat template by default.** ``chat=None`` applies the tokenizer's chat template when it has one
  (an instruction-tuned base or adapter); ``chat=False`` feeds the prompt as raw text.
* **Greedy unless a temperature is given.** ``temperature=0`` (the default) is greedy decoding
  whatever the checkpoint's ``generation_config`` says; ``temperature > 0`` samples (``top_p``,
  ``seed``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from poros.errors import ConfigError

#: what ``poros generate`` and :func:`generate_text` produce unless told otherwise
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class Generation:
    """One prompt's continuation.

    Attributes:
        prompt: the prompt as given.
        text: the generated text (special tokens removed), without the prompt.
        token_ids: the generated token ids, without the prompt.
        prompt_tokens: tokens fed to the model (the chat template included).
        seconds: wall time of ``generate`` (prefill and decoding).
    """

    prompt: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else float("inf")

    def summary(self) -> str:
        new = len(self.token_ids)
        return (f"poros: {new} new token{'' if new == 1 else 's'} after a {self.prompt_tokens}-token prompt in "
                f"{self.seconds:.2f} s: {self.tokens_per_second:.1f} tokens/s")


@contextmanager
def generation_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) and no grad for the duration, then the mode the model had: a training run
    can generate between steps. ``PorosModel.generate`` runs HF's ``generate`` inside it."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def generate(model: nn.Module, input_ids: torch.Tensor | None = None, **generate_kwargs: Any) -> torch.Tensor:
    """transformers' ``generate`` on ``model`` in eval mode, without grad, with a KV cache (``use_cache=True``
    unless given); returns the ids, prompt included, as HF does. A prepared model's own ``generate``
    (:meth:`PorosModel.generate`) does the same, its trunk streaming.

    Args:
        model: an HF causal LM or a PEFT model around one (streamed or not).
        input_ids, **generate_kwargs: as for ``GenerationMixin.generate`` (``attention_mask``,
            ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p``, ``streamer``...).
    """
    generate_kwargs.setdefault("use_cache", True)
    with generation_mode(model):
        return model.generate(input_ids=input_ids, **generate_kwargs)


def check_prompt(prompt: str) -> None:
    """Refuse a prompt with nothing in it, before a model is loaded or a kernel runs: raw, it is zero tokens
    (bitsandbytes' CPU 4-bit kernel divides by the row count); wrapped in a chat template, the model
    answers a turn the user never wrote.

    Raises:
        ConfigError: ``prompt`` is empty or only whitespace.
    """
    if not prompt.strip():
        raise ConfigError(f"the prompt is {'empty' if not prompt else 'only whitespace'} ({prompt!r}); expected "
                          "some text to continue. Fix: pass --prompt \"your text\" (or --prompt - and text on stdin).")


def generate_text(model: nn.Module, tokenizer: Any, prompt: str, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                  temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, chat: bool | None = None,
                  streamer: Any = None) -> Generation:
    """Generate a continuation of ``prompt`` (see the module notes for the defaults).

    Args:
        model: a :class:`~poros.dropin.model.PorosModel` (or an HF/PEFT causal LM).
        tokenizer: the tokenizer the adapter was trained with.
        max_new_tokens: tokens to generate at most (fewer when the model ends its answer).
        temperature: 0 for greedy decoding; above 0 samples with this temperature.
        top_p: nucleus sampling mass (sampling only).
        seed: seeds torch's generators before sampling (``torch.manual_seed``).
        chat: apply the tokenizer's chat template (a user turn and the generation prompt); None: when
            the tokenizer has one.
        streamer: an HF streamer (e.g. ``transformers.TextStreamer``) that prints tokens as they come.

    Raises:
        ConfigError: an empty prompt (:func:`check_prompt`), no tokenizer, ``max_new_tokens < 1``, a negative
            temperature, ``top_p`` outside (0, 1], ``chat=True`` with a tokenizer that has no chat template,
            or a prompt the tokenizer turns into no token.
    """
    check_prompt(prompt)
    if tokenizer is None:
        raise ConfigError("generating text needs the tokenizer, and this model has none. Pass the checkpoint's "
                          "tokenizer, or call model.generate(input_ids=...) with token ids.")
    if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens}, temperature={temperature}, top_p={top_p}: expected "
                          "max_new_tokens >= 1, temperature >= 0 (0 is greedy) and 0 < top_p <= 1.")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat and not has_template:
        raise ConfigError("chat=True but the tokenizer has no chat template. Leave chat unset (raw prompt), or use "
                          "a tokenizer with a chat_template.")
    text = prompt
    if chat or (chat is None and has_template):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    device = _input_device(model)
    encoded = tokenizer(text, return_tensors="pt", add_special_tokens=not (chat or (chat is None and has_template)))
    input_ids = encoded["input_ids"].to(device)
    if input_ids.shape[1] == 0:  # a kernel would run on an empty input
        raise ConfigError(f"the prompt {prompt!r} tokenizes to no token; expected at least one. Fix: pass a prompt "
                          "the tokenizer keeps, or leave --chat on to wrap it in the chat template.")
    options: dict[str, Any] = dict(attention_mask=encoded["attention_mask"].to(device),
                                   max_new_tokens=max_new_tokens, streamer=streamer)
    if temperature > 0:
        options.update(do_sample=True, temperature=temperature, top_p=top_p)
    else:
        options.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if tokenizer.pad_token_id is not None:
        options["pad_token_id"] = tokenizer.pad_token_id
    if seed is not None:
        torch.manual_seed(seed)
    _synchronize(device)
    start = time.perf_counter()
    output = generate(model, input_ids, **options)  # eval mode, no grad, a KV cache: for any model
    _synchronize(device)
    seconds = time.perf_counter() - start
    new_ids = output[0, input_ids.shape[1]:].tolist()
    return Generation(prompt, tokenizer.decode(new_ids, skip_special_tokens=True), new_ids,
                      int(input_ids.shape[1]), seconds)


def _input_device(model: nn.Module) -> torch.device:
    """Where token ids go: the compute device (a streamed model's embeddings may live on the host)."""
    store = getattr(model, "store", None)
    if store is not None:
        return store.device
    return model.get_input_embeddings().weight.device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
