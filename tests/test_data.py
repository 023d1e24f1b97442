"""poros.data: sources, formats, loss masks, truncation, batches; and the bundled tiny default.

Masks are checked by decoding: the labelled tokens of a conversation, cut into contiguous runs,
must decode to exactly each trained assistant message followed by ``<|im_end|>``; no system or
user text may ever carry a label.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poros.assets import TINY_CHAT, TINY_MODEL, asset_path
from poros.data import (
    CHATML_TEMPLATE,
    FORMATS,
    BatchIterator,
    Example,
    TokenizedData,
    detect_format,
    load_dataset,
    load_records,
    synthetic_examples,
    to_examples,
    tokenize_examples,
)
from poros.errors import DataError

DATA_DIR = pathlib.Path(__file__).parent / "data"
END = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(asset_path(TINY_MODEL))


@pytest.fixture(scope="module")
def tokenizer_without_template():
    plain = transformers.AutoTokenizer.from_pretrained(asset_path(TINY_MODEL))
    plain.chat_template = None
    return plain


def labelled_runs(tokenizer, example) -> list[str]:
    """The decoded text of each contiguous run of labelled tokens."""
    runs, current = [], []
    for token, label in zip(example["input_ids"], example["labels"]):
        if label != -100:
            assert label == token, "a label must be the token at its own position (HF shifts internally)"
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def tokenize_records(records, tokenizer, *, seq_len=256, **kwargs) -> TokenizedData:
    fmt = detect_format(records)
    return tokenize_examples(to_examples(records, fmt), tokenizer, seq_len=seq_len, fmt=fmt, **kwargs)


# -- the bundled tiny default --------------------------------------------------------------------
def _generator_module():
    from tools import make_tiny_default

    return make_tiny_default


def test_bundled_chat_is_what_the_generator_writes_and_its_arithmetic_is_right():
    lines = asset_path(TINY_CHAT).read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    assert records == _generator_module().conversations()
    assert 200 <= len(records) <= 400
    assert asset_path(TINY_CHAT).stat().st_size < 300_000
    roles = [[m["role"] for m in record["messages"]] for record in records]
    assert any(r[0] == "system" for r in roles) and any(r.count("assistant") > 1 for r in roles)
    assert all(r[-1] == "assistant" and set(r) <= {"system", "user", "assistant"} for r in roles)
    checked = 0
    for record in records:
        for message in record["messages"]:
            for a, operation, b, result in re.findall(r"(\d+) ([-+x/]) (\d+) = (\d+)\.", message["content"]):
                a, b, result = int(a), int(b), int(result)
                expected = {"+": a + b, "-": a - b, "x": a * b, "/": a // b if a % b == 0 else None}[operation]
                assert result == expected, message["content"]
                checked += 1
    assert checked > 30


def test_bundled_tokenizer_and_model(tokenizer):
    assert len(tokenizer) == 2048
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") != tokenizer.unk_token_id
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
    assert tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n")
    directory = asset_path(TINY_MODEL)
    assert len(list(directory.glob("model-*-of-*.safetensors"))) >= 2  # multi-shard, as real checkpoints
    config = transformers.AutoConfig.from_pretrained(directory)
    assert (config.model_type, config.vocab_size, config.hidden_size) == ("qwen3", 2048, 128)
    assert config.num_hidden_layers == 4
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    assert (config.intermediate_size, config.tie_word_embeddings, config.dtype) == (384, False, torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    assert model.dtype == torch.bfloat16
    ids = tokenizer.apply_chat_template(messages, tokenize=False)
    batch = tokenizer(ids, return_tensors="pt", add_special_tokens=False)
    out = model(**batch, labels=batch["input_ids"])
    assert out.logits.shape[-1] == 2048 and torch.isfinite(out.loss)


def test_asset_path_rejects_unknown_names():
    with pytest.raises(LookupError, match="poros-tiny-chat"):
        asset_path("poros-tiny-llama")


# -- format detection ------------------------------------------------------------------------------
@pytest.mark.parametrize(("columns", "expected"), [
    (["text"], "text"),
    (["messages"], "messages"),
    (["messages", "text"], "messages"),
    (["prompt", "completion"], "prompt_completion"),
    (["instruction", "input", "output"], "alpaca"),
    (["instruction", "output", "text"], "alpaca"),
    (["conversations", "id"], "sharegpt"),
    (["message_id", "parent_id", "user_id", "created_date", "text", "role", "lang", "review_count",
      "review_result", "deleted", "rank", "synthetic", "model_name", "detoxify", "message_tree_id",
      "tree_state", "emojis", "labels"], "oasst1"),
])
def test_detect_format_from_columns(columns, expected):
    assert detect_format(columns) == expected
    assert detect_format([dict.fromkeys(columns, "")]) == expected


def test_unknown_columns_raise_listing_the_columns_and_the_formats():
    with pytest.raises(DataError) as error:
        detect_format([{"question": "q", "answer": "a"}])
    message = str(error.value)
    assert "'answer'" in message and "'question'" in message
    assert all(fmt in message for fmt in FORMATS)


# -- every format, masked ------------------------------------------------------------------------------
def test_messages_label_exactly_the_assistant_turns(tokenizer):
    records = load_records(DATA_DIR / "messages.jsonl")
    data = tokenize_records(records, tokenizer)
    assert data.format == "messages" and data.num_examples == 3
    for record, example in zip(records, data.examples):
        assistant = [m["content"] + END for m in record["messages"] if m["role"] == "assistant"]
        assert labelled_runs(tokenizer, example) == assistant
        rendered = tokenizer.apply_chat_template(record["messages"], tokenize=False)
        assert tokenizer.decode(example["input_ids"]) == rendered
        labelled_text = "".join(labelled_runs(tokenizer, example))
        for message in record["messages"]:
            if message["role"] != "assistant":
                assert message["content"] not in labelled_text
    assert data.trainable_tokens == sum(label != -100 for e in data.examples for label in e["labels"])
    assert data.total_tokens == sum(len(e["input_ids"]) for e in data.examples)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]),
                                st.text(alphabet="ab XY.,?!'07\n-", max_size=24)), min_size=1, max_size=6))
def test_any_conversation_labels_exactly_its_assistant_turns(tokenizer, turns):
    messages = [{"role": role, "content": content} for role, content in turns]
    # an assistant message that opens the conversation has no context: it is not trained
    assistants = [m["content"] + END for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    if not assistants:
        with pytest.raises(DataError, match="assistant"):
            tokenize_examples([Example.conversation(messages)], tokenizer, seq_len=512)
        return
    [example] = tokenize_examples([Example.conversation(messages)], tokenizer, seq_len=512).examples
    assert labelled_runs(tokenizer, example) == assistants


def test_text_is_all_trainable_and_ends_with_eos(tokenizer):
    data = tokenize_records([{"text": "The day after Monday is Tuesday."}], tokenizer)
    [example] = data.examples
    assert example["labels"] == example["input_ids"]
    assert example["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(example["input_ids"]) == "The day after Monday is Tuesday." + END
    # every token but the first is a loss term (nothing precedes the first to predict it from)
    assert data.trainable_tokens == len(example["input_ids"]) - 1


def test_prompt_completion_strings_train_on_the_completion_only(tokenizer):
    records = load_records(DATA_DIR / "prompt_completion.csv")
    data = tokenize_records(records, tokenizer)
    assert data.format == "prompt_completion" and data.num_examples == 3
    for record, example in zip(records, data.examples):
        assert labelled_runs(tokenizer, example) == [record["completion"] + END]
        assert tokenizer.decode(example["input_ids"]) == record["prompt"] + record["completion"] + END


def test_conversational_prompt_completion_trains_the_completion_not_the_prompts_assistant_turns(tokenizer):
    record = {
        "prompt": [{"role": "system", "content": "Answer with a number."},
                   {"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"},  # few-shot
                   {"role": "user", "content": "2 + 5?"}],
        "completion": [{"role": "assistant", "content": "7"}],
    }
    [example] = tokenize_records([record], tokenizer).examples
    assert labelled_runs(tokenizer, example) == ["7" + END]


@pytest.mark.parametrize(("extra_input", "user"), [
    ("hot", "Give the opposite of the word.\n\nhot"),
    ("", "Name the capital of Japan."),
    ("   ", "Name the capital of Japan."),
])
def test_alpaca_with_and_without_input(tokenizer, extra_input, user):
    instruction = user.split("\n\n")[0]
    record = {"instruction": instruction, "input": extra_input, "output": "Tokyo"}
    [example] = to_examples([record], "alpaca")
    assert [dict(m) for m in example.messages] == [{"role": "user", "content": user},
                                                   {"role": "assistant", "content": "Tokyo"}]
    [tokenized] = tokenize_records([record], tokenizer).examples
    assert labelled_runs(tokenizer, tokenized) == ["Tokyo" + END]


def test_alpaca_input_column_is_optional():
    [example] = to_examples([{"instruction": "Say yes.", "output": "Yes."}], "alpaca")
    assert example.messages[0]["content"] == "Say yes."


def test_sharegpt_roles_are_mapped(tokenizer):
    records = load_records(DATA_DIR / "sharegpt.json")
    assert detect_format(records) == "sharegpt"
    examples = to_examples(records, "sharegpt")
    assert [[m["role"] for m in e.messages] for e in examples] == [["system", "user", "assistant"],
                                                                  ["user", "assistant"]]
    data = tokenize_examples(examples, tokenizer, seq_len=256)
    assert [labelled_runs(tokenizer, e) for e in data.examples] == [["10 / 2 = 5." + END], ["Hi!" + END]]
    with pytest.raises(DataError, match="'narrator'"):
        to_examples([{"conversations": [{"from": "narrator", "value": "Once"}]}], "sharegpt")


def test_oasst1_best_ranked_paths(tokenizer):
    records = load_records(DATA_DIR / "oasst1_sample.jsonl")
    assert detect_format(records) == "oasst1"
    conversations = [[(m["role"], m["content"]) for m in e.messages] for e in to_examples(records, "oasst1")]
    assert conversations == [
        [("user", "Can you explain what a prime number is?"),
         ("assistant", "A prime number is a whole number greater than 1 whose only divisors are 1 and itself, "
                       "like 2, 3, 5 and 7."),  # rank 0 over rank 1 and an unranked reply
         ("user", "Is 1 a prime number?"),  # rank 0 over rank 1
         ("assistant", "No. A prime needs exactly two divisors, and 1 has only one.")],  # rank 0 was deleted
        [("user", "How many days are in a week?"), ("assistant", "There are 7 days in a week.")],  # child listed first
        [("user", "¿Cuál es la capital de Francia?"),
         ("assistant", "La capital de Francia es París.")],  # tie of unranked replies: earlier one; trailing user cut
    ]  # the tree whose only reply was deleted gives nothing
    text = json.dumps(conversations)
    assert "DELETED" not in text and "should never appear" not in text
    data = tokenize_records(records, tokenizer)
    assert data.format == "oasst1" and data.num_examples == 3
    assert labelled_runs(tokenizer, data.examples[2]) == ["La capital de Francia es París." + END]


# -- chat templates -------------------------------------------------------------------------------
def test_missing_chat_template_falls_back_to_chatml_with_a_warning(tokenizer, tokenizer_without_template, caplog):
    examples = to_examples(load_records(DATA_DIR / "messages.jsonl"), "messages")
    with caplog.at_level(logging.WARNING, logger="poros.data"):
        fallback = tokenize_examples(examples, tokenizer_without_template, seq_len=256)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no chat template" in warnings[0].getMessage()
    assert "ChatML" in warnings[0].getMessage()
    # The bundled tokenizer's own template is ChatML too: same ids, same labels.
    assert fallback.examples == tokenize_examples(examples, tokenizer, seq_len=256).examples
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="poros.data"):
        tokenize_examples(examples, tokenizer_without_template, seq_len=256, chat_template=CHATML_TEMPLATE)
    assert not caplog.records  # an explicit template: nothing to warn about


def test_explicit_chat_template_wins(tokenizer):
    template = ("{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}assistant:\n{% endif %}")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    [example] = tokenize_examples([Example.conversation(messages)], tokenizer, seq_len=64,
                                  chat_template=template).examples
    assert tokenizer.decode(example["input_ids"]) == "user:\nHi<|im_end|>assistant:\nHello.<|im_end|>"
    assert labelled_runs(tokenizer, example) == ["Hello." + END]


def test_template_that_rewrites_earlier_turns_splits_conversations_per_turn(tokenizer, caplog):
    # Marks the last assistant message, as templates that strip <think> from past turns do.
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if loop.last and m['role'] == 'assistant' %}"
                "[final] {% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with caplog.at_level("WARNING", logger="poros.data"):
        data = tokenize_examples([Example.conversation(messages)], tokenizer, seq_len=64, chat_template=template)
    first, second = data.examples
    assert labelled_runs(tokenizer, first) == ["[final] b" + END]
    assert labelled_runs(tokenizer, second) == ["[final] d" + END]
    # the second example's context is the history as the template renders it (no [final] on b)
    assert "assistant\nb" + END in tokenizer.decode(second["input_ids"])
    assert "1 multi-turn conversations became one example per assistant turn" in caplog.text


def test_template_not_prefix_stable_for_one_turn_is_rejected(tokenizer):
    # The generation prompt is not how the template renders an assistant turn: no fallback can label it.
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant:\n{% endif %}")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(DataError, match="prefix by prefix"):
        tokenize_examples([Example.conversation(messages)], tokenizer, seq_len=64, chat_template=template)


def _trl_chat_template(name: str) -> str:
    """A real model's chat template, as TRL ships it (read from disk; trl itself is not imported)."""
    spec = importlib.util.find_spec("trl")
    if spec is None:
        pytest.skip("trl (a test dependency) is not installed")
    return (pathlib.Path(spec.submodule_search_locations[0]) / "chat_templates" / f"{name}.jinja").read_text()


MULTI_TURN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
              {"role": "assistant", "content": "5."}, {"role": "user", "content": "And 4 + 4?"},
              {"role": "assistant", "content": "8."}]


@pytest.mark.parametrize(("template_name", "end_of_turn", "header"), [
    ("qwen2_5", "<|im_end|>", ""),
    ("qwen3_training", "<|im_end|>", "<think>\n\n</think>\n\n"),  # the empty think block is the model's to write
    ("gemma3", "<end_of_turn>", ""),
    ("gemma4", "<turn|>", ""),
])
def test_real_model_templates_label_the_assistant_turns(tokenizer, template_name, end_of_turn, header):
    [example] = tokenize_examples([Example.conversation(MULTI_TURN)], tokenizer, seq_len=512,
                                  chat_template=_trl_chat_template(template_name)).examples
    assert labelled_runs(tokenizer, example) == [header + "5." + end_of_turn, header + "8." + end_of_turn]


def test_qwen3_template_trains_multi_turn_one_assistant_turn_at_a_time(tokenizer, caplog):
    template = _trl_chat_template("qwen3")  # Qwen3's own: drops <think> from past assistant turns
    [single] = tokenize_examples([Example.conversation(MULTI_TURN[:3])], tokenizer, seq_len=512,
                                 chat_template=template).examples
    assert labelled_runs(tokenizer, single) == ["<think>\n\n</think>\n\n5.<|im_end|>"]
    with caplog.at_level("WARNING", logger="poros.data"):
        first, second = tokenize_examples([Example.conversation(MULTI_TURN)], tokenizer, seq_len=512,
                                          chat_template=template).examples
    assert first == single
    assert labelled_runs(tokenizer, second) == ["<think>\n\n</think>\n\n8.<|im_end|>"]
    assert "qwen3_training.jinja" in caplog.text


def test_template_that_raises_becomes_a_data_error(tokenizer):
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DataError, match="roles must alternate"):
        tokenize_examples([Example.conversation([{"role": "user", "content": "a"},
                                                 {"role": "assistant", "content": "b"}])],
                          tokenizer, seq_len=64, chat_template=template)


# -- truncation, dropping, nothing trainable --------------------------------------------------------
def test_an_example_whose_only_label_is_its_first_token_is_dropped(tokenizer):
    """labels[0] is never a loss term (the loss shifts labels by one): an empty text (eos only) would
    give a step with num_items_in_batch 0, a 0/0 loss."""
    data = tokenize_examples(to_examples([{"text": ""}, {"text": "Hello world"}], "text"), tokenizer, seq_len=64)
    assert data.num_examples == 1 and data.num_dropped == 1
    [example] = data.examples
    assert data.trainable_tokens == len(example["labels"]) - 1  # every label but the first is a loss term


def test_synthetic_data_without_a_tokenizer_takes_the_vocabulary_size():
    data = load_dataset("synthetic", None, seq_len=16, vocab_size=100)
    assert all(max(example["input_ids"]) < 100 for example in data.examples)
    with pytest.raises(DataError, match="vocab_size"):
        load_dataset("synthetic", None, seq_len=16)


def test_local_files_with_a_byte_order_mark(tmp_path):
    """Excel's "CSV UTF-8" and Notepad start files with a BOM; it is not part of the first column name."""
    csv_file = tmp_path / "data.csv"
    csv_file.write_text("text\nhello\n", encoding="utf-8-sig")
    jsonl_file = tmp_path / "data.jsonl"
    jsonl_file.write_text('{"text": "hello"}\n', encoding="utf-8-sig")
    assert load_records(str(csv_file)) == [{"text": "hello"}]
    assert load_records(str(jsonl_file)) == [{"text": "hello"}]



def test_truncation_keeps_the_start_and_counts(tokenizer, caplog):
    long_answer = "The capital of France is Paris. " * 20
    records = [{"messages": [{"role": "user", "content": "Tell me about Paris."},
                             {"role": "assistant", "content": long_answer}]},
               {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    with caplog.at_level("WARNING", logger="poros.data"):
        full = tokenize_records(records, tokenizer, seq_len=4096).examples[0]
        assert not [r for r in caplog.records if "truncated" in r.getMessage()]  # nothing cut: nothing said
        data = tokenize_records(records, tokenizer, seq_len=40)
    said = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert said == [f"poros: truncated 1 of 2 examples to seq_len=40 tokens (each keeps its first 40; the longest "
                    f"has {len(full['input_ids'])}). Fix: raise seq_len (up to the model's max_position_embeddings) "
                    "to train them whole"]  # one WARNING for the dataset, with the counts
    assert data.num_truncated == 1 and data.num_dropped == 0
    assert data.examples[0] == {"input_ids": full["input_ids"][:40], "labels": full["labels"][:40]}
    [run] = labelled_runs(tokenizer, data.examples[0])
    assert long_answer.startswith(run) and len(run) > 10
    assert data.summary() == (f"data: 2 examples (messages), {100 * data.trainable_share:.1f}% of "
                              f"{data.total_tokens:,} tokens trainable, 1 truncated, 0 dropped")


def test_examples_without_trainable_tokens_are_dropped_and_counted(tokenizer):
    records = [{"messages": [{"role": "user", "content": "Only a question."}]},
               {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
               {"messages": [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "A"}]}]
    data = tokenize_records(records, tokenizer, seq_len=32)
    assert (data.num_examples, data.num_dropped) == (1, 2)
    assert data.summary().endswith("0 truncated, 2 dropped")


def test_nothing_trainable_raises_and_says_why(tokenizer):
    with pytest.raises(DataError, match="assistant message"):
        tokenize_records([{"messages": [{"role": "user", "content": "Hello?"}]}], tokenizer)
    with pytest.raises(DataError, match="seq_len=8"):
        tokenize_records([{"messages": [{"role": "system", "content": "You are a helpful assistant."},
                                        {"role": "user", "content": "Hello there, how are you?"},
                                        {"role": "assistant", "content": "Fine."}]}], tokenizer, seq_len=8)


def test_bad_rows_name_the_record():
    with pytest.raises(DataError, match="record 1 has no 'output'"):
        to_examples([{"instruction": "a", "output": "b"}, {"instruction": "c"}], "alpaca")
    with pytest.raises(DataError, match="record 0"):
        to_examples([{"messages": [{"role": "user"}]}], "messages")


# -- sources ----------------------------------------------------------------------------------------
def test_local_files_of_every_shape(tmp_path):
    assert load_records(DATA_DIR / "alpaca.json")[0]["output"] == "cold"  # a JSON list
    assert len(load_records(DATA_DIR / "sharegpt.json")) == 2  # {"data": [...]}
    rows = [{"text": "one"}, {"text": "two"}]
    (tmp_path / "train.json").write_text(json.dumps({"train": rows, "test": [{"text": "x"}]}))
    assert load_records(tmp_path / "train.json") == rows
    assert load_records(tmp_path / "train.json", split="test") == [{"text": "x"}]
    with pytest.raises(DataError, match="keys \\['test', 'train'\\]"):
        load_records(tmp_path / "train.json", split="validation")
    (tmp_path / "lines.json").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert load_records(str(tmp_path / "lines.json")) == rows  # JSON lines in a .json file
    (tmp_path / "blank.jsonl").write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    assert load_records(tmp_path / "blank.jsonl") == rows
    csv_rows = load_records(DATA_DIR / "prompt_completion.csv")
    assert csv_rows[0] == {"prompt": "The capital of Italy is", "completion": " Rome."}


def test_messages_in_a_csv_cell_are_parsed_as_json(tokenizer, tmp_path):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    path = tmp_path / "chat.csv"
    path.write_text('messages\n"' + json.dumps(messages).replace('"', '""') + '"\n')
    [example] = tokenize_records(load_records(path), tokenizer).examples
    assert labelled_runs(tokenizer, example) == ["Hello." + END]


def test_in_memory_lists_and_datasets_objects(tokenizer):
    import datasets

    rows = [{"text": "alpha"}, {"text": "beta"}]
    assert load_records(rows) == rows
    assert load_records(datasets.Dataset.from_list(rows)) == rows
    assert detect_format(datasets.Dataset.from_list(rows)) == "text"
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                                   "test": datasets.Dataset.from_list(rows[:1])})
    assert load_records(splits, split="test") == rows[:1]
    with pytest.raises(DataError, match="no split 'validation'.*'test', 'train'"):
        load_records(splits, split="validation")
    data = load_dataset(datasets.Dataset.from_list(rows), tokenizer, seq_len=16)
    assert (data.format, data.num_examples) == ("text", 2)


def test_bundled_chat_and_synthetic_sources(tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="poros.data"):
        data = load_dataset(TINY_CHAT, tokenizer, seq_len=256)
    assert data.format == "messages" and data.num_examples == 400 and data.num_dropped == 0
    assert data.summary() in caplog.text
    assert 0.2 < data.trainable_share < 0.6
    synthetic = load_dataset("synthetic", tokenizer, seq_len=16, seed=3)
    assert synthetic.format == "synthetic" and synthetic.num_examples == 256
    assert all(len(e["input_ids"]) == 16 and e["labels"] == e["input_ids"] for e in synthetic.examples)
    assert max(max(e["input_ids"]) for e in synthetic.examples) < len(tokenizer)
    assert synthetic.examples == synthetic_examples(vocab_size=len(tokenizer), seq_len=16, seed=3).examples
    assert synthetic.examples != synthetic_examples(vocab_size=len(tokenizer), seq_len=16, seed=4).examples


@pytest.mark.parametrize(("source", "match"), [
    ("missing/data.jsonl", "does not exist"),
    ("./nowhere", "does not exist"),
    ([], "no records"),
    (["not a dict"], "record 0 is a str"),
    (42, "cannot load a dataset from a int"),
    ("synthetic", "load_dataset"),
])
def test_source_errors(source, match):
    with pytest.raises(DataError, match=match):
        load_records(source)


def test_file_errors(tmp_path):
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"'\.parquet' is not one Poros reads.*\.jsonl, \.json, \.csv"):
        load_records(tmp_path / "data.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no records"):
        load_records(tmp_path / "empty.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        load_records(tmp_path / "broken.jsonl")
    with pytest.raises(DataError, match="is a directory"):
        load_records(tmp_path)


def test_uncached_hub_dataset_raises_naming_the_id(child_env, tmp_path):
    code = textwrap.dedent("""\
        from poros.data import load_records
        from poros.errors import DataError
        try:
            load_records("poros-test/definitely-not-cached")
        except DataError as error:
            print("DATAERROR", error)
    """)
    env = child_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
                    HF_DATASETS_CACHE=str(tmp_path / "hf" / "datasets"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                            check=False)
    assert "DATAERROR" in result.stdout, result.stderr[-2000:]
    assert "'poros-test/definitely-not-cached'" in result.stdout
    assert "cache" in result.stdout and "local .jsonl/.json/.csv file" in result.stdout


def test_import_poros_data_is_light(child_env):
    code = ("import sys, poros.data, poros.assets\n"
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env=child_env(), check=True)
    assert result.stdout.strip() == "[]"


# -- batches ------------------------------------------------------------------------------------------
def _toy_examples(count: int) -> list[dict[str, list[int]]]:
    return [{"input_ids": [10 + i] * (1 + i % 5), "labels": [-100] + [10 + i] * (i % 5)} for i in range(count)]


def test_batches_are_right_padded_int64():
    examples = _toy_examples(6)
    batch = BatchIterator(examples, batch_size=3, pad_token_id=0, shuffle=False).next_batch()
    assert {key: value.dtype for key, value in batch.items()} == dict.fromkeys(
        ("input_ids", "attention_mask", "labels"), torch.int64)
    assert batch["input_ids"].tolist() == [[10, 0, 0], [11, 11, 0], [12, 12, 12]]
    assert batch["attention_mask"].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert batch["labels"].tolist() == [[-100, -100, -100], [-100, 11, -100], [-100, 12, 12]]


def test_pad_to_multiple_of_pads_every_batch_to_a_few_lengths():
    """HF's DataCollatorWithPadding(pad_to_multiple_of=...): the same rows, the same values, more padding."""
    examples = _toy_examples(6)
    plain = BatchIterator(examples, batch_size=3, pad_token_id=0, shuffle=False).next_batch()
    padded = BatchIterator(examples, batch_size=3, pad_token_id=0, shuffle=False, pad_to_multiple_of=4).next_batch()
    assert padded["input_ids"].shape == (3, 4)
    for key, pad in (("input_ids", 0), ("attention_mask", 0), ("labels", -100)):
        assert torch.equal(padded[key][:, :3], plain[key]) and (padded[key][:, 3:] == pad).all()
    assert BatchIterator(examples, batch_size=3, pad_token_id=0, shuffle=False,
                         pad_to_multiple_of=3).next_batch()["input_ids"].shape == (3, 3)  # already a multiple
    with pytest.raises(DataError, match="pad_to_multiple_of"):
        BatchIterator(examples, batch_size=3, pad_token_id=0, pad_to_multiple_of=0)


def test_epochs_are_seeded_permutations_and_drop_the_partial_batch():
    examples = _toy_examples(10)
    rng_state = torch.get_rng_state()
    iterator = BatchIterator(examples, batch_size=3, pad_token_id=0, seed=5)
    epochs = [[row[0] - 10 for _ in range(3) for row in iterator.next_batch()["input_ids"].tolist()] for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), rng_state)  # no global RNG use
    for epoch, seen in enumerate(epochs):
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(5 + epoch)).tolist()[:9]
        assert seen == expected and len(set(seen)) == 9
    assert epochs[0] != epochs[1]
    same_seed = [BatchIterator(examples, batch_size=3, pad_token_id=0, seed=5) for _ in range(2)]
    first, second = ([iterator.next_batch()["input_ids"] for _ in range(6)] for iterator in same_seed)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    other_seed = BatchIterator(examples, batch_size=3, pad_token_id=0, seed=6)
    assert not all(torch.equal(a, other_seed.next_batch()["input_ids"]) for a in first[:3])
    in_order = BatchIterator(examples, batch_size=3, pad_token_id=0, shuffle=False)
    assert [row[0] for _ in range(4) for row in in_order.next_batch()["input_ids"].tolist()] == \
        [10, 11, 12, 13, 14, 15, 16, 17, 18, 10, 11, 12]


def test_state_dict_resume_gives_the_same_batches():
    examples = _toy_examples(11)
    uninterrupted = BatchIterator(examples, batch_size=2, pad_token_id=0, seed=1)
    interrupted = BatchIterator(examples, batch_size=2, pad_token_id=0, seed=1)
    for _ in range(7):  # past the first epoch boundary (5 batches per epoch)
        uninterrupted.next_batch()
        interrupted.next_batch()
    state = json.loads(json.dumps(interrupted.state_dict()))  # survives a JSON checkpoint
    assert state == {"epoch": 1, "position": 4, "seed": 1, "batch_size": 2, "num_examples": 11, "shuffle": True}
    resumed = BatchIterator(examples, batch_size=2, pad_token_id=0, seed=99)
    resumed.load_state_dict(state)
    for _ in range(9):
        expected, actual = uninterrupted.next_batch(), resumed.next_batch()
        assert all(torch.equal(expected[key], actual[key]) for key in expected)


def test_batch_iterator_errors():
    with pytest.raises(DataError, match="fewer than one batch"):
        BatchIterator(_toy_examples(3), batch_size=4, pad_token_id=0)
    iterator = BatchIterator(_toy_examples(8), batch_size=2, pad_token_id=0)
    with pytest.raises(DataError, match="num_examples 9 \\(saved\\) vs 8"):
        iterator.load_state_dict({"epoch": 0, "position": 0, "seed": 0, "batch_size": 2, "num_examples": 9})
    with pytest.raises(DataError, match="batch_size 4 \\(saved\\) vs 2"):
        iterator.load_state_dict({"epoch": 0, "position": 0, "seed": 0, "batch_size": 4, "num_examples": 8})


def test_batches_from_tokenized_data(tokenizer):
    data = load_dataset(DATA_DIR / "messages.jsonl", tokenizer, seq_len=64)
    batch = BatchIterator(data, batch_size=3, pad_token_id=tokenizer.pad_token_id, shuffle=False).next_batch()
    lengths = [len(e["input_ids"]) for e in data.examples]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    assert (batch["labels"] != -100).sum().item() == data.trainable_tokens
