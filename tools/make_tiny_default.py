"""Generate Poros's embedded tiny default: a chat dataset, a tokenizer trained on it, a tiny Qwen3.

::

    python -m tools.make_tiny_default            # (re)write poros/assets/
    python -m tools.make_tiny_default --check    # exit 1 if poros/assets/ differs from a fresh run

What it writes (deterministically: the same bytes on every run; `--check` verifies it):

* ``poros/assets/tiny-chat.jsonl`` -- English chat conversations built from templates with
  correct answers (arithmetic, unit conversions, capitals, spelling, letter counts, definitions,
  opposites, days and months, alphabetical order, even or odd, comparisons), some multi-turn,
  some with a system message. One ``{"messages": [{"role", "content"}, ...]}`` object per line.
* ``poros/assets/tiny-qwen3/`` -- a byte-level BPE tokenizer (vocab 2048) trained with
  ``tokenizers`` on that text, saved through ``PreTrainedTokenizerFast.save_pretrained`` with a
  ChatML chat template (eos ``<|im_end|>``, pad ``<|endoftext|>``); and a ``Qwen3ForCausalLM``
  (hidden 128, 4 layers, 4 heads, 2 KV heads, head_dim 32, intermediate 384, untied head),
  initialised from a fixed seed and pretrained a little (:func:`pretrain`), saved in bfloat16 as
  multi-shard safetensors (1 MB shards).

The pretraining is what makes ``poros train``'s first run learn visibly: a random base gives LoRA
nothing to build on, while this one knows the language of the bundled kind of text (other
conversations from the same templates, ``PRETRAIN_SEED``, as plain text with role names and no
special token), so the fine-tune has the ChatML turns and the bundled answers to learn. It is a
full-parameter AdamW pass in float32 on one CPU thread, every order from a fixed seed: the same
bytes on every run of one machine type (another CPU's float kernels may round differently; then
``--check`` reports the weight shards, and the regenerated ones are as good).

``poros.assets.asset_path("poros-tiny-qwen3")`` and ``asset_path("poros-tiny-chat")`` resolve
the two names. Importing this script imports nothing heavy; ``main`` imports torch,
transformers and tokenizers.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import pathlib
import random
import shutil
import sys
import tempfile

from poros.data import CHATML_TEMPLATE  # torch-free
from poros.spellings import format_gb

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

ASSETS_DIR = REPO_ROOT / "poros" / "assets"
CHAT_FILE = "tiny-chat.jsonl"
MODEL_DIR = "tiny-qwen3"
SEED = 0
NUM_CONVERSATIONS = 400
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: The pretraining: other conversations of the same templates (seed 1, not the bundled seed 0), packed
#: into blocks of PRETRAIN_BLOCK tokens, PRETRAIN_BATCH blocks per AdamW step, cosine from PRETRAIN_LR.
PRETRAIN_SEED = 1
PRETRAIN_CONVERSATIONS = 8000
PRETRAIN_STEPS = 800
PRETRAIN_BATCH = 16
PRETRAIN_BLOCK = 128
PRETRAIN_LR = 3e-3
#: the declared context (config max_position_embeddings, tokenizer model_max_length): RoPE (theta 1e6, as
#: Qwen3's 32K models) has no learned positions, and pretraining sees 128-token blocks only, so any length
#: is as (un)trained as another; 32768 lets `poros train --seq-len 4096` (and longer) run on it.
MAX_POSITIONS = 32768

# -- facts the templates draw from (checked by hand; every answer must be correct) --------------
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Canada": "Ottawa", "Australia": "Canberra",
    "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Mexico": "Mexico City", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "Poland": "Warsaw", "Greece": "Athens", "Ireland": "Dublin",
    "Austria": "Vienna", "Hungary": "Budapest", "Russia": "Moscow", "Turkey": "Ankara",
    "South Korea": "Seoul", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Peru": "Lima", "Chile": "Santiago",
    "Colombia": "Bogota", "Nigeria": "Abuja", "Morocco": "Rabat", "New Zealand": "Wellington",
    "the Netherlands": "Amsterdam", "Belgium": "Brussels", "Switzerland": "Bern", "Czechia": "Prague",
    "Iceland": "Reykjavik",
}
DEFINITIONS = {
    "river": "a large natural stream of water that flows toward a sea, a lake or another river",
    "mountain": "a large natural rise of the ground, much higher than a hill",
    "library": "a place where books and other media are kept for people to read or borrow",
    "planet": "a large body in space that moves around a star",
    "volcano": "a mountain with an opening through which lava, ash and gas can erupt",
    "island": "a piece of land with water all around it",
    "desert": "a large area of land that gets very little rain",
    "bridge": "a structure that carries a road or path over a river, a valley or another road",
    "recipe": "a set of instructions for preparing a dish",
    "thermometer": "an instrument that measures temperature",
    "calendar": "a chart that shows the days, weeks and months of a year",
    "orchestra": "a large group of musicians who play instruments together",
    "harbor": "a sheltered area of water where ships can stay safely",
    "glacier": "a slow-moving mass of ice formed from snow over many years",
    "dictionary": "a book or resource that lists words with their meanings",
    "telescope": "an instrument that makes distant objects look closer",
    "forest": "a large area covered mostly with trees",
    "verb": "a word that describes an action, a state or an occurrence",
    "noun": "a word that names a person, a place, a thing or an idea",
    "triangle": "a flat shape with three straight sides and three angles",
    "square": "a flat shape with four equal sides and four right angles",
    "prime number": "a whole number greater than 1 whose only divisors are 1 and itself",
    "even number": "a whole number that can be divided by 2 with no remainder",
    "photosynthesis": "the process by which plants use sunlight to make food from water and carbon dioxide",
    "gravity": "the force that pulls objects toward each other, such as toward the Earth",
    "vaccine": "a substance that trains the immune system to protect the body against a disease",
    "ocean": "a very large body of salt water that covers much of the Earth",
    "alphabet": "the set of letters used to write a language, in a fixed order",
    "compass": "an instrument with a needle that points north, used to find direction",
    "museum": "a building where objects of historical, scientific or artistic interest are shown",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "light": "dark", "open": "closed",
    "early": "late", "full": "empty", "strong": "weak", "high": "low", "old": "young", "wet": "dry",
    "hard": "soft", "loud": "quiet", "rich": "poor", "near": "far", "up": "down", "win": "lose",
}
SPELLING_WORDS = (
    "apple", "banana", "orange", "garden", "window", "pencil", "rocket", "planet", "silver", "market",
    "bottle", "yellow", "purple", "castle", "jungle", "winter", "summer", "animal", "button", "doctor",
    "friend", "school", "camera", "puzzle", "candle", "ladder", "mirror", "tunnel", "basket", "island",
)
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in one sentence.",
    "You are a patient tutor who explains answers clearly.",
    "You are a friendly assistant for students.",
)
#: (unit from, unit to, factor, plural from, plural to): value_to = value_from * factor, exact integers.
CONVERSIONS = (
    ("meter", "centimeter", 100, "meters", "centimeters"),
    ("kilometer", "meter", 1000, "kilometers", "meters"),
    ("kilogram", "gram", 1000, "kilograms", "grams"),
    ("liter", "milliliter", 1000, "liters", "milliliters"),
    ("hour", "minute", 60, "hours", "minutes"),
    ("minute", "second", 60, "minutes", "seconds"),
    ("day", "hour", 24, "days", "hours"),
    ("week", "day", 7, "weeks", "days"),
    ("foot", "inch", 12, "feet", "inches"),
    ("yard", "foot", 3, "yards", "feet"),
)


# -- one generator per topic: rng -> list of (question, answer) turns, or a full conversation ----
def _plural(count: int, singular: str, plural: str) -> str:
    return f"{count} {singular if count == 1 else plural}"


def arithmetic(rng: random.Random) -> tuple[str, str]:
    operation = rng.choice("+-*/")
    if operation == "+":
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        question = rng.choice((f"What is {a} + {b}?", f"Add {a} and {b}.", f"What is the sum of {a} and {b}?"))
        return question, f"{a} + {b} = {a + b}."
    if operation == "-":
        a, b = sorted((rng.randint(2, 999), rng.randint(2, 999)), reverse=True)
        question = rng.choice((f"What is {a} - {b}?", f"Subtract {b} from {a}."))
        return question, f"{a} - {b} = {a - b}."
    if operation == "*":
        a, b = rng.randint(2, 99), rng.randint(2, 30)
        question = rng.choice((f"What is {a} times {b}?", f"Multiply {a} by {b}.", f"What is {a} x {b}?"))
        return question, f"{a} x {b} = {a * b}."
    b, quotient = rng.randint(2, 25), rng.randint(2, 40)
    a = b * quotient
    question = rng.choice((f"What is {a} divided by {b}?", f"Divide {a} by {b}."))
    return question, f"{a} / {b} = {quotient}."


def conversion(rng: random.Random) -> tuple[str, str]:
    singular_from, singular_to, factor, plural_from, plural_to = rng.choice(CONVERSIONS)
    value = rng.randint(1, 50)
    amount_from = _plural(value, singular_from, plural_from)
    amount_to = _plural(value * factor, singular_to, plural_to)
    question = rng.choice((f"How many {plural_to} are in {amount_from}?",
                           f"Convert {amount_from} to {plural_to}."))
    unit = _plural(factor, singular_to, plural_to)
    return question, f"{amount_from} is {amount_to}, because 1 {singular_from} is {unit}."


def temperature(rng: random.Random) -> tuple[str, str]:
    celsius = 5 * rng.randint(-8, 20)  # multiples of 5 give whole Fahrenheit degrees
    fahrenheit = celsius * 9 // 5 + 32
    question = rng.choice((f"What is {celsius} degrees Celsius in Fahrenheit?",
                           f"Convert {celsius} C to Fahrenheit."))
    return question, f"{celsius} degrees Celsius is {fahrenheit} degrees Fahrenheit (F = C x 9/5 + 32)."


def capital(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(sorted(CAPITALS))
    question = rng.choice((f"What is the capital of {country}?", f"Which city is the capital of {country}?",
                           f"Name the capital city of {country}."))
    return question, f"The capital of {country} is {CAPITALS[country]}."


def spelling(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(SPELLING_WORDS)
    kind = rng.randrange(3)
    if kind == 0:
        return f"Spell the word '{word}' letter by letter.", "-".join(word.upper()) + "."
    if kind == 1:
        return f"Write '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'."
    letter = rng.choice(sorted(set(word)))
    count = word.count(letter)
    return (f"How many times does the letter '{letter}' appear in '{word}'?",
            f"The letter '{letter}' appears {'once' if count == 1 else f'{count} times'} in '{word}'.")


def letter_count(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(SPELLING_WORDS + tuple(OPPOSITES))
    return f"How many letters are in the word '{word}'?", f"The word '{word}' has {len(word)} letters."


def definition(rng: random.Random) -> tuple[str, str]:
    term = rng.choice(sorted(DEFINITIONS))
    article = "an" if term[0] in "aeiou" else "a"
    question = rng.choice((f"What is {article} {term}?", f"Define '{term}'.", f"What does '{term}' mean?"))
    return question, f"{article.capitalize()} {term} is {DEFINITIONS[term]}."


def opposite(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(sorted(OPPOSITES))
    return (rng.choice((f"What is the opposite of '{word}'?", f"Give an antonym of '{word}'.")),
            f"The opposite of '{word}' is '{OPPOSITES[word]}'.")


def calendar(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        index, step = rng.randrange(7), rng.choice((1, 2, 3))
        names = ("the day after", "two days after", "three days after")
        return (f"What day is {names[step - 1]} {DAYS[index]}?",
                f"{names[step - 1].capitalize()} {DAYS[index]} is {DAYS[(index + step) % 7]}.")
    index = rng.randrange(12)
    if rng.random() < 0.5:
        return f"Which month comes after {MONTHS[index]}?", f"{MONTHS[(index + 1) % 12]} comes after {MONTHS[index]}."
    return f"What number is the month of {MONTHS[index]}?", f"{MONTHS[index]} is month number {index + 1} of the year."


def alphabetical(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(sorted(set(SPELLING_WORDS) | set(DEFINITIONS) | set(OPPOSITES)), rng.randint(3, 5))
    return (f"Put these words in alphabetical order: {', '.join(words)}.",
            f"In alphabetical order: {', '.join(sorted(words))}.")


def parity(rng: random.Random) -> tuple[str, str]:
    number = rng.randint(1, 9999)
    kind = "even" if number % 2 == 0 else "odd"
    return f"Is {number} even or odd?", f"{number} is {kind}, because its last digit is {number % 10}."


def comparison(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(1, 10000), 2)
    return f"Which is larger, {a} or {b}?", f"{max(a, b)} is larger than {min(a, b)}."


TOPICS = (arithmetic, conversion, temperature, capital, spelling, letter_count, definition, opposite, calendar,
          alphabetical, parity, comparison)


def follow_up_arithmetic(rng: random.Random) -> list[tuple[str, str]]:
    """Two turns where the second refers to the first answer."""
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    total = a + b
    factor = rng.randint(2, 9)
    return [(f"What is {a} + {b}?", f"{a} + {b} = {total}."),
            (f"And what is that times {factor}?", f"{total} x {factor} = {total * factor}.")]


def follow_up_capital(rng: random.Random) -> list[tuple[str, str]]:
    first, second = rng.sample(sorted(CAPITALS), 2)
    return [(f"What is the capital of {first}?", f"The capital of {first} is {CAPITALS[first]}."),
            (f"What about {second}?", f"The capital of {second} is {CAPITALS[second]}.")]


def conversation(rng: random.Random) -> dict:
    """One conversation: 1-3 turns, a system message one time in three."""
    shape = rng.random()
    if shape < 0.15:
        turns = (follow_up_arithmetic if rng.random() < 0.5 else follow_up_capital)(rng)
    elif shape < 0.35:
        turns = [rng.choice(TOPICS)(rng) for _ in range(rng.choice((2, 3)))]
    else:
        turns = [rng.choice(TOPICS)(rng)]
    messages = []
    if rng.random() < 1 / 3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for question, answer in turns:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def conversations(seed: int = SEED, count: int = NUM_CONVERSATIONS) -> list[dict]:
    """The bundled dataset: ``count`` conversations from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(count)]


# -- writers ---------------------------------------------------------------------------------------
def write_chat(records: list[dict], path: pathlib.Path) -> None:
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")


def write_tokenizer(records: list[dict], directory: pathlib.Path):
    """Train the byte-level BPE on the dataset's role names and contents; save it with the template."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    texts = [f"{message['role']}\n{message['content']}\n" for record in records for message in record["messages"]]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], chat_template=CHATML_TEMPLATE,
        model_max_length=MAX_POSITIONS, clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(directory)
    return fast


def pretraining_texts(records: list[dict]) -> list[str]:
    """Each conversation as plain text: every message its role and its content on lines of their own
    (the tokenizer's training text), no chat template and no special token."""
    return ["".join(f"{message['role']}\n{message['content']}\n" for message in record["messages"])
            for record in records]


def pretrain(model, tokenizer) -> None:
    """Train every parameter of ``model`` (float32) on :func:`pretraining_texts` of ``PRETRAIN_CONVERSATIONS``
    conversations from ``PRETRAIN_SEED``: ``PRETRAIN_STEPS`` AdamW steps (warm-up a tenth, cosine, clip 1.0)
    over shuffled ``PRETRAIN_BLOCK``-token blocks, on one CPU thread."""
    import torch
    import transformers

    texts = pretraining_texts(conversations(PRETRAIN_SEED, PRETRAIN_CONVERSATIONS))
    ids = [token for text in texts for token in tokenizer(text, add_special_tokens=False)["input_ids"]]
    blocks = torch.tensor(ids[: len(ids) // PRETRAIN_BLOCK * PRETRAIN_BLOCK]).view(-1, PRETRAIN_BLOCK)
    generator = torch.Generator().manual_seed(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, weight_decay=0.0)
    schedule = transformers.get_scheduler("cosine", optimizer, num_warmup_steps=PRETRAIN_STEPS // 10,
                                          num_training_steps=PRETRAIN_STEPS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one summation order
    try:
        model.train()
        order: list[int] = []
        for _ in range(PRETRAIN_STEPS):
            if len(order) < PRETRAIN_BATCH:
                order += torch.randperm(len(blocks), generator=generator).tolist()
            batch, order = blocks[order[:PRETRAIN_BATCH]], order[PRETRAIN_BATCH:]
            model(input_ids=batch, labels=batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)


def write_model(tokenizer, directory: pathlib.Path) -> None:
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=384, tie_word_embeddings=False,
        max_position_embeddings=MAX_POSITIONS, dtype="bfloat16",
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(SEED)
    model = transformers.Qwen3ForCausalLM._from_config(config, dtype=torch.float32)
    pretrain(model, tokenizer)
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="1MB")  # bf16: the model's own dtype
    for path in directory.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; installed assets must be readable by every user


def generate(assets_dir: pathlib.Path) -> None:
    """Write the chat file and the tiny model directory under ``assets_dir``."""
    assets_dir.mkdir(parents=True, exist_ok=True)
    records = conversations()
    write_chat(records, assets_dir / CHAT_FILE)
    model_dir = assets_dir / MODEL_DIR
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir()
    tokenizer = write_tokenizer(records, model_dir)
    write_model(tokenizer, model_dir)


def _differences(expected: pathlib.Path, actual: pathlib.Path) -> list[str]:
    comparison = filecmp.dircmp(expected, actual)
    found = [f"only in fresh run: {name}" for name in comparison.left_only]
    found += [f"only in {actual}: {name}" for name in comparison.right_only]
    for name in comparison.common_files:
        if not filecmp.cmp(expected / name, actual / name, shallow=False):
            found.append(f"differs: {name}")
    for name in comparison.common_dirs:
        found += _differences(expected / name, actual / name)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="compare a fresh run with poros/assets/; exit 1 on a difference")
    parser.add_argument("--out", type=pathlib.Path, default=ASSETS_DIR, help="assets directory (default: poros/assets)")
    args = parser.parse_args(argv)
    if not args.check:
        generate(args.out)
        total = sum(path.stat().st_size for path in args.out.rglob("*") if path.is_file() and path.suffix != ".py")
        print(f"wrote {args.out} ({format_gb(total)} of assets)")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        fresh = pathlib.Path(scratch) / "assets"
        generate(fresh)
        problems = [p for p in _differences(fresh, args.out) if "__init__.py" not in p and "__pycache__" not in p]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
