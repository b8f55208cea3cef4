"""all-mpnet-base-v2 with its real weights, on the CPU in float32: the assembled directory is the model
sentence-transformers knows, and the server's POST /v1/embeddings (through the `openai` client) gives every one of
200 varied texts the embedding SentenceTransformer.encode gives it (cosine at least the float32 table's 0.99999),
at the same dimension, normalized. Both sides run a base model over some 9,000 tokens on the CPU, most of the time
here: one server start, a few batched requests of texts of similar length, and the reference without padding,
computed beside the server, keep it short."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from tests.model.reference import encode_unpadded
from tests.model.sentences import SENTENCES
from tests.server.conftest import start_server
from tests.support import mpnet
from tests.tolerances import assert_unit_length, embedding_errors, tolerance

pytestmark = [pytest.mark.real_weights, pytest.mark.slow]

DIM = 768
MAX_SEQ_LENGTH = 384  # sentence_bert_config.json: longer inputs are truncated, by both sides alike
TEXT_COUNT = 200
REQUEST_SIZE = 50  # inputs per request: a few requests, each batched by the server


def _varied_texts(count: int = TEXT_COUNT, seed: int = 0) -> list[str]:
    """tests/model/sentences.py's sentences (unicode, emoji, numbers, code, odd whitespace, some past the limit), the
    limit's edge, then generated texts of words, numbers, code and other scripts in mixed case: mostly short, a few
    of hundreds of words (truncated), since each long text costs both sides a full 384-token forward on the CPU."""
    edge = [("word " * (MAX_SEQ_LENGTH - 2)).strip(),  # exactly 384 tokens with <s> and </s>
            ("word " * (MAX_SEQ_LENGTH - 1)).strip()]  # one over
    rng = random.Random(seed)
    words = sorted({w for s in SENTENCES for w in s.split() if len(w) < 30 and not any(c.isdigit() for c in w)})
    code = ["def", "f(x):", "return", "x**2", "{", "}", "[i]", "==", "!=", "->", "i++;", "#include", "<stdio.h>",
            "SELECT", "*", "FROM", "t;", "λx.x", "0xFF", "/*", "*/", "x_1", "camelCase", "snake_case"]
    other = ["東京", "北京", "서울", "Привет", "مرحبا", "שלום", "नमस्ते", "αβγ", "über", "Ünïcödé", "🍕", "🚀", "👩‍💻",
             "€", "℃", "½", "…", "—", "\u00a0", "\t", "\n"]

    def token() -> str:
        kind = rng.random()
        if kind < 0.6:
            return rng.choice(words)
        if kind < 0.75:
            return rng.choice([str(rng.randint(0, 10 ** rng.randint(1, 9))),
                               f"{rng.uniform(-1e4, 1e4):.{rng.randint(0, 6)}f}", f"{rng.random():.3e}",
                               f"{rng.randint(1, 31)}/{rng.randint(1, 12)}/{rng.randint(1900, 2100)}"])
        if kind < 0.9:
            return rng.choice(code)
        return rng.choice(other)

    def case(text: str) -> str:
        return rng.choice([str, str, str.lower, str.upper, str.title,
                           lambda t: "".join(c.upper() if rng.random() < 0.5 else c for c in t)])(text)

    generated = []
    while len(SENTENCES) + len(edge) + len(generated) < count:
        shape = rng.random()
        length = rng.randint(1, 20) if shape < 0.9 else rng.randint(21, 60) if shape < 0.985 else rng.randint(250, 400)
        generated.append(case(" ".join(token() for _ in range(length))))
    return [*SENTENCES, *edge, *generated]


TEXTS = _varied_texts()


@pytest.fixture(scope="module")
def reference(mpnet_dir) -> SentenceTransformer:
    return SentenceTransformer(str(mpnet_dir), device="cpu")


def test_the_assembled_directory_is_all_mpnet_base_v2(mpnet_dir, reference):
    for name in mpnet.MODEL_FILES:
        assert (mpnet_dir / name).is_file(), name
    assert reference.max_seq_length == MAX_SEQ_LENGTH
    embeddings = reference.encode(["A man is eating food.", "A man is eating a piece of bread.", "A monkey drums."],
                                  convert_to_tensor=True)
    assert embeddings.shape == (3, DIM)
    assert_unit_length(embeddings)  # its Normalize module
    similar, unrelated = float(embeddings[0] @ embeddings[1]), float(embeddings[0] @ embeddings[2])
    assert similar > 0.6 > unrelated, (similar, unrelated)  # real weights: meaning, not noise


def _through_the_server(openai, mpnet_dir, tmp_path, order: list[int], threads: int) -> tuple[list, int]:
    """The texts' embeddings (in TEXTS' order) and the tokens counted, from requests of REQUEST_SIZE texts sent in
    `order` to a server computing on `threads` cores.

    The CPU in float32 whatever this machine has (the acceptance: float32's tolerance); a base model's requests of 50
    inputs up to 384 tokens take longer on a 2-core CPU than the test servers' defaults allow. Operator settings that
    only spend time here are off: the warm-up (on the CPU it runs the largest batch once to warm the allocator and
    calibrates the int8 outputs, neither of which this test reads) and the kernel-timing samples (a sampled batch run
    again eagerly, every op timed)."""
    server = start_server(tmp_path, ready_timeout_s=600, model=str(mpnet_dir), device="cpu", dtype="float32",
                          request_timeout_s=600, warmup=False, kernel_timing_sample_rate=0, torch_threads=threads)
    ours, tokens = [None] * len(TEXTS), 0
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        (model,) = [m.id for m in client.models.list().data]
        for start in range(0, len(order), REQUEST_SIZE):
            chosen = order[start:start + REQUEST_SIZE]
            result = client.embeddings.create(input=[TEXTS[i] for i in chosen], model=model,
                                              encoding_format="float")
            assert [d.index for d in result.data] == list(range(len(chosen)))
            for i, d in zip(chosen, result.data):
                ours[i] = d.embedding
            tokens += result.usage.prompt_tokens
    finally:
        server.stop()
    return ours, tokens


def test_v1_embeddings_match_sentence_transformers(mpnet_dir, reference, tmp_path, record_property):
    openai = pytest.importorskip("openai")  # a dev dependency, missing only where the suite is not installed
    assert len(TEXTS) == TEXT_COUNT and len(set(TEXTS)) == TEXT_COUNT
    # every text truncated at 384 tokens as sentence-transformers truncates it, <s> and </s> counted
    counts = [len(ids) for ids in reference.tokenizer(TEXTS, truncation=True, max_length=MAX_SEQ_LENGTH)["input_ids"]]
    # Requests of texts of similar length, as a client batching its own inputs would send them: on the CPU attention
    # pads a batch to its longest input, so a 384-token text among short ones would cost 384 tokens for every row.
    # Each request still mixes lengths (3 to 13 tokens in the first, 44 to 384 in the last).
    order = sorted(range(TEXT_COUNT), key=lambda i: counts[i])
    # The reference computes in a thread of this process while the server computes, each on half of this process's
    # share of the cores (tests/conftest.py), at least one: under `make test` on 2 cores, one thread each, and two
    # single-threaded computations share cores without the spinning of one thread pool on a core another holds.
    share = torch.get_num_threads()
    torch.set_num_threads(max(1, share // 2))  # the reference's, in the thread started below
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(encode_unpadded, reference, TEXTS)
            ours, tokens = _through_the_server(openai, mpnet_dir, tmp_path, order, max(1, share - share // 2))
            theirs = pending.result().numpy()
    finally:
        torch.set_num_threads(share)
    assert len(ours) == len(theirs) == TEXT_COUNT and {len(row) for row in ours} == {DIM} and theirs.shape[1] == DIM
    assert_unit_length(np.array(ours))
    assert tokens == sum(counts)
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(ours, dtype=torch.float64),
                                                   torch.from_numpy(theirs).double(), dim=1)
    min_cosine, max_abs = embedding_errors(ours, theirs)
    record_property("min_cosine", min_cosine)
    record_property("max_abs_error", max_abs)
    print(f"\n{TEXT_COUNT} texts, {tokens} tokens: min cosine 1 - {1 - min_cosine:.1e}, max abs error {max_abs:.1e}")
    bound = tolerance(torch.float32).min_cosine
    under = int((cosine < bound).sum())
    worst = [f"{i}: {cosine[i]:.7f} {TEXTS[i][:60]!r}" for i in cosine.argsort()[:5].tolist()]
    assert not under, f"{under} rows under cosine {bound} against sentence-transformers; the worst:\n" + \
        "\n".join(worst)
