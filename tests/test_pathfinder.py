"""Pathfinder generator: labels checked from the pixels alone (are the two markers joined by ink?), the dashes,
the turning bound, balance, value range, determinism, worker-count independence, the cache and the Dataset."""

import math
import random

import numpy as np
import pytest
import torch

from flashtrain.data import pathfinder
from flashtrain.data.lra_cache import load_split
from flashtrain.data.pathfinder import (GEOMETRY, MAX_TURN, PathfinderConfig, generate_sample, pathfinder_sample,
                                        prepare_pathfinder, render)

# (resolution, dashes per curve, images): 256 px costs ~0.3 s an image to check
CASES = [(32, 14, 60), (32, 6, 20), (64, 14, 30), (64, 9, 10), (128, 14, 12), (128, 6, 6), (256, 14, 4),
         (256, 9, 2)]


def linked_components(ink: np.ndarray, link: float) -> tuple[np.ndarray, int]:
    """(labels (H, W) int, count): ink pixels joined by chains of steps of at most `link` pixels share a label
    1..count; background is 0. A breadth-first search over pixel centres, nothing from the generator."""
    reach = int(math.floor(link))
    offsets = [(dy, dx) for dy in range(-reach, reach + 1) for dx in range(-reach, reach + 1)
               if 0 < dy * dy + dx * dx <= link * link]
    unvisited = set(zip(*np.nonzero(ink)))
    labels = np.zeros(ink.shape, dtype=np.int64)
    count = 0
    while unvisited:
        count += 1
        queue = [unvisited.pop()]
        while queue:
            y, x = queue.pop()
            labels[y, x] = count
            for dy, dx in offsets:
                if (y + dy, x + dx) in unvisited:
                    unvisited.remove((y + dy, x + dx))
                    queue.append((y + dy, x + dx))
    return labels, count


def markers_joined(image: np.ndarray, markers: np.ndarray, link: float) -> tuple[bool, int]:
    """(whether the pixels under the two marker centres are in one linked piece of ink, number of pieces)."""
    labels, count = linked_components(image > 0, link)
    (ya, xa), (yb, xb) = ((int(y), int(x)) for x, y in markers)
    assert image[ya, xa] == 255 and image[yb, xb] == 255  # a marker is a solid disc
    return bool(labels[ya, xa] == labels[yb, xb]), count


@pytest.mark.parametrize("resolution,curve_length,n_images", CASES)
def test_label_is_whether_ink_joins_the_markers(resolution, curve_length, n_images):
    """Dashes of one curve are at most paddle_gap apart and different curves at least `clearance`, so linking ink
    pixels closer than paddle_gap + 1 px (antialiasing adds <= 0.5 px to each side) recovers the curves."""
    link = GEOMETRY[resolution].paddle_gap + 1
    rng = random.Random(resolution * 100 + curve_length)
    labels = []
    for i in range(n_images):
        label = i % 2
        sample = generate_sample(resolution, curve_length, label, rng)
        joined, n_pieces = markers_joined(sample.image, sample.markers, link)
        assert joined == bool(label)
        assert n_pieces == len(sample.curves)  # every curve one piece, no two curves touching
        # the two targets alone (a debug render without distractors): the same answer, two pieces
        targets_only = render(resolution, sample.curves[:2], sample.markers)
        assert markers_joined(targets_only, sample.markers, link) == (bool(label), 2)
        labels.append(label)
    assert sum(labels) == n_images // 2


@pytest.mark.parametrize("resolution", [128, 256])
def test_curves_are_made_of_separate_dashes(resolution):
    """Without linking, the bright pixels (centres inside a dash) of the two target curves fall apart into one
    piece per dash."""
    rng = random.Random(resolution)
    sample = generate_sample(resolution, 9, 1, rng)
    dashes_only = render(resolution, sample.curves[:2], np.zeros((0, 2)))
    _, n_pieces = linked_components(dashes_only >= 128, 1.5)
    assert n_pieces == 2 * 9


def test_turns_measured_from_the_pixels_stay_within_the_bound():
    """At 256 px each dash of the two targets is a bright bar of about 10 x 2.5 px: its axis (principal axis of
    its pixels) and its neighbours along the curve (bars within paddle_gap + 1.5 px) come from the image alone.
    Neighbouring axes differ by at most MAX_TURN, up to the error of measuring a bar's axis on pixels."""
    geometry = GEOMETRY[256]
    measured_turns = []
    for seed in range(2):
        sample = generate_sample(256, 14, seed % 2, random.Random(seed))
        labels, n_dashes = linked_components(render(256, sample.curves[:2], np.zeros((0, 2))) >= 128, 1.5)
        assert n_dashes == 28
        pixels = [np.stack(np.nonzero(labels == k)[::-1], axis=1).astype(float) for k in range(1, n_dashes + 1)]
        axes = []
        for xy in pixels:  # (m, 2) pixel coordinates of one bar
            eigenvalues, eigenvectors = np.linalg.eigh(np.cov(xy.T))
            axes.append(math.atan2(eigenvectors[1, -1], eigenvectors[0, -1]))  # axis of the largest spread
        n_neighbours = np.zeros(n_dashes, dtype=int)
        for i in range(n_dashes):
            for j in range(i + 1, n_dashes):
                gap = np.sqrt(((pixels[i][:, None] - pixels[j][None]) ** 2).sum(-1)).min()
                if gap <= geometry.paddle_gap + 1.5:
                    n_neighbours[[i, j]] += 1
                    turn = (axes[i] - axes[j] + math.pi / 2) % math.pi - math.pi / 2  # axes have no direction
                    measured_turns.append(abs(turn))
        # two chains of 14 bars: 4 ends with one neighbour, 24 bars with two
        assert sorted(n_neighbours.tolist()) == [1] * 4 + [2] * 24
    assert max(measured_turns) <= MAX_TURN + math.radians(6)
    assert max(measured_turns) > math.radians(25)  # the curves do turn


@pytest.mark.parametrize("resolution", list(GEOMETRY))
def test_curve_geometry_keeps_the_turning_bound_and_the_border(resolution):
    geometry = GEOMETRY[resolution]
    rng = random.Random(7)
    turns = []
    for i in range(6 if resolution < 256 else 2):
        sample = generate_sample(resolution, 14, i % 2, rng)
        for curve in sample.curves:
            start, end = curve.paddles[:, 0], curve.paddles[:, 1]  # (n, 2) each
            along = end - start
            np.testing.assert_allclose(np.hypot(*along.T), geometry.paddle_length, rtol=1e-9)
            # the direction of each dash, measured from its end points
            angles = np.arctan2(along[:, 1], along[:, 0])
            turn = np.angle(np.exp(1j * np.diff(angles)))  # wrapped to (-pi, pi]
            assert np.all(np.abs(turn) <= MAX_TURN + 1e-9)
            turns.extend(turn.tolist())
            gaps = np.hypot(*(start[1:] - end[:-1]).T)
            assert np.all(gaps <= geometry.paddle_gap + 1e-9) and np.all(gaps >= geometry.paddle_gap * 0.9)
            inside = geometry.border + geometry.paddle_width / 2
            assert np.all(curve.paddles >= inside - 1e-9) and np.all(curve.paddles <= resolution - inside + 1e-9)
    # the turns spread over the allowed range, not stuck at 0
    assert max(turns) > 0.8 * MAX_TURN and min(turns) < -0.8 * MAX_TURN


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = PathfinderConfig(resolution=32, curve_length=9, n_train=10, n_val=4, n_test=5, seed=5, num_proc=2,
                           cache_dir=str(tmp_path_factory.mktemp("cache")))
    return cfg, prepare_pathfinder(cfg)


def test_cached_splits_shapes_values_balance(tiny):
    cfg, data = tiny
    for split, n in (("train", 10), ("val", 4), ("test", 5)):
        tokens, offsets, labels = load_split(data.directory, split)
        assert np.array_equal(offsets, np.arange(n + 1) * 32 * 32)
        assert tokens.dtype == np.uint8 and tokens.max() == 255 and tokens.min() == 0
        assert abs(int(labels.sum()) * 2 - n) <= 1  # balanced: even indices 0, odd indices 1
        assert set(labels.tolist()) <= {0, 1}
    dataset = data.dataset("train")
    pixels, label = dataset[3]
    assert pixels.shape == (1024,) and pixels.dtype == torch.int64 and label.item() == 1
    # the flattened image is row-major: pixel (row i, column j) is token i * 32 + j
    image, expected_label = pathfinder_sample(cfg, "train", 3)
    assert torch.equal(pixels, torch.from_numpy(image.astype(np.int64))) and expected_label == 1


def test_deterministic_and_independent_of_workers(tiny, tmp_path):
    cfg, data = tiny
    one_worker = prepare_pathfinder(PathfinderConfig(**{**vars(cfg), "num_proc": 1, "cache_dir": str(tmp_path)}))
    assert one_worker.directory.name == data.directory.name  # same key: num_proc and cache_dir are not in it
    for split in ("train", "val", "test"):
        for a, b in zip(load_split(data.directory, split), load_split(one_worker.directory, split)):
            assert np.array_equal(a, b)
    other = pathfinder_sample(PathfinderConfig(**{**vars(cfg), "seed": 6}), "train", 0)[0]
    assert not np.array_equal(other, load_split(data.directory, "train")[0][:1024])
    other_split = pathfinder_sample(cfg, "val", 0)[0]
    assert not np.array_equal(other_split, load_split(data.directory, "train")[0][:1024])


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="resolution"):
        PathfinderConfig(resolution=48)
    with pytest.raises(ValueError, match="curve_length"):
        PathfinderConfig(curve_length=7)
    with pytest.raises(ValueError, match="n_val"):
        PathfinderConfig(n_val=-1)
    with pytest.raises(ValueError, match="label"):
        generate_sample(32, 6, 2, random.Random(0))


def test_geometry_table_keeps_curves_apart_by_more_than_the_link():
    """The guarantee the image check above rests on: ink pixels lie within 0.5 px of a shape, so ink of
    different curves is at least clearance - 1 apart, which must exceed the link paddle_gap + 1."""
    for resolution, geometry in GEOMETRY.items():
        assert geometry.clearance - 1 > geometry.paddle_gap + 1, resolution
        assert geometry.marker_radius > geometry.paddle_gap / 2  # a marker touches its curve's end dash
        assert geometry.paddle_gap >= 0.5 and geometry.paddle_width < 2 * geometry.marker_radius
    assert pathfinder.CURVE_LENGTHS == (6, 9, 14)


@pytest.mark.parametrize("resolution", [32, 128])
def test_labels_differ_only_in_the_markers(resolution):
    """The same random stream lays out the same curves for both labels; only the markers move, and the distance
    between them is the same, so neither the layout nor the marker distance gives the label away."""
    radius = GEOMETRY[resolution].marker_radius
    link = GEOMETRY[resolution].paddle_gap + 1
    for seed in range(4):
        negative = generate_sample(resolution, 9, 0, random.Random(seed))
        positive = generate_sample(resolution, 9, 1, random.Random(seed))
        for a, b in zip(negative.curves, positive.curves):
            assert np.array_equal(a.paddles, b.paddles)
        np.testing.assert_allclose(np.hypot(*(negative.markers[1] - negative.markers[0])),
                                   np.hypot(*(positive.markers[1] - positive.markers[0])), rtol=1e-9)
        # pixels that differ lie within a marker disc (+ 1 px of antialiasing) of one of the four markers
        ys, xs = np.nonzero(negative.image != positive.image)
        centres = np.concatenate([negative.markers, positive.markers])  # (4, 2)
        near = np.hypot(xs[:, None] + 0.5 - centres[:, 0], ys[:, None] + 0.5 - centres[:, 1]).min(axis=1)
        assert len(ys) > 0 and np.all(near <= radius + 1)
        assert not markers_joined(negative.image, negative.markers, link)[0]
        assert markers_joined(positive.image, positive.markers, link)[0]
