"""Pathfinder (Long Range Arena), Path-X and Path-256: are the two circles joined by one dashed curve?

Each grayscale image holds white dashed curves on black. A curve is a chain of `curve_length` straight dashes
("paddles"); from one dash to the next the direction turns by a uniform angle in [-MAX_TURN, MAX_TURN] (45
degrees), so curves are smooth. Two curves are targets; the others are distractors made of the same dashes,
max(2, curve_length // 3) of them. Two filled circles ("markers") sit on curve ends. Label 1: on the two ends of
the first target. Label 0: on one end of the first target and on the start of the second, which the layout put
exactly as far from that end as the first target's two ends are apart, so the distance between the markers has
the same distribution in both classes and tells nothing. The layout does not depend on the label (the same random
stream gives the same curves for both labels, only the markers move); even sample indices are negatives, odd ones
positives, so every split is balanced.

Layout: a curve starts at a uniform point (the second target: a uniform point of that circle) with a uniform
direction and grows dash by dash. Every curve keeps room for a marker disc at both ends. A dash or disc stays
`border` inside the image and at least `clearance` away from every dash or disc of another curve, and of its own
curve beyond the next few along it (`PathfinderGeometry.self_skip`), so curves neither touch nor cross themselves.
A dash that does not fit is drawn again with a new turn (PADDLE_TRIES); a curve that cannot be finished is started
again (CURVE_TRIES, DISTRACTOR_TRIES); distractors that find no room are left out. `clearance` exceeds the gap
between the dashes of one curve by more than 2 px, so the curves can be told apart by eye, and by a program: link
ink pixels no more than paddle_gap + 1 px apart and each curve is one connected piece (tests/test_pathfinder.py).

Difficulty is the curve length: 6, 9 or 14 dashes (LRA's easy / intermediate / hard; Path-X and Path-256 use 14).
Sizes in pixels per resolution. The layout scales about linearly with the image (a 14-dash curve is about 0.9
resolution long); widths, markers and clearance grow more slowly so that they stay visible at 32 and thin at 256,
which leaves room for more distractors at higher resolutions:

    resolution  dash length  dash width  gap   clearance  marker radius  border  distractors (at most)
        32          1.4         1.0      0.6      3.0         1.5          0.5        4
        64          2.5         1.2      1.5      4.0         2.2          1.0        6
       128          5.0         1.6      3.0      6.0         3.5          2.0       10
       256         10.0         2.5      6.0     10.0         6.0          3.0       14

With 14-dash curves about 1 (32 px), 3 (64), 5 (128) and 8 (256) distractors find room on average; with 6-dash
curves about 3, 5, 9 and 12.

Drawing is antialiased in numpy: a pixel takes clip(0.5 - d, 0, 1) of full white, d the signed distance from its
centre to a shape (rectangle or disc), which approximates the covered fraction of the pixel; overlapping shapes
take the maximum. A pixel is >= 128 exactly when its centre lies inside a shape, and nonzero only within 0.5 px of
one. The image is flattened row by row (pixel (row i, column j) is token i * resolution + j) into resolution**2
tokens with values 0-255.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np

from flashtrain.data.cache import DEFAULT_CACHE_DIR
from flashtrain.data.lra_cache import CachedSplits, build_cached, sample_seed
from flashtrain.data.task import ClassificationTask, DataSpec, check_val_samples

MAX_TURN = math.radians(45)  # largest change of direction between consecutive dashes of a curve
CURVE_LENGTHS = (6, 9, 14)  # dashes per curve: easy, intermediate, hard
PADDLE_TRIES = 12  # turns drawn for one dash before its curve is started again
CURVE_TRIES = 40  # starts of a target curve before the image is started again
DISTRACTOR_TRIES = 6  # starts of a distractor curve before it is left out
IMAGE_TRIES = 50


@dataclass(frozen=True)
class PathfinderGeometry:
    """Sizes in pixels of one resolution (see the module docstring's table)."""

    paddle_length: float  # one dash
    paddle_width: float
    paddle_gap: float  # along the curve, between consecutive dashes of a straight curve (less when it turns)
    clearance: float  # smallest distance between shapes of different curves
    marker_radius: float
    border: float  # every shape stays this far inside the image
    n_distractors: int  # distractor curves placed when there is room

    @property
    def step(self) -> float:
        return self.paddle_length + self.paddle_gap

    @property
    def self_skip(self) -> int:
        """Elements of one curve (start marker, dashes, end marker) this many places apart or more keep
        `clearance` too: fewer places apart they are close along the curve, so their distance is no crossing."""
        return 2 + math.ceil((self.clearance + self.marker_radius + self.paddle_width / 2) / self.step)


GEOMETRY = {
    32: PathfinderGeometry(1.4, 1.0, 0.6, 3.0, 1.5, 0.5, 4),
    64: PathfinderGeometry(2.5, 1.2, 1.5, 4.0, 2.2, 1.0, 6),
    128: PathfinderGeometry(5.0, 1.6, 3.0, 6.0, 3.5, 2.0, 10),
    256: PathfinderGeometry(10.0, 2.5, 6.0, 10.0, 6.0, 3.0, 14),
}


@dataclass
class PathfinderConfig:
    resolution: int = 32  # 32 | 64 | 128 (Path-X) | 256 (Path-256); tokens per image: resolution**2
    curve_length: int = 14  # dashes per curve: 6 | 9 | 14
    n_train: int = 160_000  # LRA's 80/10/10 split of 200K images
    n_val: int = 20_000
    n_test: int = 20_000
    seed: int = 0  # the data set is a pure function of the fields above
    num_proc: int = 0  # generating processes (0: every CPU); does not change the data
    cache_dir: str = DEFAULT_CACHE_DIR  # left at the default, $FLASHTRAIN_CACHE_DIR wins
    # validation passes score the first val_samples samples of the val split, for any batch size and process count
    # (null: the whole split)
    val_samples: Optional[int] = None

    def build(self) -> ClassificationTask:
        """Generate the splits (or find them in the cache): pixel values 0..255, no padding, connected or not."""
        return ClassificationTask(prepare_pathfinder(self), 256, 2, None, self.seed, length_field="data.resolution",
                                  val_samples=self.val_samples)

    def preview(self) -> DataSpec:
        """What build() provides, known before generating: resolution**2 pixel tokens 0..255, 2 classes."""
        return DataSpec("classification", 256, self.resolution ** 2, "data.resolution", None, 2)

    def __post_init__(self) -> None:
        if self.resolution not in GEOMETRY:
            raise ValueError(f"pathfinder.resolution must be one of {tuple(GEOMETRY)}, got {self.resolution}")
        if self.curve_length not in CURVE_LENGTHS:
            raise ValueError(f"pathfinder.curve_length must be one of {CURVE_LENGTHS}, got {self.curve_length}")
        for name in ("n_train", "n_val", "n_test", "num_proc", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"pathfinder.{name} must be >= 0, got {getattr(self, name)}")
        check_val_samples(self.val_samples)


@dataclass
class Curve:
    """One dashed curve, in pixel coordinates (x to the right, y down; pixel (row i, column j) has its centre at
    x = j + 0.5, y = i + 0.5)."""

    paddles: np.ndarray  # (n, 2, 2) float64: start and end point (x, y) of each dash, in drawing order
    angles: np.ndarray  # (n,) float64: direction of each dash, radians
    ends: np.ndarray  # (2, 2) float64: where a marker goes at the start and at the end of the curve


@dataclass
class PathfinderSample:
    image: np.ndarray  # (resolution, resolution) uint8
    label: int  # 1: both markers on one curve
    curves: list[Curve]  # the two targets, then the distractors
    markers: np.ndarray  # (2, 2) float64: marker centres (x, y)


def generate_sample(resolution: int, curve_length: int, label: int, rng: random.Random) -> PathfinderSample:
    """One image of the given label, laid out and drawn with the random stream `rng`."""
    if resolution not in GEOMETRY:
        raise ValueError(f"resolution must be one of {tuple(GEOMETRY)}, got {resolution}")
    if curve_length < 2:
        raise ValueError(f"curve_length must be >= 2, got {curve_length}")
    if label not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {label}")
    geometry = GEOMETRY[resolution]
    for _ in range(IMAGE_TRIES):
        layout = _Layout(resolution, geometry)
        laid_out = _lay_out_targets(layout, rng, curve_length, label)
        if laid_out is not None:
            break
    else:
        raise RuntimeError(f"could not lay out two curves of {curve_length} dashes at {resolution} px in "
                           f"{IMAGE_TRIES} tries: the GEOMETRY table leaves too little room")
    first, second, markers = laid_out
    distractors = [layout.grow_curve(rng, max(2, curve_length // 3), DISTRACTOR_TRIES)
                   for _ in range(geometry.n_distractors)]
    curves = [first, second] + [c for c in distractors if c is not None]
    image = render(resolution, curves, markers, geometry)
    return PathfinderSample(image=image, label=label, curves=curves, markers=markers)


def render(resolution: int, curves: list[Curve], markers: np.ndarray,
           geometry: Optional[PathfinderGeometry] = None) -> np.ndarray:
    """(resolution, resolution) uint8: the dashes of `curves` and discs at `markers`, antialiased, white on black."""
    geometry = GEOMETRY[resolution] if geometry is None else geometry
    canvas = np.zeros((resolution, resolution), dtype=np.float32)
    for curve in curves:
        for (start, end) in curve.paddles:
            _draw_dash(canvas, start, end, geometry.paddle_width / 2)
    for centre in markers:
        _draw_disc(canvas, centre, geometry.marker_radius)
    return np.rint(canvas * 255).astype(np.uint8)


def pathfinder_sample(cfg: PathfinderConfig, split: str, index: int, attempt: int = 0) -> tuple[np.ndarray, int]:
    """Sample `index` of `split`: (pixels uint8 (resolution**2,), label), label = index % 2."""
    label = index % 2
    rng = random.Random(sample_seed(cfg.seed, split, index, attempt))
    return generate_sample(cfg.resolution, cfg.curve_length, label, rng).image.reshape(-1), label


def prepare_pathfinder(cfg: PathfinderConfig) -> CachedSplits:
    """Generate the train/val/test splits (or find them in the cache); `.dataset(split)` serves one as
    (pixels (resolution**2,) int64, label) pairs."""
    sizes = {"train": cfg.n_train, "val": cfg.n_val, "test": cfg.n_test}
    return build_cached(f"pathfinder{cfg.resolution}", cfg, sizes, pathfinder_sample, cache_dir=cfg.cache_dir,
                        num_proc=cfg.num_proc, unique=False, chunk_size=max(4, 2 ** 16 // cfg.resolution ** 2))


# ---- layout ------------------------------------------------------------------------------------------------------

def _lay_out_targets(layout: _Layout, rng: random.Random, curve_length: int,
                     label: int) -> Optional[tuple[Curve, Curve, np.ndarray]]:
    """(first target, second target, markers (2, 2)), or None if the layout found no room.

    Positive markers sit on the two ends of the first target. The second target starts as far from one end of the
    first as the first's two ends are apart, and negative markers sit on that end and on that start: marker
    distance alone cannot tell the classes apart. The layout does not depend on the label.
    """
    first = layout.grow_curve(rng, curve_length, CURVE_TRIES)
    if first is None:
        return None
    end = first.ends[rng.randrange(2)]
    span = math.hypot(*(first.ends[1] - first.ends[0]))
    second = layout.grow_curve(rng, curve_length, CURVE_TRIES, start_circle=(end, span))
    if second is None:
        return None
    markers = first.ends.copy() if label == 1 else np.stack([end, second.ends[0]])
    return first, second, markers


class _Layout:
    """The shapes placed so far, each a capsule: the points within `radius` of a segment (a disc: a segment of
    length 0). A dash, a rectangle, lies inside its capsule, so capsule distances are safe bounds.

    Shapes are filed in a grid of square cells by their centre; a cell is as wide as the centres of two shapes
    can be while they are closer than `clearance` (twice the largest half-extent, plus clearance), so a new shape
    need only be compared with the shapes of the 3 x 3 cells around its own. Plain Python floats: numpy costs
    more than it saves on a handful of shapes.
    """

    def __init__(self, resolution: int, geometry: PathfinderGeometry):
        self.resolution = resolution
        self.geometry = geometry
        largest_extent = max(geometry.paddle_length / 2 + geometry.paddle_width / 2, geometry.marker_radius)
        self.cell = 2 * largest_extent + geometry.clearance
        self.self_skip = geometry.self_skip
        # (ax, ay, bx, by, radius, curve, position, centre x, centre y, half-extent) of each shape
        self.shapes: list[tuple] = []
        self.cells: dict[tuple[int, int], list[int]] = {}
        self.n_curves = 0

    def fits(self, ax: float, ay: float, bx: float, by: float, radius: float, curve: int, position: int) -> bool:
        lo = self.geometry.border + radius
        hi = self.resolution - lo
        if not (lo <= ax <= hi and lo <= ay <= hi and lo <= bx <= hi and lo <= by <= hi):
            return False
        clearance = self.geometry.clearance
        self_skip = self.self_skip
        cx, cy = (ax + bx) / 2, (ay + by) / 2
        extent = math.hypot(bx - ax, by - ay) / 2 + radius
        i, j = int(cx // self.cell), int(cy // self.cell)
        for key in ((i - 1, j - 1), (i - 1, j), (i - 1, j + 1), (i, j - 1), (i, j), (i, j + 1),
                    (i + 1, j - 1), (i + 1, j), (i + 1, j + 1)):
            for index in self.cells.get(key, ()):
                sax, say, sbx, sby, sradius, scurve, sposition, scx, scy, sextent = self.shapes[index]
                if scurve == curve and abs(sposition - position) < self_skip:
                    continue
                if math.hypot(cx - scx, cy - scy) >= extent + sextent + clearance:
                    continue  # the bounding circles are far enough apart
                if _segment_distance(ax, ay, bx, by, sax, say, sbx, sby) < radius + sradius + clearance:
                    return False
        return True

    def add(self, ax: float, ay: float, bx: float, by: float, radius: float, curve: int, position: int) -> None:
        cx, cy = (ax + bx) / 2, (ay + by) / 2
        extent = math.hypot(bx - ax, by - ay) / 2 + radius
        self.cells.setdefault((int(cx // self.cell), int(cy // self.cell)), []).append(len(self.shapes))
        self.shapes.append((ax, ay, bx, by, radius, curve, position, cx, cy, extent))

    def count(self) -> tuple[int, int]:
        """(shapes, curves) placed so far: a point to go back to with `truncate`."""
        return len(self.shapes), self.n_curves

    def truncate(self, count: tuple[int, int]) -> None:
        """Remove the shapes and curves added since `count()` gave `count` (the shapes are the last of their
        cells' lists)."""
        n_shapes, self.n_curves = count
        while len(self.shapes) > n_shapes:
            shape = self.shapes.pop()
            self.cells[(int(shape[7] // self.cell), int(shape[8] // self.cell))].pop()

    def grow_curve(self, rng: random.Random, n_paddles: int, tries: int,
                   start_circle: Optional[tuple[np.ndarray, float]] = None) -> Optional[Curve]:
        """Lay out one curve of n_paddles dashes with room for a marker at each end, or None if `tries` starts
        found no room. It starts at a uniform point of the image, or of the circle start_circle = (centre (2,),
        radius)."""
        g = self.geometry
        curve = self.n_curves
        half_gap = g.paddle_gap / 2
        dash_radius = g.paddle_width / 2
        lo = g.border + g.marker_radius
        hi = self.resolution - lo
        for _ in range(tries):
            first = self.count()  # rolled back to here when the curve fails
            if start_circle is None:
                x, y = rng.uniform(lo, hi), rng.uniform(lo, hi)  # the joint before the next dash
            else:
                (cx, cy), radius = start_circle
                towards = rng.uniform(-math.pi, math.pi)
                x, y = cx + radius * math.cos(towards), cy + radius * math.sin(towards)
            if not self.fits(x, y, x, y, g.marker_radius, curve, 0):
                continue
            self.add(x, y, x, y, g.marker_radius, curve, 0)
            start = (x, y)
            angle = rng.uniform(-math.pi, math.pi)
            paddles, angles = [], []
            for position in range(1, n_paddles + 1):
                for _ in range(PADDLE_TRIES):
                    turned = angle if position == 1 else angle + rng.uniform(-MAX_TURN, MAX_TURN)
                    ux, uy = math.cos(turned), math.sin(turned)
                    # the dash covers the middle paddle_length of one step of the curve, between two joints
                    ax, ay = x + half_gap * ux, y + half_gap * uy
                    bx, by = x + (g.step - half_gap) * ux, y + (g.step - half_gap) * uy
                    if self.fits(ax, ay, bx, by, dash_radius, curve, position):
                        break
                else:
                    break
                self.add(ax, ay, bx, by, dash_radius, curve, position)
                paddles.append(((ax, ay), (bx, by)))
                angles.append(turned)
                angle = turned
                x, y = x + g.step * ux, y + g.step * uy
            if len(paddles) == n_paddles and self.fits(x, y, x, y, g.marker_radius, curve, n_paddles + 1):
                self.add(x, y, x, y, g.marker_radius, curve, n_paddles + 1)
                self.n_curves += 1
                return Curve(paddles=np.array(paddles), angles=np.array(angles), ends=np.array([start, (x, y)]))
            self.truncate(first)
        return None


def _segment_distance(ax: float, ay: float, bx: float, by: float, cx: float, cy: float, dx: float, dy: float) -> float:
    """Distance between segments a-b and c-d."""
    # crossing segments have distance 0, though no end point is near the other segment
    abx, aby, cdx, cdy = bx - ax, by - ay, dx - cx, dy - cy
    c_side = abx * (cy - ay) - aby * (cx - ax)
    d_side = abx * (dy - ay) - aby * (dx - ax)
    a_side = cdx * (ay - cy) - cdy * (ax - cx)
    b_side = cdx * (by - cy) - cdy * (bx - cx)
    if c_side * d_side < 0 and a_side * b_side < 0:
        return 0.0
    return min(_point_segment_distance(ax, ay, cx, cy, dx, dy), _point_segment_distance(bx, by, cx, cy, dx, dy),
               _point_segment_distance(cx, cy, ax, ay, bx, by), _point_segment_distance(dx, dy, ax, ay, bx, by))


def _point_segment_distance(px: float, py: float, ax: float, ay: float, bx: float, by: float) -> float:
    abx, aby = bx - ax, by - ay
    length2 = abx * abx + aby * aby
    t = 0.0 if length2 == 0.0 else min(max(((px - ax) * abx + (py - ay) * aby) / length2, 0.0), 1.0)
    return math.hypot(px - ax - t * abx, py - ay - t * aby)


# ---- drawing -----------------------------------------------------------------------------------------------------

def _window(canvas: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """Rows, columns and pixel-centre coordinates (ys (h, 1), xs (1, w)) of the pixels whose centres may fall
    within [lo, hi] (x, y), clipped to the canvas."""
    size = canvas.shape[0]
    x0, y0 = (max(int(math.floor(v - 1)), 0) for v in lo)
    x1, y1 = (min(int(math.ceil(v + 1)), size) for v in hi)
    ys = np.arange(y0, y1, dtype=np.float32)[:, None] + 0.5
    xs = np.arange(x0, x1, dtype=np.float32)[None, :] + 0.5
    return slice(y0, y1), slice(x0, x1), ys, xs


def _draw_dash(canvas: np.ndarray, start: np.ndarray, end: np.ndarray, half_width: float) -> None:
    """Max-blend a rectangle from `start` to `end` (flat ends), `2 * half_width` wide."""
    centre = (start + end) / 2
    along = end - start
    half_length = math.hypot(*along) / 2
    ux, uy = along / (2 * half_length)
    reach = half_length + half_width
    rows, cols, ys, xs = _window(canvas, centre - reach, centre + reach)
    dx, dy = xs - centre[0], ys - centre[1]
    outside_along = np.abs(dx * ux + dy * uy) - half_length  # (h, w) signed distance to each pair of sides
    outside_across = np.abs(dx * uy - dy * ux) - half_width
    signed_distance = (np.hypot(np.maximum(outside_along, 0), np.maximum(outside_across, 0))
                       + np.minimum(np.maximum(outside_along, outside_across), 0))
    np.maximum(canvas[rows, cols], np.clip(0.5 - signed_distance, 0, 1), out=canvas[rows, cols])


def _draw_disc(canvas: np.ndarray, centre: np.ndarray, radius: float) -> None:
    rows, cols, ys, xs = _window(canvas, centre - radius, centre + radius)
    signed_distance = np.hypot(xs - centre[0], ys - centre[1]) - radius
    np.maximum(canvas[rows, cols], np.clip(0.5 - signed_distance, 0, 1), out=canvas[rows, cols])


# ---- sample grid for docs/ ----------------------------------------------------------------------------------------

def save_grid(path: str, cols: int = 4, curve_length: int = 14, seed: int = 0) -> None:
    """One row of `cols` test samples per resolution (32, 64, 128, 256), each titled with its label."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    resolutions = tuple(GEOMETRY)
    fig, axes = plt.subplots(len(resolutions), cols, figsize=(3.2 * cols, 3.4 * len(resolutions)))
    for row, resolution in enumerate(resolutions):
        cfg = PathfinderConfig(resolution=resolution, curve_length=curve_length, seed=seed)
        for col in range(cols):
            pixels, label = pathfinder_sample(cfg, "test", col)
            ax = axes[row, col]
            ax.imshow(pixels.reshape(resolution, resolution), cmap="gray", vmin=0, vmax=255, interpolation="nearest")
            ax.set_title(f"{resolution} px, #{col}: label {label} ({'connected' if label else 'not connected'})",
                         fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(f"Pathfinder samples, {curve_length} dashes per curve (seed {seed}): are the two circles on "
                 f"one curve?", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Pathfinder: write a PNG grid of samples")
    parser.add_argument("--grid", required=True, help="PNG path, e.g. docs/pathfinder_samples.png")
    parser.add_argument("--curve-length", type=int, default=14, choices=CURVE_LENGTHS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    save_grid(args.grid, curve_length=args.curve_length, seed=args.seed)


if __name__ == "__main__":
    main()
