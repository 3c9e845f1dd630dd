"""Shared plumbing for the benchmark scripts: machine description, timing statistics, JSON output."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from relational_hf.lm.corpora import CorpusNotFound, corpus_file, data_dir

RESULTS = Path(__file__).resolve().parent / "results"
#: the real corpora: $RELATIONAL_HF_DATA, default ../shared/data beside the project (`relational_hf.lm.corpora`)
SHARED_DATA = data_dir()


def corpus(name: str) -> Path:
    """The file of corpus `name` (`relational_hf.lm.corpora.CORPORA`); stops the benchmark with a message saying
    where it was looked for and how to get it where it is absent."""
    try:
        return corpus_file(name)
    except CorpusNotFound as err:
        raise SystemExit(f"benchmark needs a corpus: {err}") from None


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages of the machine (other jobs share its cores), rounded."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return []


def machine() -> dict:
    """What the numbers were measured on."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "load_average": load_average(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    import transformers

    info["transformers"] = transformers.__version__
    return info


def summary(values: list[float]) -> dict:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes (device synchronised)."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def without_paths(command: str) -> str:
    """A command line without --workdir / --out-dir: where this machine kept its files is not a result."""
    return re.sub(r" --(workdir|out-dir) \S+", "", command)


def command_line(script: str | None = None, argv: list[str] | None = None) -> str:
    """This run's command (`script`, default this process's script name, and `argv`, default its arguments),
    `without_paths`."""
    return without_paths(" ".join([script or Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]))


def write_json(name: str, payload: dict) -> Path:
    """Write results/<name>.json atomically and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"machine": machine(), "command": command_line(), **payload}
    fd, tmp = tempfile.mkstemp(dir=RESULTS, prefix=f".{name}.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def peak_rss_mib() -> float:
    """Peak resident memory of this process in MiB: VmHWM (Linux); elsewhere ru_maxrss, which on Linux would also
    hold the parent's peak, kept across fork and exec."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # macOS: bytes; Linux: KiB


class RSSTrace:
    """Resident memory of this process sampled every `interval` seconds on a background thread (Linux
    /proc/self/statm), as a context manager: `points` is [(seconds since start, MiB)], one point per `keep` seconds
    (the largest sample in it, so a short peak is kept). VmHWM stays the exact peak; the trace shows when it came."""

    def __init__(self, interval: float = 0.05, keep: float = 1.0) -> None:
        self.interval, self.keep = interval, keep
        self.points: list[tuple[float, float]] = []
        self._page = os.sysconf("SC_PAGE_SIZE") / 2**20

    def _rss(self) -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        bucket, top = 0, 0.0
        while True:
            stopped = self._stop.wait(self.interval)
            now = int((time.perf_counter() - self._start) / self.keep)
            if (now != bucket or stopped) and top:
                self.points.append((round(bucket * self.keep, 2), round(top, 1)))
                bucket, top = now, 0.0
            if stopped:
                return
            top = max(top, self._rss())

    def __enter__(self) -> RSSTrace:
        import threading

        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def coarse(self, at_most: int = 600) -> list[tuple[float, float]]:
        """`points` merged into at most `at_most` points, each the largest of its run of consecutive points (with
        the time of the run's first), so that a run of hours keeps its shape and its peak in a JSON of modest size."""
        step = -(-len(self.points) // at_most) if self.points else 1
        return [
            (self.points[i][0], max(mib for _, mib in self.points[i : i + step]))
            for i in range(0, len(self.points), step)
        ]


def save_figure(fig, path: Path) -> None:
    """Lay out, write (110 dpi) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log_axis_in_plain_numbers(axis) -> None:
    """A logarithmic matplotlib axis (`ax.yaxis`) labelled in plain numbers (20, 30, 40, not 2 x 10^1): the decades,
    and as many minor ticks as fit (all of them within about a decade, fewer over a wider range)."""
    from matplotlib import ticker

    axis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    axis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def add_shape_arguments(parser, sizes) -> None:
    """--size (a shape of `sizes`), --quick (the 10M one), --workdir (where the generated checkpoint is kept) and
    --layers (that many decoder layers of the shape): the generated-checkpoint benchmarks' common options."""
    parser.add_argument("--size", choices=list(sizes), default="7B")
    parser.add_argument("--quick", action="store_true", help="the 10M shape")
    parser.add_argument("--workdir", type=Path, default=None, help="where the generated checkpoint is kept")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the shape (default: its own depth)")


def shape_tag(args) -> tuple[str, str]:
    """(size, tag) of `add_shape_arguments`' options: the shape measured and the name its results are filed under
    ("7B", "7B_8layers", ...)."""
    size = "10M" if args.quick else args.size
    return size, size + (f"_{args.layers}layers" if args.layers else "")
