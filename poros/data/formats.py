"""Dataset formats: detect which one a dataset is in, and normalize its records into :class:`Example`.

Six formats, told apart by their columns (checked in this order, first match wins):

==================== ================================================ ============================
format               columns                                          becomes
==================== ================================================ ============================
``messages``         ``messages``: ``[{role, content}, ...]``          the conversation
``sharegpt``         ``conversations``: ``[{from, value}, ...]``       the conversation, roles mapped
``oasst1``           ``message_id, parent_id, text, role,              one conversation per message
                     message_tree_id`` (+ ``rank, deleted``)           tree: its best-ranked path
``prompt_completion`` ``prompt`` + ``completion`` (strings, or lists    prompt + completion; loss on
                     of messages: TRL's conversational form)          the completion only
``alpaca``           ``instruction`` + ``output`` (+ ``input``)        user / assistant pair
``text``             ``text``                                         plain text, all trained
==================== ================================================ ============================

Everything here is plain Python: no torch, no transformers, no datasets.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poros.errors import DataError

FORMATS = ("text", "messages", "prompt_completion", "alpaca", "sharegpt", "oasst1")

#: the columns that identify each format, in detection order (first match wins). ``text`` comes
#: last because alpaca and oasst1 datasets carry a ``text`` column too.
REQUIRED_COLUMNS: tuple[tuple[str, frozenset[str]], ...] = (
    ("messages", frozenset({"messages"})),
    ("sharegpt", frozenset({"conversations"})),
    ("oasst1", frozenset({"message_id", "parent_id", "text", "role", "message_tree_id"})),
    ("prompt_completion", frozenset({"prompt", "completion"})),
    ("alpaca", frozenset({"instruction", "output"})),
    ("text", frozenset({"text"})),
)

#: one line per format for error messages and docs.
FORMAT_HELP = {
    "messages": "messages: a 'messages' column of [{'role': ..., 'content': ...}, ...]",
    "sharegpt": "sharegpt: a 'conversations' column of [{'from': 'human'|'gpt'|'system', 'value': ...}, ...]",
    "oasst1": "oasst1: the OpenAssistant/oasst1 columns (message_id, parent_id, text, role, message_tree_id, "
              "rank, deleted)",
    "prompt_completion": "prompt_completion: 'prompt' and 'completion' columns (strings, or lists of messages)",
    "alpaca": "alpaca: 'instruction' and 'output' columns (+ optional 'input')",
    "text": "text: a 'text' column",
}

#: ShareGPT ``from`` values -> chat roles.
SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool",
}
#: the roles chat templates know; another role in a ``messages`` column is named in errors.
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "function", "developer", "ipython"})


def unknown_roles(examples: Iterable[Example]) -> list[str]:
    """The message roles of conversation examples that are not :data:`CHAT_ROLES`, sorted."""
    return sorted({message["role"] for example in examples for message in example.messages} - CHAT_ROLES)


def unknown_roles_hint(roles: Sequence[str]) -> str:
    """The fix for conversations whose roles are not chat roles (e.g. ShareGPT's human/gpt in 'messages')."""
    return (f"the roles {list(roles)} are not chat roles (expected user, assistant, system, tool); only 'assistant' "
            "turns are trained. Fix: map them to user/assistant (ShareGPT's human -> user, gpt -> assistant), or "
            "store ShareGPT data under 'conversations' with 'from'/'value' keys, which Poros maps itself")


#: oasst1 ``role`` values -> chat roles.
OASST1_ROLES = {"prompter": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class Example:
    """One normalized example, before tokenization.

    Attributes:
        kind: ``"conversation"`` (``messages`` + ``trained_turns``), ``"text"`` (``text``) or
            ``"prompt_completion"`` (``prompt`` + ``completion``, plain strings).
        messages: the conversation, as chat-template messages ``{"role", "content"}``.
        trained_turns: indices into ``messages`` whose tokens get loss: every assistant message,
            except for conversational prompt/completion, where only the completion's assistant
            messages are trained (an assistant turn inside the prompt, e.g. a few-shot example, is
            context).
        text: the plain text of a ``"text"`` example.
        prompt: the prompt of a ``"prompt_completion"`` example (no loss).
        completion: the completion of a ``"prompt_completion"`` example (loss).
    """

    kind: str
    messages: tuple[Mapping[str, Any], ...] = ()
    trained_turns: tuple[int, ...] = ()
    text: str = ""
    prompt: str = ""
    completion: str = ""

    @classmethod
    def conversation(cls, messages: Sequence[Mapping[str, Any]], trained_turns: Iterable[int] | None = None) -> Example:
        """A conversation; ``trained_turns`` defaults to every assistant message."""
        messages = tuple(messages)
        if trained_turns is None:
            trained_turns = (i for i, message in enumerate(messages) if message["role"] == "assistant")
        return cls("conversation", messages=messages, trained_turns=tuple(trained_turns))


def _columns_of(records_or_columns: Any) -> list[str]:
    if hasattr(records_or_columns, "column_names") and not isinstance(records_or_columns, Mapping):
        names = records_or_columns.column_names  # datasets.Dataset (a DatasetDict has a dict of them)
        if isinstance(names, Mapping):
            names = next(iter(names.values()), [])
        return list(names)
    if isinstance(records_or_columns, Mapping):
        return list(records_or_columns)
    items = list(records_or_columns)
    if not items:
        raise DataError("cannot detect the format of an empty dataset: it has no records and no columns; "
                        "expected at least one record. Fix: check the file or split you pointed at")
    if all(isinstance(item, str) for item in items):
        return items
    if isinstance(items[0], Mapping):
        return list(items[0])
    raise DataError(f"cannot detect a format from a {type(items[0]).__name__}: expected records (dicts) or "
                    "column names (strings). Fix: pass the list of records load_records returns")


def detect_format(records_or_columns: Any) -> str:
    """The format of a dataset, from its columns.

    Args:
        records_or_columns: a list of records (dicts: the first record's keys are the columns), a
            single record, a list of column names, or a ``datasets.Dataset``.

    Returns:
        One of :data:`FORMATS`. The first entry of :data:`REQUIRED_COLUMNS` whose columns are
        all present wins, so a dataset with both ``messages`` and ``text`` is ``"messages"``.

    Raises:
        DataError: empty input, or no format's columns are present; the message lists the columns
            found and the formats Poros knows.
    """
    columns = _columns_of(records_or_columns)
    present = set(columns)
    for fmt, required in REQUIRED_COLUMNS:
        if required <= present:
            return fmt
    known = "\n  ".join(FORMAT_HELP[fmt] for fmt, _ in REQUIRED_COLUMNS)
    raise DataError(
        f"cannot tell the dataset's format from its columns {sorted(columns)}; expected one of:\n  {known}\n"
        "Fix: rename your columns to one of these (e.g. {'text': ...} for plain text, or "
        "{'prompt': ..., 'completion': ...})"
    )


# -- per-format normalization -------------------------------------------------------------------
def _field(record: Mapping[str, Any], name: str, index: int, fmt: str) -> Any:
    if name not in record:
        raise DataError(f"record {index} has no {name!r} column (found {sorted(record)}); the {fmt} format needs it "
                        f"({FORMAT_HELP[fmt]}). Fix: give every record the same columns")
    return record[name]


def _string(value: Any, what: str, index: int) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"record {index}: {what} is a {type(value).__name__} ({_preview(value)}), expected a string. "
                        "Fix: store it as text")
    return value


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _content(value: Any, index: int) -> str:
    """A message content: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list) and all(isinstance(part, Mapping) for part in value):
        kinds = {part.get("type") for part in value}
        if kinds <= {"text"}:
            return "".join(_string(part.get("text"), "a text part", index) for part in value)
        raise DataError(f"record {index}: a message has content parts of types {sorted(map(str, kinds))}; Poros "
                        "trains text-only models and reads only {'type': 'text'} parts. Fix: drop the other parts")
    raise DataError(f"record {index}: a message content is a {type(value).__name__} ({_preview(value)}), expected a "
                    "string. Fix: store message contents as text")


def _message_list(value: Any, what: str, index: int) -> list[Any]:
    if isinstance(value, str):  # CSV cells and some hub datasets hold the list as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise DataError(f"record {index}: {what} is a string that is not JSON ({error}); expected a list of "
                            "messages. Fix: store it as a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
        raise DataError(f"record {index}: {what} is {_preview(value)}, expected a list of message objects. "
                        "Fix: store it as [{'role': ..., 'content': ...}, ...]")
    return value


def _messages(value: Any, what: str, index: int) -> list[dict[str, Any]]:
    messages = []
    for message in _message_list(value, what, index):
        if "role" not in message or "content" not in message:
            raise DataError(f"record {index}: a message in {what} has keys {sorted(message)}, expected 'role' and "
                            "'content'. Fix: use {'role': 'user'|'assistant'|'system', 'content': ...}")
        normalized = dict(message)
        normalized["role"] = _string(message["role"], "a message role", index)
        normalized["content"] = _content(message["content"], index)
        messages.append(normalized)
    return messages


def _messages_example(record: Mapping[str, Any], index: int) -> Example:
    return Example.conversation(_messages(_field(record, "messages", index, "messages"), "'messages'", index))


def _sharegpt_example(record: Mapping[str, Any], index: int) -> Example:
    messages = []
    for turn in _message_list(_field(record, "conversations", index, "sharegpt"), "'conversations'", index):
        speaker = turn.get("from", turn.get("role"))
        role = SHAREGPT_ROLES.get(str(speaker).lower())
        if role is None:
            raise DataError(f"record {index}: a ShareGPT turn comes from {speaker!r}; expected one of "
                            f"{sorted(SHAREGPT_ROLES)}. Fix: map it to human, gpt or system")
        messages.append({"role": role, "content": _content(turn.get("value", turn.get("content")), index)})
    return Example.conversation(messages)


def _alpaca_example(record: Mapping[str, Any], index: int) -> Example:
    instruction = _string(_field(record, "instruction", index, "alpaca"), "'instruction'", index)
    extra_input = _string(record.get("input"), "'input'", index)
    output = _string(_field(record, "output", index, "alpaca"), "'output'", index)
    user = f"{instruction}\n\n{extra_input}" if extra_input.strip() else instruction
    return Example.conversation([{"role": "user", "content": user}, {"role": "assistant", "content": output}])


def _prompt_completion_example(record: Mapping[str, Any], index: int) -> Example:
    prompt = _field(record, "prompt", index, "prompt_completion")
    completion = _field(record, "completion", index, "prompt_completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        return Example("prompt_completion", prompt=prompt, completion=completion)
    if isinstance(prompt, (list, str)) and isinstance(completion, (list, str)):
        try:
            prompt_messages = _messages(prompt, "'prompt'", index)
            completion_messages = _messages(completion, "'completion'", index)
        except DataError as error:
            raise DataError(f"{error} (record {index} mixes a string and a list of messages between 'prompt' and "
                            "'completion'; both must be strings, or both lists of messages)") from None
        trained = [len(prompt_messages) + i for i, message in enumerate(completion_messages)
                   if message["role"] == "assistant"]
        return Example.conversation(prompt_messages + completion_messages, trained)
    raise DataError(f"record {index}: 'prompt' is a {type(prompt).__name__} and 'completion' a "
                    f"{type(completion).__name__}; expected two strings or two lists of messages")


def _text_example(record: Mapping[str, Any], index: int) -> Example:
    return Example("text", text=_string(_field(record, "text", index, "text"), "'text'", index))


def _is_true(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _rank(value: Any) -> float | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    rank = float(value)
    return None if rank != rank else rank  # NaN (pandas' missing value) ranks last, like None


def _oasst1_examples(records: Sequence[Mapping[str, Any]]) -> list[Example]:
    """One conversation per message tree: the best-ranked path from the root down to a leaf.

    Deleted messages are dropped with their subtrees. At each step the child with the lowest
    ``rank`` is taken (0 is best; ``None`` ranks after every number); ties go to the earlier
    ``created_date``, then the smaller ``message_id``. Trailing prompter messages are cut (they
    have no reply to train on) and a tree without an assistant reply gives no example.
    """
    tree_order: dict[Any, None] = {}
    children: dict[Any, list[Mapping[str, Any]]] = {}
    roots: dict[Any, Mapping[str, Any]] = {}
    for index, record in enumerate(records):
        for name in ("message_id", "parent_id", "text", "role", "message_tree_id"):
            _field(record, name, index, "oasst1")
        _string(record["text"], "'text'", index)
        tree_order.setdefault(record["message_tree_id"], None)
        if _is_true(record.get("deleted")):
            continue
        if record["role"] not in OASST1_ROLES:
            raise DataError(f"record {index}: oasst1 role {record['role']!r}, expected one of {sorted(OASST1_ROLES)}")
        if record["parent_id"] in (None, ""):
            roots[record["message_tree_id"]] = record
        else:
            children.setdefault(record["parent_id"], []).append(record)

    def preference(message: Mapping[str, Any]) -> tuple:
        rank = _rank(message.get("rank"))
        return (rank is None, rank or 0.0, str(message.get("created_date") or ""), str(message["message_id"]))

    examples = []
    for tree_id in tree_order:
        node = roots.get(tree_id)
        path = []
        while node is not None:
            path.append({"role": OASST1_ROLES[node["role"]], "content": node["text"] or ""})
            replies = children.get(node["message_id"])
            node = min(replies, key=preference) if replies else None
        while path and path[-1]["role"] == "user":
            path.pop()
        if path:
            examples.append(Example.conversation(path))
    return examples


_NORMALIZERS = {
    "messages": _messages_example,
    "sharegpt": _sharegpt_example,
    "prompt_completion": _prompt_completion_example,
    "alpaca": _alpaca_example,
    "text": _text_example,
}


def to_examples(records: Sequence[Mapping[str, Any]], fmt: str) -> list[Example]:
    """Normalize records of a known format into examples.

    Args:
        records: the dataset's records (dicts), e.g. from :func:`poros.data.load_records`.
        fmt: one of :data:`FORMATS` (usually from :func:`detect_format`).

    Returns:
        One :class:`Example` per record; for ``oasst1``, one per message tree that has an
        assistant reply (see :func:`_oasst1_examples` for how the path is chosen). ShareGPT roles
        are mapped (human/user -> user, gpt/assistant/chatgpt -> assistant, system -> system);
        alpaca becomes a user turn (``instruction``, plus ``"\\n\\n" + input`` when ``input`` is not
        blank) and an assistant turn (``output``).

    Raises:
        DataError: unknown ``fmt``; a record lacks a column of its format, or a value has the
            wrong type (the message names the record index and the expected shape).
    """
    if fmt == "oasst1":
        return _oasst1_examples(records)
    normalize = _NORMALIZERS.get(fmt)
    if normalize is None:
        raise DataError(f"unknown dataset format {fmt!r}; expected one of {list(FORMATS)}")
    examples = []
    for index, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise DataError(f"record {index} is a {type(record).__name__} ({_preview(record)}), expected an object "
                            "(dict) of columns")
        examples.append(normalize(record, index))
    return examples


__all__ = ["CHAT_ROLES", "FORMATS", "FORMAT_HELP", "Example", "detect_format", "to_examples", "unknown_roles",
           "unknown_roles_hint"]
