"""Examples -> token ids and labels, with loss only where the model should learn.

What gets loss (``labels`` equal to the token id; ``-100`` elsewhere):

* conversations: each trained assistant turn -- its content and its end-of-turn token
  (``<|im_end|>``, ``<end_of_turn>``...). Never the system or user text, never the role headers,
  never an assistant message that opens the conversation (nothing precedes it to condition on).
* prompt/completion strings: the completion and the eos token appended to it.
* text: every token (plus the eos token appended when the tokenizer has one).

Assistant spans come from per-message tokenization, not from searching the rendered text: the
conversation is rendered prefix by prefix with the chat template. ``messages[:i]`` with
``add_generation_prompt=True`` is the context before assistant turn ``i``; ``messages[:i+1]`` runs
through that turn's end. The tokens between the two are the turn, less any whitespace-only tokens
the template puts after the end-of-turn token (the ``\\n`` between ChatML turns: the model never
has to generate it). This needs every rendering to be a token prefix of the next one, which is
checked. A template that rewrites earlier turns depending on what follows (Qwen3's drops the
``<think>`` block from every assistant turn but the last) cannot label a whole multi-turn
conversation this way: such a conversation becomes one example per assistant turn (the turns
before it as context, rendered as the template renders history), with one WARNING for the
dataset; a template that is not prefix-stable even for one turn fails loudly.

Imports no torch; the tokenizer is any HF tokenizer (``PreTrainedTokenizerBase``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from poros.data.formats import Example, unknown_roles, unknown_roles_hint
from poros.errors import DataError

logger = logging.getLogger("poros.data")

IGNORE_INDEX = -100

#: The fallback chat template (Qwen-style ChatML), used when the tokenizer has none.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class TokenizedData:
    """Tokenized, loss-masked examples and what happened on the way.

    Attributes:
        examples: one dict per example: ``input_ids`` (list of int) and ``labels`` (same length;
            the token id where there is loss, ``-100`` elsewhere). At most ``seq_len`` tokens.
        format: the dataset format (one of :data:`poros.data.FORMATS`, or ``"synthetic"``).
        num_dropped: examples dropped because no trainable token was left (after truncation).
        num_truncated: kept examples that were cut to ``seq_len``.
    """

    examples: list[dict[str, list[int]]]
    format: str
    num_dropped: int = 0
    num_truncated: int = 0
    trainable_tokens: int = field(init=False)
    total_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.total_tokens = sum(len(example["input_ids"]) for example in self.examples)
        # labels[0] is never predicted (the loss shifts labels by one): only labels[1:] are loss terms
        self.trainable_tokens = sum(
            sum(label != IGNORE_INDEX for label in example["labels"][1:]) for example in self.examples
        )

    @property
    def num_examples(self) -> int:
        """How many examples were kept."""
        return len(self.examples)

    @property
    def trainable_share(self) -> float:
        """Trainable tokens / all tokens (0.0 for an empty dataset)."""
        return self.trainable_tokens / self.total_tokens if self.total_tokens else 0.0

    def __len__(self) -> int:
        return len(self.examples)

    def summary(self) -> str:
        """One line: ``data: 312 examples (messages), 41.2% of 95,410 tokens trainable, 3 truncated, 0 dropped``."""
        return (f"data: {self.num_examples:,} examples ({self.format}), {100 * self.trainable_share:.1f}% of "
                f"{self.total_tokens:,} tokens trainable, {self.num_truncated:,} truncated, "
                f"{self.num_dropped:,} dropped")


def resolve_chat_template(tokenizer: Any, chat_template: str | None = None) -> str | None:
    """The chat template to render conversations with.

    Args:
        tokenizer: an HF tokenizer.
        chat_template: an explicit Jinja template; wins when given.

    Returns:
        ``chat_template`` when given; ``None`` (meaning: the tokenizer's own) when the tokenizer
        has one; otherwise :data:`CHATML_TEMPLATE`, with a WARNING logged on ``poros.data``.
    """
    if chat_template is not None:
        return chat_template
    if getattr(tokenizer, "chat_template", None):
        return None
    logger.warning(
        "the tokenizer (%s) has no chat template: formatting conversations as ChatML "
        "(<|im_start|>role\\ncontent<|im_end|>). Pass chat_template=... to use the template your model expects",
        getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__,
    )
    return CHATML_TEMPLATE


class _NotPrefixStable(DataError):
    """The chat template rendered a conversation prefix differently from the longer conversation."""


class _ConversationTokenizer:
    """Per-message tokenization of conversations with one tokenizer and template."""

    def __init__(self, tokenizer: Any, chat_template: str | None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._blank: dict[int, bool] = {}
        self.split = 0  # conversations split into one example per assistant turn

    def per_turn(self, example: Example) -> list[tuple[list[int], list[int]]]:
        """One example per trained turn: the messages up to it, loss on that turn only."""
        results = []
        for turn in self.trained_turns(example):
            single = Example.conversation(example.messages[: turn + 1], trained_turns=[turn])
            results.append(self.labelled(single, _encode(self.tokenizer, self.texts(single),
                                                         add_special_tokens=False)))
        self.split += 1
        return results

    def render(self, messages: Sequence[Any], *, add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as error:  # jinja2 errors, raise_exception() inside templates...
            roles = [message["role"] for message in messages]
            raise DataError(
                f"the chat template failed on a conversation with roles {roles} "
                f"(add_generation_prompt={add_generation_prompt}): {type(error).__name__}: {error}. Poros renders "
                "each conversation prefix by prefix, so the template must accept every prefix that ends before an "
                "assistant turn. Fix: pass chat_template= a template that does, or fix the conversation's roles"
            ) from error

    @staticmethod
    def trained_turns(example: Example) -> list[int]:
        # An assistant message that opens the conversation has no context to condition on (chat templates
        # refuse an empty conversation): it stays context, like a greeting the model is shown.
        return sorted(set(example.trained_turns) - {0})

    def texts(self, example: Example) -> list[str]:
        """The renderings to tokenize: context and through-turn for each trained turn, then the whole."""
        messages = example.messages
        turns = self.trained_turns(example)
        if not turns:  # nothing to train on: dropped without rendering
            return []
        texts = []
        for turn in turns:
            texts.append(self.render(messages[:turn], add_generation_prompt=True))
            texts.append(self.render(messages[: turn + 1], add_generation_prompt=False))
        texts.append(self.render(messages, add_generation_prompt=False))
        return texts

    def is_blank(self, token_id: int) -> bool:
        blank = self._blank.get(token_id)
        if blank is None:
            blank = self._blank[token_id] = not self.tokenizer.decode([token_id]).strip()
        return blank

    def check_prefix(self, shorter: list[int], longer: list[int], *, what: str) -> None:
        if longer[: len(shorter)] == shorter:
            return
        at = next((i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b), len(longer))
        before = self.tokenizer.decode(shorter[at: at + 12])
        after = self.tokenizer.decode(longer[at: at + 12])
        raise _NotPrefixStable(
            f"the chat template does not render conversations prefix by prefix: the tokens of {what} differ at token "
            f"{at} ({before!r} became {after!r}). Poros labels each assistant turn as the tokens between the "
            "rendering of the messages before it (with add_generation_prompt=True) and the rendering through it, "
            "so a template must render earlier turns the same way whatever follows. Templates that rewrite past "
            "turns break this: Qwen3's drops the <think> block from all but the last assistant turn, Phi-3's ends "
            "the conversation with an extra eos. Fix: pass chat_template= a template that renders every turn the "
            "same way wherever it is (for Qwen3, TRL ships one: trl/chat_templates/qwen3_training.jinja), or split "
            "multi-turn conversations into one example per assistant turn"
        )

    def labelled(self, example: Example, token_lists: list[list[int]]) -> tuple[list[int], list[int]]:
        """``input_ids`` and ``labels`` from the token lists of :meth:`texts`, checking every prefix."""
        if not token_lists:
            return [], []
        spans = []
        previous: list[int] = []
        previous_what = "the start"
        for index, turn in enumerate(self.trained_turns(example)):
            context, through = token_lists[2 * index], token_lists[2 * index + 1]
            self.check_prefix(previous, context, what=f"{previous_what} -> messages[:{turn}] + generation prompt")
            self.check_prefix(context, through, what=f"messages[:{turn}] + generation prompt -> messages[:{turn + 1}]")
            end = len(through)
            while end > len(context) and self.is_blank(through[end - 1]):
                end -= 1
            spans.append((len(context), end))
            previous, previous_what = through, f"messages[:{turn + 1}]"
        input_ids = token_lists[-1]
        self.check_prefix(previous, input_ids, what=f"{previous_what} -> the whole conversation")
        labels = [IGNORE_INDEX] * len(input_ids)
        for start, end in spans:
            labels[start:end] = input_ids[start:end]
        return input_ids, labels


def _eos_appended(ids: list[int], eos_token_id: int | None) -> list[int]:
    return ids + [eos_token_id] if eos_token_id is not None and (not ids or ids[-1] != eos_token_id) else ids


def _encode(tokenizer: Any, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


#: examples per batched tokenizer call: one call over many short texts is several times faster.
_CHUNK = 256


def _tokenized(examples: Sequence[Example], tokenizer: Any, conversations: _ConversationTokenizer | None):
    """Yield ``(input_ids, labels)`` per example, in order, before truncation.

    Chat renderings and completions are tokenized without special tokens (a template writes its
    own BOS); a prompt or a text is tokenized as the tokenizer does by default (BOS if it adds one).
    """
    eos_token_id = getattr(tokenizer, "eos_token_id", None)
    for chunk_start in range(0, len(examples), _CHUNK):
        chunk = examples[chunk_start: chunk_start + _CHUNK]
        plain: list[str] = []  # tokenized with add_special_tokens=False
        special: list[str] = []  # tokenized with the tokenizer's default special tokens
        plans = []
        for example in chunk:
            plans.append((len(plain), len(special)))
            if example.kind == "conversation":
                plain.extend(conversations.texts(example))
            elif example.kind == "prompt_completion":
                special.append(example.prompt)
                plain.append(example.completion)
            elif example.kind == "text":
                special.append(example.text)
            else:
                raise DataError(f"unknown example kind {example.kind!r}; expected conversation, prompt_completion "
                                "or text")
        plain_ids = _encode(tokenizer, plain, add_special_tokens=False)
        special_ids = _encode(tokenizer, special, add_special_tokens=True)
        for example, (plain_at, special_at) in zip(chunk, plans):
            if example.kind == "conversation":
                turns = conversations.trained_turns(example)
                count = 2 * len(turns) + 1 if turns else 0
                try:
                    yield conversations.labelled(example, plain_ids[plain_at: plain_at + count])
                except _NotPrefixStable:
                    if len(turns) < 2:
                        raise  # not even one turn renders as a prefix: nothing to fall back to
                    yield from conversations.per_turn(example)
            elif example.kind == "prompt_completion":
                prompt_ids = special_ids[special_at]
                completion_ids = _eos_appended(plain_ids[plain_at], eos_token_id)
                yield prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids
            else:
                input_ids = _eos_appended(special_ids[special_at], eos_token_id)
                yield input_ids, list(input_ids)


def _format_of(examples: Sequence[Example]) -> str:
    kinds = {example.kind for example in examples}
    return {"conversation": "messages"}.get(kinds.pop(), examples[0].kind) if len(kinds) == 1 else "mixed"


def tokenize_examples(
    examples: Sequence[Example],
    tokenizer: Any,
    *,
    seq_len: int,
    chat_template: str | None = None,
    fmt: str | None = None,
) -> TokenizedData:
    """Tokenize examples and build their labels (loss on what the model should generate).

    Args:
        examples: from :func:`poros.data.to_examples`.
        tokenizer: an HF tokenizer (``AutoTokenizer.from_pretrained(...)``).
        seq_len: the most tokens an example keeps; longer ones keep their first ``seq_len``.
        chat_template: a Jinja chat template for conversations, instead of the tokenizer's own.
            Without either, ChatML is used and a WARNING says so.
        fmt: the dataset format recorded in the result (default: guessed from the examples).

    Returns:
        :class:`TokenizedData`. Examples with no trainable token left after truncation are
        dropped and counted in ``num_dropped``.

    Raises:
        DataError: ``seq_len`` < 2; the chat template fails on a conversation prefix or is not
            prefix-stable; no example has a trainable token (the message says why: no assistant
            turns, or assistant turns that start beyond ``seq_len``).
    """
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"seq_len must be an integer >= 2, got {seq_len!r}. Fix: pass e.g. seq_len=512")
    if not examples:
        raise DataError("no examples to tokenize: the dataset is empty after normalization (e.g. oasst1 trees "
                        "without an assistant reply). Fix: check the dataset and split")
    conversations = None
    if any(example.kind == "conversation" for example in examples):
        conversations = _ConversationTokenizer(tokenizer, resolve_chat_template(tokenizer, chat_template))
    kept: list[dict[str, list[int]]] = []
    num_truncated = 0
    longest = 0  # the longest example before truncation
    untrainable = 0  # examples with no trainable token even before truncation
    first_trainable: list[int] = []  # per truncated-away example: the index of its first trainable token
    for input_ids, labels in _tokenized(examples, tokenizer, conversations):
        # the first loss term: labels[0] is never predicted (the loss shifts labels by one), so an
        # example whose only label is its first token would give a step with no loss term (0 / 0)
        trainable_at = next((i for i, label in enumerate(labels) if i > 0 and label != IGNORE_INDEX), None)
        if trainable_at is None:
            untrainable += 1
            continue
        if trainable_at >= seq_len:
            first_trainable.append(trainable_at)
            continue
        longest = max(longest, len(input_ids))
        if len(input_ids) > seq_len:
            num_truncated += 1
            input_ids, labels = input_ids[:seq_len], labels[:seq_len]
        kept.append({"input_ids": input_ids, "labels": labels})
    if conversations is not None and conversations.split:
        logger.warning(
            "poros: the chat template renders earlier turns differently once more turns follow (Qwen3's drops "
            "<think> from past assistant turns), so %d multi-turn conversations became one example per assistant "
            "turn. To train them whole, pass chat_template= a template that renders every turn the same way "
            "(for Qwen3: trl/chat_templates/qwen3_training.jinja)", conversations.split)
    if num_truncated:  # once per dataset: the run trains on fewer tokens than the data has
        logger.warning("poros: truncated %d of %d examples to seq_len=%d tokens (each keeps its first %d; the "
                       "longest has %d). Fix: raise seq_len (up to the model's max_position_embeddings) to train "
                       "them whole", num_truncated, len(examples), seq_len, seq_len, longest)
    reasons = []
    if untrainable:
        reasons.append(f"{untrainable} had nothing to train on (a conversation needs an assistant message "
                       "after its first message)")
        roles = unknown_roles(examples)
        if roles:
            reasons.append(unknown_roles_hint(roles))
    if first_trainable:
        reasons.append(f"{len(first_trainable)} start their first trainable token beyond seq_len={seq_len} (the "
                       f"shortest context before it is {min(first_trainable)} tokens: raise seq_len above that)")
    if not kept:
        raise DataError(f"no trainable tokens in any of the {len(examples)} examples: {'; '.join(reasons)}")
    if reasons:
        logger.warning("poros: dropped %d of %d examples: %s", untrainable + len(first_trainable), len(examples),
                       "; ".join(reasons))
    return TokenizedData(kept, fmt or _format_of(examples), num_dropped=untrainable + len(first_trainable),
                         num_truncated=num_truncated)


__all__ = ["CHATML_TEMPLATE", "IGNORE_INDEX", "TokenizedData", "resolve_chat_template", "tokenize_examples"]
