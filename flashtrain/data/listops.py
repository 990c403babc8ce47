"""ListOps (Long Range Arena): evaluate a nested list expression of digits; the answer, 0-9, is the class.

    [MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]   ->   5

Operators, over the digits 0-9 (every result is again a digit):
    MIN, MAX   smallest / largest argument
    MED        floor of the median: the middle value of the sorted arguments for an odd count, the floor of the
               mean of the two middle values for an even count ([MED 2 5 ] = 3) -- LRA's int(np.median(x))
    SM         sum modulo 10

A tree is drawn top-down as in LRA's generator: the root has depth 1; a node of depth < max_depth is an operator
with probability 1 - digit_prob (0.25) and then has 2..max_args (10) arguments drawn uniformly, otherwise it is a
digit; a node of depth max_depth (10) is always a digit, so operators nest at most max_depth - 1 deep. Trees are
drawn until one has min_length < tokens < max_length (500, 2000; about 8% of draws), and sequences repeated
anywhere in the data set are drawn again (`lra_cache`, unique=True).

Tokens: "[MIN" "[MAX" "[MED" "[SM" open an operator, "]" closes it, "0".."9" are digits; ids in `VOCAB` order,
0 is padding. The LRA files also hold "(" and ")", which LRA's own input pipeline removes: not here.
"""

from __future__ import annotations

import argparse
import random
import textwrap
from dataclasses import dataclass
from typing import Optional

import numpy as np

from flashtrain.data.cache import DEFAULT_CACHE_DIR
from flashtrain.data.lra_cache import CachedSplits, build_cached, sample_seed
from flashtrain.data.task import ClassificationTask, DataSpec, check_val_samples

PAD_TOKEN = "<pad>"
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
VOCAB = (PAD_TOKEN, *(str(d) for d in range(10)), *OPERATORS, CLOSE)  # token id = position
VOCAB_SIZE = len(VOCAB)  # 16
TOKEN_IDS = {token: i for i, token in enumerate(VOCAB)}
PAD_ID = TOKEN_IDS[PAD_TOKEN]  # 0
DIGIT_IDS = tuple(TOKEN_IDS[str(d)] for d in range(10))  # digit d has id d + 1
OPERATOR_IDS = tuple(TOKEN_IDS[op] for op in OPERATORS)
CLOSE_ID = TOKEN_IDS[CLOSE]
NUM_CLASSES = 10


@dataclass
class ListOpsConfig:
    n_train: int = 96_000
    n_val: int = 2_000
    n_test: int = 2_000
    min_length: int = 500  # keep sequences of more than min_length tokens ...
    max_length: int = 2000  # ... and fewer than max_length tokens
    max_depth: int = 10  # nodes at this depth are digits; the root has depth 1
    max_args: int = 10  # an operator takes 2..max_args arguments
    digit_prob: float = 0.75  # probability that a node above max_depth is a digit
    seed: int = 0  # the data set is a pure function of the fields above
    num_proc: int = 0  # generating processes (0: every CPU); does not change the data
    cache_dir: str = DEFAULT_CACHE_DIR  # left at the default, $FLASHTRAIN_CACHE_DIR wins
    # validation passes score the first val_samples samples of the val split, for any batch size and process count
    # (null: the whole split)
    val_samples: Optional[int] = None

    def build(self) -> ClassificationTask:
        """Generate the splits (or find them in the cache); their classification task."""
        return ClassificationTask(prepare_listops(self), VOCAB_SIZE, NUM_CLASSES, PAD_ID, self.seed,
                                  val_samples=self.val_samples)

    def preview(self) -> DataSpec:
        """What build() provides, known before generating: the longest sample is known only after."""
        return DataSpec("classification", VOCAB_SIZE, None, "data.max_length", PAD_ID, NUM_CLASSES)

    def __post_init__(self) -> None:
        for name in ("n_train", "n_val", "n_test", "num_proc", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"listops.{name} must be >= 0, got {getattr(self, name)}")
        check_val_samples(self.val_samples)
        if not 0 <= self.min_length < self.max_length - 1:
            raise ValueError(f"listops needs 0 <= min_length < max_length - 1, got min_length={self.min_length}, "
                             f"max_length={self.max_length}")
        if self.max_depth < 2:
            raise ValueError(f"listops.max_depth must be >= 2 (depth 1 is the root), got {self.max_depth}")
        if self.max_args < 2:
            raise ValueError(f"listops.max_args must be >= 2, got {self.max_args}")
        if not 0.0 < self.digit_prob < 1.0:
            raise ValueError(f"listops.digit_prob must be in (0, 1), got {self.digit_prob}")


def apply_operator(operator_id: int, args: list[int]) -> int:
    """The digit that operator `operator_id` (an id of OPERATORS) gives for digit values `args`."""
    if operator_id == TOKEN_IDS["[MIN"]:
        return min(args)
    if operator_id == TOKEN_IDS["[MAX"]:
        return max(args)
    if operator_id == TOKEN_IDS["[MED"]:
        ordered = sorted(args)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) // 2
    if operator_id == TOKEN_IDS["[SM"]:
        return sum(args) % 10
    raise ValueError(f"operator_id must be one of {OPERATOR_IDS}, got {operator_id}")


class _TooLong(Exception):
    """A tree reached max_length tokens while being drawn."""


def draw_tree(rng: random.Random, cfg: ListOpsConfig) -> Optional[tuple[list[int], int]]:
    """One tree drawn top-down: (token ids, value), or None once it reaches max_length tokens (the rest of that
    tree is not drawn: it would be rejected anyway)."""
    ids: list[int] = []

    def node(depth: int) -> int:  # appends the node's tokens, returns its value; raises once too long
        if len(ids) >= cfg.max_length:
            raise _TooLong
        if depth < cfg.max_depth and rng.random() >= cfg.digit_prob:
            operator_id = OPERATOR_IDS[rng.randrange(len(OPERATORS))]
            n_args = rng.randint(2, cfg.max_args)
            ids.append(operator_id)
            value = apply_operator(operator_id, [node(depth + 1) for _ in range(n_args)])
            ids.append(CLOSE_ID)
            return value
        digit = rng.randrange(10)
        ids.append(DIGIT_IDS[digit])
        return digit

    try:
        value = node(1)
    except _TooLong:
        return None
    return ids, value


def listops_sample(cfg: ListOpsConfig, split: str, index: int, attempt: int = 0) -> tuple[np.ndarray, int]:
    """Sample `index` of `split`: (token ids uint8 (length,), value), the first tree of its own random stream with
    min_length < length < max_length."""
    rng = random.Random(sample_seed(cfg.seed, split, index, attempt))
    while True:
        tree = draw_tree(rng, cfg)
        if tree is not None and cfg.min_length < len(tree[0]) < cfg.max_length:
            return np.array(tree[0], dtype=np.uint8), tree[1]


def prepare_listops(cfg: ListOpsConfig) -> CachedSplits:
    """Generate the train/val/test splits (or find them in the cache); `.dataset(split, seq_len)` serves one as
    (token ids (seq_len,) int64 padded with PAD_ID, label) pairs."""
    sizes = {"train": cfg.n_train, "val": cfg.n_val, "test": cfg.n_test}
    return build_cached("listops", cfg, sizes, listops_sample, cache_dir=cfg.cache_dir, num_proc=cfg.num_proc,
                        unique=True, chunk_size=64)


def decode(ids) -> str:
    """Token ids -> the LRA text form, padding dropped: "[MAX 4 3 [MIN 2 3 ] 1 0 ]"."""
    return " ".join(VOCAB[i] for i in np.asarray(ids).tolist() if i != PAD_ID)


def encode(text: str) -> np.ndarray:
    """The LRA text form (whitespace-separated tokens) -> token ids uint8 (length,)."""
    try:
        return np.array([TOKEN_IDS[token] for token in text.split()], dtype=np.uint8)
    except KeyError as err:
        raise ValueError(f"{err.args[0]!r} is not a ListOps token; the vocabulary is {VOCAB[1:]}") from None


# ---- sample grid for docs/ ----------------------------------------------------------------------------------------

def root_arguments(ids) -> tuple[str, list[int]]:
    """(root operator, the values of its arguments) of a token sequence, by a stack machine: enough to check a
    label by eye."""
    stack: list[tuple[int, list[int]]] = []  # (operator id, values of its arguments so far), innermost last
    root = None
    for i in np.asarray(ids).tolist():
        if i in OPERATOR_IDS:
            stack.append((i, []))
        elif i == CLOSE_ID:
            operator_id, args = stack.pop()
            if not stack:
                root = (VOCAB[operator_id], args)
            else:
                stack[-1][1].append(apply_operator(operator_id, args))
        elif i != PAD_ID:
            stack[-1][1].append(DIGIT_IDS.index(i))
    if root is None or stack:
        raise ValueError("ids is not one complete bracketed expression")
    return root


def save_grid(path: str, rows: int = 4, cols: int = 4, seed: int = 0, chars_per_line: int = 56,
              lines: int = 9) -> None:
    """A rows x cols figure of generated test samples: the start of each sequence, the root operator with the
    values of its arguments, the length and the label."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = ListOpsConfig(seed=seed)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 2.4 * rows))
    for index, ax in enumerate(np.ravel(axes)):
        ids, label = listops_sample(cfg, "test", index)
        text = decode(ids)
        wrapped = textwrap.wrap(text, chars_per_line)[:lines]
        operator, args = root_arguments(ids)
        root = f"root: {operator} {' '.join(map(str, args))} ] = {label}"
        ax.text(0.0, 1.0, "\n".join(wrapped) + " ...\n\n" + root, family="monospace", fontsize=7, va="top",
                transform=ax.transAxes)
        ax.set_title(f"test #{index}: {len(ids)} tokens, label {label}", fontsize=9)
        ax.axis("off")
    fig.suptitle("ListOps samples (seed 0). MIN, MAX, MED (floor of the median), SM (sum mod 10); label = value. "
                 "'root' lists the values of the outermost operator's arguments", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="ListOps: write a PNG grid of samples")
    parser.add_argument("--grid", required=True, help="PNG path, e.g. docs/listops_samples.png")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    save_grid(args.grid, seed=args.seed)


if __name__ == "__main__":
    main()
