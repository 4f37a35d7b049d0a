"""The tiny HF fast tokenizer used by the tiny synthetic checkpoint (spec `model.md` §6, §7).

Layout (1024 ids, = tiny `vocab_size`):

| ids        | tokens                                                                      |
|------------|-----------------------------------------------------------------------------|
| 0, 1, 2    | `<｜begin▁of▁sentence｜>`, `<｜end▁of▁sentence｜>`, `<｜▁pad▁｜>` (DeepSeek's spellings) |
| 3 .. 998   | byte-level BPE (256 byte symbols + 740 merges) trained on an embedded corpus  |
| 999        | `<｜mask｜>` — the DSpark noise token of the tiny config                       |
| 1000       | `<｜deepseek_image｜>` — the tiny config's `image_token_id`                   |
| 1001 ..    | every special token deepseek-recipe 0.2.0's `DeepseekV41Encoding` renders,   |
|            | the recipe's grounding tokens, SGLang's task tokens (1001..1021)             |
| 1022, 1023 | reserved `<｜place▁holder▁no▁N｜>` (plain added tokens, not special)          |

`build_tokenizer` generalises the layout to any vocabulary size and mask/image ids (the slice
preset uses Flash's 129280 ids, mask 128799, image 129264: every id the model can emit exists,
which Engram hashing needs); the extra ids are reserved placeholders.

Invariants: byte-level, so every UTF-8 string encodes and decodes back unchanged; the files are
byte-identical on every run (the BPE trainer is deterministic for a fixed corpus and the JSON
is written with a fixed key order); specials are `special=True, normalized=False` added tokens.
As in DeepSeek's own tokenizer, ids 0–2 also occupy model-vocabulary slots, so the model
vocabulary has no holes. Encoding adds a BOS (post-processor template), like DeepSeek's.

Nothing in the model or loader may assume these ids: they come from config.json / the tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


# The embedded training corpus: plain English, numbers and code-like text, written for this
# project. Only its exact bytes matter (they fix the merges); it is not meant to be read.
_TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog while the small cat watches from the window.
A language model reads a sequence of tokens and predicts the next one, step after step.
Every morning the baker opens the shop at seven, and the first customers arrive at eight.
She wrote three letters to her friends, then walked along the river until the sun went down.
Numbers are everywhere: 0 1 2 3 4 5 6 7 8 9 10 12 24 32 64 100 128 256 512 1024 2048 4096.
In 1969 people landed on the moon; in 2024 the weather was warm, and 3.14159 is close to pi.
The price was $19.99, the discount 25%, the total 14.99, and the date 2026-11-29 at 23:13.
Questions and answers: what is the capital of France? Paris. How many days in a week? Seven.
Please summarize the following paragraph in one sentence, and keep the important details.
The system compresses memory, selects the most relevant positions, and attends to them.
Hello, world! This is a test of the tokenizer. It should handle punctuation, quotes "like this",
apostrophes (don't, can't, it's), dashes - and -- and ellipses... as well as new lines.
Science, history, music, art, mathematics, physics, chemistry, biology and geography.
The teacher explained the lesson slowly so that every student could follow the argument.
Water boils at 100 degrees Celsius and freezes at 0; light travels about 300000 km per second.
There are many ways to solve a problem, but the simplest one is often the best to start with.
Good morning, good afternoon, good evening, good night. Thank you very much for your help.
The train leaves the station at noon and reaches the city in the late afternoon.
He opened the door, looked around the room, and found the book he had lost last year.
Children play in the park, birds sing in the trees, and the wind moves the tall grass.
Reasoning step by step: first read the question, then list the facts, then draw a conclusion.
Write a short story about a robot who learns to paint flowers in a quiet garden.
def add(a, b):
    return a + b

def mean(values):
    total = sum(values)
    return total / len(values) if values else 0.0

class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value

for i in range(10):
    if i % 2 == 0:
        print("even", i)
    else:
        print("odd", i)

import json
data = {"name": "tiny", "size": 1024, "layers": 8, "ok": True, "items": [1, 2, 3]}
text = json.dumps(data, indent=2)
result = [x * x for x in range(16) if x > 3]
while count < limit and not done:
    count = count + 1
int main(void) { int x = 42; printf("%d\\n", x); return 0; }
fn main() { let v: Vec<u32> = (0..8).collect(); println!("{:?}", v); }
SELECT id, name FROM users WHERE age >= 18 ORDER BY name LIMIT 10;
<html><body><p>Hello</p></body></html>
x = torch.zeros(4, 64, dtype=torch.bfloat16); y = x @ w.T + b
assert shape == (32, 64), f"bad shape {shape}"
try:
    value = int(line.strip())
except ValueError as error:
    raise RuntimeError("cannot parse line") from error
The weather today is sunny with a light breeze; tomorrow may bring rain and cooler air.
Once upon a time there was a little village near a forest where everyone knew each other.
Computers store information as bits, and eight bits make one byte; a kilobyte has 1024 bytes.
Tools can be called with arguments, and their results are returned to the assistant.
The user asked for a list of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday; January, February, March,
April, May, June, July, August, September, October, November, December.
red orange yellow green blue indigo violet black white gray brown pink purple silver gold
one two three four five six seven eight nine ten eleven twelve twenty thirty hundred thousand
north south east west up down left right inside outside before after above below between
"""

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
MASK_TOKEN = "<｜mask｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"

MASK_TOKEN_ID = 999
IMAGE_TOKEN_ID = 1000
TINY_TOKENIZER_SIZE = 1024
FIRST_BPE_ID = 3
N_BPE_TOKENS = MASK_TOKEN_ID - FIRST_BPE_ID  # 996: ids 3..998

# Rendered by DeepseekV41Encoding (spec §6; the image spelling is SGLang's override), then the
# recipe's grounding tokens and SGLang's task-header tokens. Ids 1001.. in this order.
CHAT_SPECIAL_TOKENS: tuple[str, ...] = (
    "<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>",
    "<think>", "</think>", "｜DSML｜",
)
GROUNDING_SPECIAL_TOKENS: tuple[str, ...] = (
    "<｜ref｜>", "<｜/ref｜>", "<｜box｜>", "<｜/box｜>",
    "<｜point｜>", "<｜/point｜>", "<｜polygon｜>", "<｜/polygon｜>",
)
TASK_SPECIAL_TOKENS: tuple[str, ...] = (
    "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>",
)


def special_token_table(vocab_size: int = TINY_TOKENIZER_SIZE, mask_token_id: int = MASK_TOKEN_ID,
                        image_token_id: int = IMAGE_TOKEN_ID) -> dict[int, str]:
    """id → spelling of every added token (ids 0–2 and 999..vocab_size−1).

    Layout rule: BOS/EOS/pad at 0/1/2, the mask and image tokens at the given ids, the chat /
    grounding / task specials at the lowest free ids from 999 upward, every other id up to
    `vocab_size − 1` a reserved `<｜place▁holder▁no▁N｜>`. With the defaults this is exactly the
    tiny table of the module docstring; the slice preset uses Flash's size and ids.
    """
    first_free = FIRST_BPE_ID + N_BPE_TOKENS
    for name, i in (("mask_token_id", mask_token_id), ("image_token_id", image_token_id)):
        if not first_free <= i < vocab_size:
            raise ValueError(f"{name} {i} must lie in {first_free}..{vocab_size - 1} (ids 0..{first_free - 1} "
                             "are BOS/EOS/pad and the BPE vocabulary)")
    if mask_token_id == image_token_id:
        raise ValueError(f"mask and image token ids must differ, both are {mask_token_id}")
    tail = CHAT_SPECIAL_TOKENS + GROUNDING_SPECIAL_TOKENS + TASK_SPECIAL_TOKENS
    if vocab_size < first_free + 2 + len(tail):
        raise ValueError(f"vocab_size {vocab_size} too small for the tokenizer layout "
                         f"(needs ≥ {first_free + 2 + len(tail)})")
    table = {0: BOS_TOKEN, 1: EOS_TOKEN, 2: PAD_TOKEN, mask_token_id: MASK_TOKEN, image_token_id: IMAGE_TOKEN}
    free = (i for i in range(first_free, vocab_size) if i not in table)
    for tok in tail:
        table[next(free)] = tok
    for reserved, i in enumerate(free):
        table[i] = f"<｜place▁holder▁no▁{reserved}｜>"
    return dict(sorted(table.items()))


def _is_special(content: str) -> bool:
    """Reserved placeholders are plain added tokens (they decode to their text); all others special."""
    return not content.startswith("<｜place▁holder▁no▁")


def _train_bpe() -> dict[str, Any]:
    """Train the byte-level BPE on the embedded corpus; return the tokenizer JSON as a dict."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=N_BPE_TOKENS,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TINY_CORPUS.splitlines(keepends=True), trainer=trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    if len(vocab) != N_BPE_TOKENS:
        raise RuntimeError(f"tiny BPE training produced {len(vocab)} tokens, expected {N_BPE_TOKENS} "
                           "(the embedded corpus is too small)")
    return data


def _added_token(i: int, content: str) -> dict[str, Any]:
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": _is_special(content)}


def tokenizer_json(specials: dict[int, str]) -> dict[str, Any]:
    """The complete `tokenizer.json` content for an added-token table (deterministic)."""
    data = _train_bpe()
    bpe_vocab: dict[str, int] = data["model"]["vocab"]
    vocab: dict[str, int] = {specials[0]: 0, specials[1]: 1, specials[2]: 2}
    for token, i in sorted(bpe_vocab.items(), key=lambda kv: kv[1]):
        vocab[token] = i + FIRST_BPE_ID
    model = dict(data["model"])
    model["vocab"] = vocab
    model["dropout"] = None
    model["unk_token"] = None
    model["byte_fallback"] = False
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [_added_token(i, s) for i, s in sorted(specials.items())],
        "normalizer": None,
        "pre_tokenizer": data["pre_tokenizer"],
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": BOS_TOKEN, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [0], "tokens": [BOS_TOKEN]}},
        },
        "decoder": data["decoder"],
        "model": model,
    }


def _tokenizer_config(specials: dict[int, str]) -> dict[str, Any]:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        # control tokens only; the reserved placeholders are listed in tokenizer.json alone
        "added_tokens_decoder": {str(i): {k: v for k, v in _added_token(i, s).items() if k != "id"}
                                 for i, s in sorted(specials.items()) if _is_special(s)},
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _special_tokens_map() -> dict[str, Any]:
    return {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "mask_token": MASK_TOKEN}


def _dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, indent=2) + "\n"


def build_tokenizer(out_dir: str | Path, *, vocab_size: int, mask_token_id: int, image_token_id: int) -> Path:
    """Write `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` into `out_dir`
    for the layout of `special_token_table(vocab_size, mask_token_id, image_token_id)`.

    Loadable by `transformers.AutoTokenizer.from_pretrained(out_dir)` and
    `tokenizers.Tokenizer.from_file(out_dir / "tokenizer.json")`; identical bytes on every run.
    Returns `out_dir`.
    """
    from tokenizers import Tokenizer

    specials = special_token_table(vocab_size, mask_token_id, image_token_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = _dump(tokenizer_json(specials))
    tok = Tokenizer.from_str(text)  # refuse to write a file `tokenizers` cannot load
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, expected {vocab_size}")
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(_dump(_tokenizer_config(specials)), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(_dump(_special_tokens_map()), encoding="utf-8")
    return out


def build_tiny_tokenizer(out_dir: str | Path) -> Path:
    """The tiny tokenizer (1024 ids, mask 999, image 1000) — see the module docstring."""
    return build_tokenizer(out_dir, vocab_size=TINY_TOKENIZER_SIZE, mask_token_id=MASK_TOKEN_ID,
                           image_token_id=IMAGE_TOKEN_ID)


def engram_compressed_vocab_size(tokenizer_dir: str | Path) -> int:
    """`engram_compressed_vocab_size` of a tokenizer directory: the number of normalised-text
    classes of spec §3.3.1, computed by `sglang_dsv41.engram_hash.compressed_token_map`."""
    from ..engram_hash import compressed_token_map

    _, size = compressed_token_map(Path(tokenizer_dir))
    return int(size)
