"""The flags of the small mock-data GPT that ``examples/pretrain_gpt.py`` trains in the
functional tests and the GPU report: one list, so the two train the same model."""

from __future__ import annotations


def gpt_flags(
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    seq_length: int = 32,
    vocab: int = 128,
) -> list[str]:
    """A GPT of this shape on mock data with the null tokenizer, the local transformer
    implementation and no fused CUDA kernels (all also valid on GPUs), no evaluation, with the
    distributed optimizer; the caller adds batch sizes, precision, schedule, iterations and
    backend."""
    return [
        "--num-layers",
        str(layers),
        "--hidden-size",
        str(hidden),
        "--num-attention-heads",
        str(heads),
        "--seq-length",
        str(seq_length),
        "--max-position-embeddings",
        str(seq_length),
        "--use-distributed-optimizer",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(vocab),
        "--transformer-impl",
        "local",
        "--no-gradient-accumulation-fusion",
        "--no-persist-layer-norm",
        "--no-masked-softmax-fusion",
        "--eval-iters",
        "0",
        "--eval-interval",
        "100000",
    ]


def schedule_flags(*, lr: str, min_lr: str) -> list[str]:
    """The cosine schedule with one warm-up iteration, weight decay, clipping and the seed."""
    return [
        "--lr",
        lr,
        "--min-lr",
        min_lr,
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "1",
        "--weight-decay",
        "0.01",
        "--clip-grad",
        "1.0",
        "--seed",
        "1234",
    ]
