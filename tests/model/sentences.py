"""Varied test sentences: short, long (> 128 tokens), over 256 tokens (truncated), unicode, emoji,
numbers, odd whitespace."""

_BASE = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "hi",
    "?",
    "a",
    "OK",
    "The quick brown fox jumps over the lazy dog.",
    "Transformers encode text into dense vectors that capture meaning.",
    "LayerNorm followed by GELU can be fused into a single GPU kernel.",
    "Ceci n'est pas une pipe.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "¿Dónde está la biblioteca?",
    "Съешь же ещё этих мягких французских булок.",
    "東京は日本の首都です。",
    "北京欢迎你",
    "서울은 한국의 수도입니다.",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "Ελληνικά γράμματα: αβγδε",
    "naïve café résumé coöperate",
    "I love pizza 🍕🍕🍕 and tacos 🌮!",
    "🚀🌕✨",
    "👩‍👩‍👧‍👦 family emoji with zero-width joiners",
    "Price: $1,299.99 (was $1,499.00) — save 13.3%!",
    "Call 555-0100 or +1 (800) 555-0199 before 23:59 on 2026-11-30.",
    "3.14159265358979323846264338327950288419716939937510",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
    "0x7fffffff 0b1010 1e-12 6.02e23",
    "   leading and trailing spaces   ",
    "multiple     spaces    between     words",
    "tabs\tand\nnewlines\r\nmixed  \t in",
    "UPPER CASE SHOUTING TEXT",
    "MiXeD cAsE tExT",
    "hyphen-ated words and under_scores and dot.separated.names",
    "e-mail: someone@example.com, url: https://example.com/a/b?c=d#e",
    "C++ and C# and F# are languages; so is Python 3.11.",
    "\"Quoted\" 'text' with «guillemets» and „German quotes“",
    "repeat repeat repeat repeat repeat repeat repeat repeat",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "The mitochondria is the powerhouse of the cell.",
    "Rain is expected tomorrow afternoon with winds of 40 km/h.",
    "def f(x): return x ** 2  # a line of code",
    "SELECT * FROM users WHERE id = 42;",
    "<html><body><p>markup</p></body></html>",
    "Zero\u200bwidth\u200bspace and non\u00a0breaking space",
    "control\u0007chars\u001bhere",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
]

_LONG_PARAGRAPH = (
    "Sentence embeddings map a piece of text to a single vector so that texts with similar meaning land "
    "close together. They power semantic search, clustering, deduplication and retrieval for question "
    "answering. A small encoder such as MiniLM keeps latency low while keeping most of the quality of "
    "much larger models, which is why it is a common default in production systems. "
)

SENTENCES = [
    *_BASE,
    _LONG_PARAGRAPH,  # ~70 tokens
    _LONG_PARAGRAPH * 2,  # > 128 tokens
    _LONG_PARAGRAPH * 3,  # ~210 tokens
    _LONG_PARAGRAPH * 5,  # > 256 tokens: truncated
    " ".join(str(i) for i in range(400)),  # > 256 tokens of numbers
    "emoji " * 300,  # > 256 tokens
    "東京 " * 200 + "end",  # long CJK
    ("word " * 126).strip(),  # right around the old fixed 128 limit
    ("word " * 254).strip(),  # exactly 256 with [CLS]/[SEP]
    ("word " * 255).strip(),  # one over
]
assert len(SENTENCES) >= 64
