r'''The Ollama Modelfile ``poros merge --format gguf`` writes beside the ``.gguf`` (``NAME.gguf`` ->
``NAME.Modelfile``), for ``ollama create NAME -f NAME.Modelfile``.

::

    FROM ./model.gguf
    TEMPLATE """{{ if .System }}<|im_start|>system
    {{ .System }}<|im_end|>
    {{ end }}{{ if .Prompt }}<|im_start|>user
    {{ .Prompt }}<|im_end|>
    {{ end }}<|im_start|>assistant
    {{ .Response }}<|im_end|>
    """
    PARAMETER stop "<|im_end|>"
    PARAMETER temperature 0
    ...

The grammar is Ollama's documented one (docs/modelfile.md of ollama/ollama): ``INSTRUCTION arguments``
lines, ``#`` comments, triple quotes for text over several lines, ``FROM`` a GGUF path relative to the
Modelfile, ``TEMPLATE`` in Go template syntax with ``.System``, ``.Prompt`` and ``.Response``, one
``PARAMETER stop`` per stop sequence.

**The template is the tokenizer's chat template, converted by rendering it.** A Jinja template cannot
be translated to Go in general; but a chat template whose turns are fixed text around each message is
determined by what it renders. :func:`chat_turns` renders the tokenizer's template for marker
messages (a user turn alone, with a generation prompt, after a system message, an exchange followed
by another user turn), reads the text around each role's content, and keeps the result only if
those pieces put together rebuild every one of the renders exactly. A template that does more (a
default system prompt, reasoning blocks in past turns, tools) gets no ``TEMPLATE`` line but a comment
saying why: Ollama then falls back to its own reading of the GGUF's ``tokenizer.chat_template``.

**PARAMETER defaults are ``poros generate``'s**: greedy (``temperature 0``, no repeat penalty) and
its ``max_new_tokens`` as ``num_predict``, so ``ollama run`` answers as ``poros generate`` does; the
stop sequences are the special tokens that end an assistant turn or open the next, and EOS.
'''

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

#: the suffix of the Modelfile written beside NAME.gguf (NAME.Modelfile: two exports in one directory keep theirs)
MODELFILE_SUFFIX = ".Modelfile"
#: marker contents no chat template changes (plain ASCII words)
MARKERS = {"system": "PorosSystemMarker", "user": "PorosUserMarker", "assistant": "PorosAssistantMarker",
           "user2": "PorosSecondUserMarker"}


@dataclass(frozen=True)
class ChatTurns:
    """A chat template as fixed text around each message: ``system`` = (before, after) the system message, and
    so for ``user`` and ``assistant``; ``generation``: what opens the assistant's answer (its ``before``)."""

    system: tuple[str, str]
    user: tuple[str, str]
    assistant: tuple[str, str]

    def go_template(self) -> str:
        """The turns in Ollama's Go template syntax (``.System``, ``.Prompt``, ``.Response``)."""
        (s0, s1), (u0, u1), (a0, a1) = self.system, self.user, self.assistant
        return (f"{{{{ if .System }}}}{s0}{{{{ .System }}}}{s1}{{{{ end }}}}"
                f"{{{{ if .Prompt }}}}{u0}{{{{ .Prompt }}}}{u1}{{{{ end }}}}{a0}{{{{ .Response }}}}{a1}")


def _render(tokenizer: Any, messages: list[tuple[str, str]], generation: bool) -> str:
    return tokenizer.apply_chat_template([{"role": role, "content": MARKERS[key]} for role, key in messages],
                                         tokenize=False, add_generation_prompt=generation)


def _around(text: str, marker: str) -> tuple[str, str]:
    before, found, after = text.partition(marker)
    if not found or marker in after:
        raise ValueError(f"the marker {marker} is not rendered once")
    return before, after


def chat_turns(tokenizer: Any) -> ChatTurns | str:
    """The tokenizer's chat template as :class:`ChatTurns`, or a short reason it is not fixed text around each
    message (no template, or pieces that do not rebuild every render)."""
    if not getattr(tokenizer, "chat_template", None):
        return "the tokenizer has no chat template"
    try:
        alone = _render(tokenizer, [("user", "user")], False)
        user = _around(alone, MARKERS["user"])
        generation = _render(tokenizer, [("user", "user")], True).removeprefix(alone)
        exchange = _around(_render(tokenizer, [("user", "user"), ("assistant", "assistant")], False),
                           MARKERS["assistant"])
        if not exchange[0].startswith(alone):
            return "an assistant turn changes the user turn before it"
        assistant = (exchange[0].removeprefix(alone), exchange[1])
        with_system = _render(tokenizer, [("system", "system"), ("user", "user")], False)
        system_before, rest = _around(with_system, MARKERS["system"])
        if not rest.endswith(alone):
            return "a system message changes the user turn after it"
        turns = ChatTurns((system_before, rest.removesuffix(alone)), user, assistant)
    except Exception as error:  # a template that raises on plain roles (tools only, strict alternation...)
        return f"rendering it for plain messages failed ({type(error).__name__}: {str(error)[:80]})"
    if assistant[0] != generation:
        return f"its generation prompt {generation!r} is not how it opens an assistant turn {assistant[0]!r}"
    (s0, s1), (u0, u1), (a0, a1) = turns.system, turns.user, turns.assistant
    expected = {  # each render rebuilt from the pieces, as Ollama concatenates its turns
        ((("user", "user"),), True): u0 + MARKERS["user"] + u1 + a0,
        ((("system", "system"), ("user", "user")), True): s0 + MARKERS["system"] + s1 + u0 + MARKERS["user"] + u1 + a0,
        ((("user", "user"), ("assistant", "assistant"), ("user", "user2")), True):
            u0 + MARKERS["user"] + u1 + a0 + MARKERS["assistant"] + a1 + u0 + MARKERS["user2"] + u1 + a0,
    }
    for (messages, generate), text in expected.items():
        if _render(tokenizer, list(messages), generate) != text:
            return "its turns are not fixed text around each message (a default system prompt, or past turns " \
                   "rendered differently)"
    if any("{{" in piece or '"""' in piece for piece in (s0, s1, u0, u1, a0, a1)):
        return "its text holds '{{' or '\"\"\"', which a Modelfile TEMPLATE cannot carry"
    return turns


def stop_sequences(tokenizer: Any, turns: ChatTurns | str) -> list[str]:
    """The special tokens that end an assistant turn or open a user turn, then EOS; each once."""
    specials = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    stops = []
    if isinstance(turns, ChatTurns):
        stops = [token for token in specials if token in turns.assistant[1] or token in turns.user[0]]
    eos = getattr(tokenizer, "eos_token", None)
    if eos and eos not in stops:
        stops.append(eos)
    return stops


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def modelfile_text(gguf_name: str, tokenizer: Any, max_new_tokens: int) -> str:
    """The Modelfile for ``./gguf_name`` (a file beside it) with the tokenizer's chat template and stops."""
    turns = chat_turns(tokenizer)
    lines = [f"# Written by poros merge --format gguf. Use: ollama create NAME -f {pathlib.Path(gguf_name).stem}{MODELFILE_SUFFIX}", f"FROM ./{gguf_name}"]
    if isinstance(turns, ChatTurns):
        lines.append(f'TEMPLATE """{turns.go_template()}"""')
    else:
        lines.append(f"# no TEMPLATE: the chat template is not converted ({turns}); Ollama reads the GGUF's own")
    lines += [f"PARAMETER stop {_quoted(stop)}" for stop in stop_sequences(tokenizer, turns)]
    lines += ["# poros generate's defaults: greedy, no repeat penalty, its max_new_tokens",
              "PARAMETER temperature 0", "PARAMETER repeat_penalty 1", f"PARAMETER num_predict {max_new_tokens}"]
    return "\n".join(lines) + "\n"


def modelfile_path(gguf_path: str | pathlib.Path) -> pathlib.Path:
    """``NAME.Modelfile`` beside ``NAME.gguf``."""
    gguf_path = pathlib.Path(gguf_path)
    return gguf_path.with_name(gguf_path.stem + MODELFILE_SUFFIX)


def write_modelfile(gguf_path: str | pathlib.Path, tokenizer: Any) -> pathlib.Path:
    """Write :func:`modelfile_path` of ``gguf_path`` (replacing one there) and return its path."""
    from poros.export.generate import DEFAULT_MAX_NEW_TOKENS

    gguf_path = pathlib.Path(gguf_path)
    target = modelfile_path(gguf_path)
    staging = target.with_name(f".{target.name}.partial")
    staging.write_text(modelfile_text(gguf_path.name, tokenizer, DEFAULT_MAX_NEW_TOKENS), encoding="utf-8")
    staging.replace(target)
    return target


__all__ = ["MARKERS", "MODELFILE_SUFFIX", "ChatTurns", "chat_turns", "modelfile_path", "modelfile_text", "stop_sequences",
           "write_modelfile"]
