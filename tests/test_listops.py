"""ListOps generator: every label checked by a stack-machine evaluator written here, independently of the generator;
lengths, depth and argument counts, uniqueness, determinism, worker-count independence, the cache and the Dataset."""

import json
import math
import statistics

import numpy as np
import pytest
import torch

from flashtrain.data import listops
from flashtrain.data.listops import (PAD_ID, VOCAB, VOCAB_SIZE, ListOpsConfig, decode, encode, listops_sample,
                                     prepare_listops)
from flashtrain.data.lra_cache import load_split

TINY = dict(n_train=60, n_val=10, n_test=10, seed=3)


def evaluate(tokens: list[str]) -> tuple[int, int, list[int]]:
    """(value, deepest operator nesting, argument count of every operator) of a token string list, by a stack
    machine that knows the task only from its definition."""
    ops = {"[MIN": min, "[MAX": max, "[MED": lambda a: math.floor(statistics.median(a)), "[SM": lambda a: sum(a) % 10}
    stack = [("root", [])]
    depth = 0
    arg_counts = []
    for token in tokens:
        if token in ops:
            stack.append((token, []))
            depth = max(depth, len(stack) - 1)
        elif token == "]":
            op, args = stack.pop()
            arg_counts.append(len(args))
            stack[-1][1].append(ops[op](args))
        else:
            assert token.isdigit() and len(token) == 1, token
            stack[-1][1].append(int(token))
    assert len(stack) == 1 and len(stack[0][1]) == 1, "not one complete expression"
    return stack[0][1][0], depth, arg_counts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny data set made by 2 worker processes (the parallel path)."""
    cfg = ListOpsConfig(**TINY, num_proc=2, cache_dir=str(tmp_path_factory.mktemp("cache")))
    return cfg, prepare_listops(cfg)


def split_samples(directory, split):
    tokens, offsets, labels = load_split(directory, split)
    return [np.asarray(tokens[offsets[i]:offsets[i + 1]]) for i in range(len(labels))], labels


def test_evaluator_and_operators_on_hand_made_expressions():
    cases = {"[MAX 4 3 [MIN 2 3 ] 1 0 ]": 4, "[MED 2 5 ]": 3, "[MED 9 0 1 ]": 1, "[MED 1 2 3 8 ]": 2,
             "[SM 9 9 9 ]": 7, "[MIN [MAX 1 8 ] [SM 5 5 ] ]": 0, "[MED 4 4 5 5 ]": 4}
    for text, value in cases.items():
        assert evaluate(text.split())[0] == value, text
        ids = encode(text)
        assert decode(ids) == text
        assert listops.root_arguments(ids)[0] == text.split()[0]
    assert listops.apply_operator(listops.TOKEN_IDS["[MED"], [2, 5]) == 3  # floor of 3.5, as LRA's int(np.median)
    with pytest.raises(ValueError, match="not a ListOps token"):
        encode("[MAX 4 ( 3 ]")


def test_every_label_matches_an_independent_evaluator(tiny):
    cfg, data = tiny
    n_checked = 0
    all_labels = []
    for split in ("train", "val", "test"):
        samples, labels = split_samples(data.directory, split)
        assert len(samples) == getattr(cfg, f"n_{split}")
        for ids, label in zip(samples, labels):
            assert cfg.min_length < len(ids) < cfg.max_length
            assert ids.min() >= 1 and ids.max() < VOCAB_SIZE  # no padding inside a sample
            value, depth, arg_counts = evaluate([VOCAB[i] for i in ids])
            assert value == label
            assert depth <= cfg.max_depth - 1  # the root has depth 1, nodes at depth max_depth are digits
            assert min(arg_counts) >= 2 and max(arg_counts) <= cfg.max_args
            n_checked += 1
        all_labels.extend(labels.tolist())
    assert n_checked == 80
    assert set(all_labels) <= set(range(10)) and len(set(all_labels)) >= 6


def test_label_distribution_and_lengths_over_300_samples():
    cfg = ListOpsConfig(seed=11)
    samples = [listops_sample(cfg, "train", i) for i in range(300)]
    counts = np.bincount([label for _, label in samples], minlength=10)
    # every class occurs; 0 and 9 are the most common (MIN/MAX of many digits), as in LRA's data
    assert counts.min() >= 8
    assert counts[0] + counts[9] > 2 * np.median(counts)
    lengths = np.array([len(ids) for ids, _ in samples])
    assert lengths.min() > 500 and lengths.max() < 2000 and 800 < lengths.mean() < 1300
    assert len({ids.tobytes() for ids, _ in samples}) == 300


def test_deterministic_and_independent_of_workers_and_sizes(tiny, tmp_path):
    cfg, data = tiny
    one_worker = prepare_listops(ListOpsConfig(**TINY, num_proc=1, cache_dir=str(tmp_path / "a")))
    more = {**TINY, "n_train": 70}  # a larger train split: the first 60 samples are the same
    bigger = prepare_listops(ListOpsConfig(**more, num_proc=2, cache_dir=str(tmp_path / "b")))
    for split in ("train", "val", "test"):
        ids, labels = split_samples(data.directory, split)
        ids1, labels1 = split_samples(one_worker.directory, split)
        ids2, labels2 = split_samples(bigger.directory, split)
        assert all(np.array_equal(a, b) for a, b in zip(ids, ids1)) and np.array_equal(labels, labels1)
        assert all(np.array_equal(a, b) for a, b in zip(ids, ids2)) and np.array_equal(labels, labels2[:len(labels)])
    other_seed, _ = listops_sample(ListOpsConfig(seed=4), "train", 0)
    assert not np.array_equal(other_seed, split_samples(data.directory, "train")[0][0])
    # all 80 sequences differ (duplicates would have been drawn again)
    every = [a.tobytes() for s in ("train", "val", "test") for a in split_samples(data.directory, s)[0]]
    assert len(set(every)) == len(every)


def test_cache_hit_reads_the_same_directory_and_nothing_is_left_half_written(tiny):
    cfg, data = tiny
    meta_path = data.directory / "meta.json"
    mtime = meta_path.stat().st_mtime_ns
    again = prepare_listops(cfg)
    assert again.directory == data.directory and meta_path.stat().st_mtime_ns == mtime
    meta = json.loads(meta_path.read_text())
    assert meta["sizes"] == {"train": 60, "val": 10, "test": 10}
    assert "num_proc" not in meta["config"] and meta["config"]["seed"] == 3
    assert [p.name for p in data.directory.parent.iterdir()] == [data.directory.name]  # no temporary directory


def test_dataset_pads_with_pad_id_and_rejects_a_short_seq_len(tiny):
    _, data = tiny
    samples, labels = split_samples(data.directory, "val")
    dataset = data.dataset("val", seq_len=2048)
    assert len(dataset) == 10
    for i in (0, 9):
        tokens, label = dataset[i]
        assert tokens.shape == (2048,) and tokens.dtype == torch.int64 and label.item() == labels[i]
        n = len(samples[i])
        assert torch.equal(tokens[:n], torch.from_numpy(samples[i].astype(np.int64)))
        assert torch.all(tokens[n:] == PAD_ID)
    longest = max(len(s) for s in samples)
    assert data.dataset("val").seq_len == longest
    with pytest.raises(ValueError, match="shorter than the longest"):
        data.dataset("val", seq_len=longest - 1)
    with pytest.raises(IndexError):
        dataset[10]


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="n_train"):
        ListOpsConfig(n_train=-1)
    with pytest.raises(ValueError, match="min_length"):
        ListOpsConfig(min_length=2000, max_length=2000)
    with pytest.raises(ValueError, match="digit_prob"):
        ListOpsConfig(digit_prob=1.0)


def test_unfiltered_trees_follow_the_stated_distribution():
    """Before the length filter: the root is a digit with probability digit_prob, operators take 2..max_args
    arguments uniformly, and no tree nests deeper than max_depth - 1 operators."""
    import random

    cfg = ListOpsConfig(max_length=10**6)
    rng = random.Random(0)
    trees = [listops.draw_tree(rng, cfg) for _ in range(3000)]
    single_digit = np.mean([len(ids) == 1 for ids, _ in trees])
    assert abs(single_digit - 0.75) < 0.03  # 4.2 standard errors
    arg_counts, depths = [], []
    for ids, value in trees[:400]:
        got, depth, counts = evaluate([VOCAB[i] for i in ids])
        assert got == value
        arg_counts += counts
        depths.append(depth)
    assert max(depths) <= cfg.max_depth - 1
    assert set(arg_counts) == set(range(2, cfg.max_args + 1))
    assert abs(np.mean(arg_counts) - 6.0) < 0.3
