"""The tiny models' tokenizer: a byte-level BPE trained on a corpus generated here.

No model hub is reachable where the tiny models are built, so the tokenizer is trained from
a fixed text and sentences made by a deterministic generator: the same seed gives the same
vocabulary on every machine and Python version.
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)


# --------------------------------------------------------------------------- corpus

_CORPUS_TEXT = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token
to a few experts out of many, and the router picks them by the largest logits.
Reinforcement learning needs the same experts in training as in inference, so the
inference engine returns, for each token and each layer, the identifiers of the experts.
Hello, world! How are you today? I am fine, thank you. What is the time? It is 10:45.
The numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 4096 65535 3.14159 2.71828 -42.
Lists: apples, oranges, pears; colors: red, green, blue; days: Monday, Tuesday, Sunday.
def route(hidden, weight, top_k):
    logits = hidden @ weight.T
    return logits.topk(top_k).indices

for i in range(10):
    print(f"step {i}: loss={1.0 / (i + 1):.4f}")
{"role": "user", "content": "Write a short poem about the sea."}
{"role": "assistant", "content": "Waves fold the light; the tide keeps time."}
<html><body><p>Tiny models are cheap to build and fast to run.</p></body></html>
Les modeles francais parlent aussi: bonjour, merci, au revoir. Ca va tres bien.
Umlaute und Akzente: Gruesse, Maedchen, cafe, naive, resume; UTF-8 bytes: \u00e9 \u00fc \u00f1
\u00e7 \u00df \u4f60\u597d \u4e16\u754c \u3053\u3093\u306b\u3061\u306f \U0001f600.
"""

# Word lists for generated sentences.
_SUBJECTS = [
    "the model",
    "a router",
    "the engine",
    "our trainer",
    "each token",
    "the expert",
    "a request",
    "the scheduler",
    "the cache",
    "this layer",
    "every worker",
    "the policy",
]
_VERBS = [
    "reads",
    "writes",
    "selects",
    "returns",
    "stores",
    "checks",
    "routes",
    "samples",
    "builds",
    "loads",
    "computes",
    "compares",
    "sends",
    "keeps",
    "drops",
    "counts",
]
_OBJECTS = [
    "the logits",
    "two experts",
    "four experts",
    "a block of tokens",
    "the prefix",
    "the weights",
    "a checksum",
    "the output",
    "the prompt",
    "a batch",
    "the gradients",
    "the reward",
    "a sequence",
    "the hidden states",
    "one shard",
    "the attention",
]
_TAILS = [
    ".",
    "!",
    "?",
    " again.",
    " quickly.",
    " on the CPU.",
    " in float32.",
    " per layer.",
    " for every step.",
    " without a GPU.",
    " (twice).",
    " - then stops.",
]


def _lcg(seed: int) -> Iterator[int]:
    """A tiny linear congruential generator: identical on every Python version."""
    state = seed & 0xFFFFFFFF
    while True:
        state = (1103515245 * state + 12345) & 0x7FFFFFFF
        yield state >> 8


def training_corpus(seed: int, num_sentences: int = 3000) -> list[str]:
    """Deterministic text for tokenizer training: fixed prose plus generated sentences."""
    rng = _lcg(seed)
    lines = _CORPUS_TEXT.splitlines()
    for _ in range(num_sentences):
        words = [
            _SUBJECTS[next(rng) % len(_SUBJECTS)],
            _VERBS[next(rng) % len(_VERBS)],
            _OBJECTS[next(rng) % len(_OBJECTS)],
        ]
        sentence = " ".join(words) + _TAILS[next(rng) % len(_TAILS)]
        lines.append(sentence[0].upper() + sentence[1:] + f" #{next(rng) % 1000}")
    return lines


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    """Train a byte-level BPE whose vocabulary (specials included) is exactly ``vocab_size``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(seed), trainer=trainer)
    actual = tokenizer.get_vocab_size(with_added_tokens=True)
    if actual != vocab_size:
        raise RuntimeError(f"tokenizer vocab is {actual}, expected {vocab_size}: corpus too small")
    return tokenizer
