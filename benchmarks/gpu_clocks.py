"""The GPU's SM clock and board power while a block of work runs, sampled by `nvidia-smi -lms`: what the sustained
modes (attention.py --sustained, probes/ab_probe.py --clocks, probes/clock_probe.py) report beside TFLOP/s, so that a
kernel the power cap clocks down is told from one that does less per clock."""
import contextlib
import statistics
import subprocess
import tempfile


@contextlib.contextmanager
def smi_samples(period_ms: int = 50):
    """Samples [SM clock MHz, board power W, temperature C] every period_ms while the block runs; the yielded list is
    filled when the block exits. FileNotFoundError where nvidia-smi is not on PATH."""
    rows: list[list[float]] = []
    with tempfile.NamedTemporaryFile("r") as log:
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                                "--format=csv,noheader,nounits", "-lms", str(period_ms), "-f", log.name])
        try:
            yield rows
        finally:
            smi.terminate()
            smi.wait()
            rows += [[float(x) for x in line.split(",")] for line in log.read().splitlines() if line.strip()]


def steady_state(rows: list[list[float]]) -> tuple[float, float, float]:
    """Mean SM clock, power and temperature of the samples after the first quarter (the clocks settling)."""
    steady = rows[len(rows) // 4:]
    if not steady:
        raise RuntimeError("nvidia-smi gave no clock / power samples (is it on PATH, and did the run last 50 ms?)")
    return tuple(statistics.mean(r[i] for r in steady) for i in range(3))


def board() -> dict:
    """The driver version and board power limit (W) of GPU 0, for a record's env: the power cap sets the clock a long
    kernel runs at. Empty where nvidia-smi is not on PATH or fails."""
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,power.limit", "--format=csv,noheader,nounits",
                               "-i", "0"], capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (FileNotFoundError, subprocess.SubprocessError):
        return {}
    driver, limit = (x.strip() for x in line.split(","))
    return {"driver": driver, "power_limit_w": round(float(limit))}


def memory_system(l2_bytes: int) -> dict:
    """A record's L2 size (MB) and whether flashtrain's small-L2 dispatch ran (its short causal forwards' tiles and
    tile groups on GPUs with at most build.SMALL_L2_BYTES of L2: the H100, not the H200), from the GPU's L2 bytes
    (torch.cuda.get_device_properties(...).L2_cache_size)."""
    from flashtrain.kernels import build

    return {"l2_mb": round(l2_bytes / 2 ** 20), "small_l2_dispatch": build.is_small_l2(l2_bytes)}


def source_commit(root) -> str | None:
    """The checkout's commit, with "+changes" when tracked files differ from it (a record names the tree it ran on);
    None outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (FileNotFoundError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if dirty else "")
