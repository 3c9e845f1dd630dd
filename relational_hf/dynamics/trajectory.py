"""The trajectory file of one training run and what can be computed from it without the model.

A run's trajectory is one NumPy ``.npz`` archive (``<output_dir>/quotient_trajectory.npz`` by default), written
atomically (temporary file + rename), holding arrays indexed by record (R records, taken at chosen optimiser steps)
and a JSON ``metadata`` string. It loads with NumPy alone (`load_trajectory`, no pickle, no torch, no model).

Notation of DESIGN.md 2.3: theta the trainable parameters (flattened in `model.named_parameters()` order), V the
vertical space of the model's symmetry groups at theta, P_V the orthogonal projection onto it; a vector delta splits
into its vertical part P_V(delta) and its horizontal part delta - P_V(delta), and |delta|^2 = |P_V delta|^2 +
|delta - P_V delta|^2. c(theta) is the canonical representative of theta's orbit (`symmetry.canonicalize`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: default file name, next to the Trainer's checkpoints
TRAJECTORY_NAME = "quotient_trajectory.npz"
FORMAT_VERSION = 1

#: every array a trajectory may hold (R = records, k = sketch dimension, L layers, H query heads, r = qk_rank,
#: d_h head width, G balance groups, S probe sites, M logged losses). Arrays of the invariant coordinates are absent
#: for a model no architecture adapter knows; quantities that do not apply to a record are NaN.
FIELDS = {
    "step": "(R,) optimiser steps taken when the record was made (0 = before training)",
    "seconds": "(R,) wall seconds spent recording (the callback's cost; the update split included)",
    "raw_sketch": "(R, k) fixed random sketch S theta of the raw trainable parameters",
    "param_norm": "(R,) |theta|",
    "canonical_sketch": "(R, k) S c(theta): sketch of the canonical-gauge parameters (invariant coordinates)",
    "canonical_norm": "(R,) |c(theta)|",
    "qk_spectrum": "(R, L, H, r) singular values of G_QK = W_Q W_K^T per query head (gains folded)",
    "vo_spectrum": "(R, L, H, d_h) singular values of G_VO = W_V W_O per query head",
    "qk_similarity": "(R, L, H, H) head-to-head cosine <G^a, G^b>_F / (|G^a| |G^b|) of G_QK",
    "vo_similarity": "(R, L, H, H) same for G_VO",
    "balance_norm": "(R, G) |mu_g(theta)|_F per group g, mu the balance (moment map), e.g. W_Q^T W_Q - W_K^T W_K",
    "balance_drift": "(R, G) |mu_g(theta) - mu_g(theta_first record)|_F (the orbit drift)",
    "balance_sketch": "(R, k) fixed random sketch of the concatenated balance (the orbit position)",
    "balance_reference": "(n_mu,) the balance at the first record, concatenated (reference of balance_drift)",
    "parallel_ratio": "(R, S, L) mean |y_par|/|y_perp| per probe site and layer on the fixed probe batch",
    "probe_loss": "(R,) loss of the fixed probe batch",
    "gradient_norm": "(R,) |g| of the gradient the optimiser used at this step (after clipping)",
    "gradient_vertical_norm": "(R,) |P_V g| at the parameters before the step",
    "gradient_horizontal_norm": "(R,) |g - P_V g|",
    "update_norm": "(R,) |delta|, delta = theta_after - theta_before of this step's optimiser update",
    "update_vertical_norm": "(R,) |P_V delta| at theta_before",
    "update_horizontal_norm": "(R,) |delta - P_V delta|",
    "interval_norm": "(R,) |Delta|, Delta = theta - theta at the previous record (raw chord)",
    "interval_vertical_norm": "(R,) |P_V Delta| at the previous record's parameters",
    "interval_horizontal_norm": "(R,) |Delta - P_V Delta| (first-order distance along the quotient)",
    "canonical_interval_norm": "(R,) |c(theta) - c(theta at the previous record)| (chord in canonical coordinates)",
    "loss_step": "(M,) steps of the logged training losses",
    "loss": "(M,) logged training loss (the Trainer's `loss` log, or what a custom loop passed)",
}

#: arrays every recorded trajectory holds (the recorder writes them for any model); `load_trajectory` refuses a file
#: without them
REQUIRED_FIELDS = (
    "step",
    "seconds",
    "raw_sketch",
    "param_norm",
    "interval_norm",
    "interval_vertical_norm",
    "interval_horizontal_norm",
    "gradient_norm",
    "gradient_vertical_norm",
    "update_norm",
    "update_vertical_norm",
    "loss_step",
    "loss",
)

#: arrays that are invariant under every symmetry group the canonicalisation fixes (the invariant coordinates)
DESCRIPTOR_KEYS = ("qk_spectrum", "vo_spectrum", "qk_similarity", "vo_similarity")


@dataclass
class Trajectory:
    """One run's recorded trajectory: `arrays` (see FIELDS) and `metadata` (settings, model, groups, label)."""

    arrays: dict[str, np.ndarray]
    metadata: dict = field(default_factory=dict)
    path: Path | None = None

    def __getitem__(self, key: str) -> np.ndarray:
        return self.arrays[key]

    def __contains__(self, key: str) -> bool:
        return key in self.arrays

    @property
    def label(self) -> str:
        """The run's name: metadata "label", else the folder of its file."""
        if self.metadata.get("label"):
            return str(self.metadata["label"])
        return self.path.parent.name if self.path is not None else "run"

    @property
    def steps(self) -> np.ndarray:
        return self.arrays["step"]

    def vertical_share(self, kind: str = "update") -> np.ndarray:
        """|P_V x| / |x| per record for x the `kind` in ("update", "gradient", "interval"); NaN where |x| = 0 or the
        record has no such vector (the first record has no update)."""
        total = self.arrays[f"{kind}_norm"].astype(np.float64)
        vertical = self.arrays[f"{kind}_vertical_norm"].astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total > 0, vertical / total, np.nan)

    def path_lengths(self) -> dict[str, np.ndarray]:
        """Cumulative distance travelled up to each record, summed over the chords between consecutive records:
        "raw" sum |Delta|, "vertical" sum |P_V Delta| (gauge motion), "horizontal" sum |Delta - P_V Delta| (motion
        along the quotient, first order) and "canonical" sum |c(theta_i) - c(theta_{i-1})|. Chords: the numbers depend
        on the recording interval (motion that cancels between two records is not counted)."""
        out = {}
        for name, key in (
            ("raw", "interval_norm"),
            ("vertical", "interval_vertical_norm"),
            ("horizontal", "interval_horizontal_norm"),
            ("canonical", "canonical_interval_norm"),
        ):
            if key in self.arrays:
                out[name] = np.nancumsum(self.arrays[key].astype(np.float64))
        return out

    def gauge_share(self) -> float:
        """Share of the squared raw motion that is vertical: sum_i |P_V Delta_i|^2 / sum_i |Delta_i|^2 over the
        chords between records (NaN without motion). Pure gauge motion gives 1, horizontal motion 0."""
        total = np.nansum(self.arrays["interval_norm"].astype(np.float64) ** 2)
        vertical = np.nansum(self.arrays["interval_vertical_norm"].astype(np.float64) ** 2)
        return float(vertical / total) if total > 0 else math.nan

    def coordinates(self, index: int = -1) -> dict[str, np.ndarray]:
        """The coordinates of one record (default: the last): raw and canonical sketches and the descriptors."""
        keys = ("raw_sketch", "canonical_sketch", *DESCRIPTOR_KEYS)
        return {k: self.arrays[k][index] for k in keys if k in self.arrays}

    def summary(self) -> dict:
        """JSON-ready numbers of the run: records, final loss, path lengths, gauge share, mean vertical shares."""
        out: dict = {"label": self.label, "records": int(self.steps.size), "last_step": int(self.steps[-1])}
        if self.arrays.get("loss") is not None and self.arrays["loss"].size:
            out["final_loss"] = float(self.arrays["loss"][-1])
        lengths = self.path_lengths()
        out["path_length"] = {k: float(v[-1]) for k, v in lengths.items() if v.size}
        out["gauge_share_of_motion"] = _finite(self.gauge_share())
        for kind in ("update", "gradient", "interval"):
            if f"{kind}_norm" in self.arrays:
                out[f"mean_{kind}_vertical_share"] = _finite(_nanmean(self.vertical_share(kind)))
        out["recording_seconds"] = float(np.nansum(self.arrays["seconds"]))
        return out


def _nanmean(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else math.nan


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def save_trajectory(trajectory: Trajectory, path: str | os.PathLike) -> Path:
    """Write `trajectory` to `path` (an .npz archive: its arrays plus the metadata as a JSON string) atomically: a
    temporary file in the same folder, renamed over `path`, so a reader never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = dict(trajectory.metadata, format_version=FORMAT_VERSION)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".npz.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, metadata=np.array(json.dumps(metadata)), **trajectory.arrays)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_trajectory(path: str | os.PathLike) -> Trajectory:
    """Read a trajectory written by `save_trajectory` (a file, or a run folder holding TRAJECTORY_NAME); needs only
    NumPy. `ValueError` naming the file for an archive without the recorder's arrays (`REQUIRED_FIELDS`) or whose
    per-record arrays disagree in length."""
    path = Path(path)
    if path.is_dir():
        path = path / TRAJECTORY_NAME
    with np.load(path, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    metadata = json.loads(str(arrays.pop("metadata"))) if "metadata" in arrays else {}
    version = metadata.get("format_version", FORMAT_VERSION)
    if version > FORMAT_VERSION:
        raise ValueError(f"{path}: trajectory format {version} is newer than this library's ({FORMAT_VERSION})")
    missing = [key for key in REQUIRED_FIELDS if key not in arrays]
    if missing:
        raise ValueError(f"{path}: not a trajectory of the quotient-dynamics recorder (no {', '.join(missing)} array)")
    records = arrays["step"].shape[0] if arrays["step"].ndim == 1 else -1
    short = [k for k, v in arrays.items() if FIELDS.get(k, "").startswith("(R") and v.shape[:1] != (records,)]
    if records < 1 or short:
        raise ValueError(
            f"{path}: inconsistent trajectory: {records} record steps, but {', '.join(short) or 'step'} "
            "do not have one row per record"
        )
    return Trajectory(arrays, metadata, path)


def find_trajectories(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """The trajectory files named by `paths`: a file as given; a folder's own TRAJECTORY_NAME, else every
    TRAJECTORY_NAME below it (sorted). Raises FileNotFoundError for a path that yields none."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif (p / TRAJECTORY_NAME).is_file():
            found.append(p / TRAJECTORY_NAME)
        elif p.is_dir() and (below := sorted(p.rglob(TRAJECTORY_NAME))):
            found += below
        else:
            raise FileNotFoundError(f"no {TRAJECTORY_NAME} in or below {p}")
    return list(dict.fromkeys(found))


# ---------------------------------------------------------------------------------------------------------------
# Distances between models (from recorded coordinates)
# ---------------------------------------------------------------------------------------------------------------


def relative_distance(a: np.ndarray, b: np.ndarray) -> float:
    """|a - b| / sqrt((|a|^2 + |b|^2) / 2): 0 for equal vectors, sqrt(2) for orthogonal ones of equal norm."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    scale = math.sqrt(0.5 * (a @ a + b @ b))
    return float(np.linalg.norm(a - b) / scale) if scale > 0 else 0.0


def descriptor_vector(coordinates: Mapping[str, np.ndarray], sort_heads: bool = False) -> np.ndarray:
    """The invariant descriptors of one model as one vector: per layer the G_QK and G_VO spectra of every head and
    the two head-similarity matrices. With `sort_heads` the heads of each layer are first ordered by the norm of
    their G_QK spectrum (descending; similarity rows and columns permuted alike), which makes the vector invariant
    under head permutations as well (a discrete symmetry the canonical gauge does not fix)."""
    qk, vo = coordinates["qk_spectrum"], coordinates["vo_spectrum"]  # (L, H, r), (L, H, d_h)
    sq, sv = coordinates["qk_similarity"], coordinates["vo_similarity"]  # (L, H, H)
    if sort_heads:
        order = np.argsort(-np.linalg.norm(qk, axis=-1), axis=-1, kind="stable")  # (L, H)
        take = np.take_along_axis
        qk, vo = take(qk, order[..., None], 1), take(vo, order[..., None], 1)
        sq = take(take(sq, order[..., None], 1), order[:, None, :], 2)
        sv = take(take(sv, order[..., None], 1), order[:, None, :], 2)
    return np.concatenate([x.astype(np.float64).ravel() for x in (qk, vo, sq, sv)])


def coordinate_distances(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Relative distances (`relative_distance`) between two models' coordinates: "raw" (raw-parameter sketches),
    "canonical" (canonical-gauge sketches), "descriptors" (spectra and head similarities) and
    "descriptors_sorted_heads" (the same with heads sorted, see `descriptor_vector`), where both have them with equal
    shapes."""

    def same(*keys: str) -> bool:
        return all(k in a and k in b and np.shape(a[k]) == np.shape(b[k]) for k in keys)

    out = {}
    for name, key in (("raw", "raw_sketch"), ("canonical", "canonical_sketch")):
        if same(key):
            out[name] = relative_distance(a[key], b[key])
    if same(*DESCRIPTOR_KEYS):
        out["descriptors"] = relative_distance(descriptor_vector(a), descriptor_vector(b))
        out["descriptors_sorted_heads"] = relative_distance(descriptor_vector(a, True), descriptor_vector(b, True))
    return out


def comparable(trajectories: Sequence[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories grouped by sketch signature (same parameter names and shapes, sketch seed and dimension, and index
    layout, e.g. the same pivot positions of a pivot-gauge model): only within a group do the sketch coordinates mean
    the same thing."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(str(t.metadata.get("sketch_signature", "")), []).append(t)
    return list(groups.values())


def final_distances(trajectories: Sequence[Trajectory]) -> dict[str, np.ndarray]:
    """Pairwise `coordinate_distances` between the last records of the given runs: {name: (n, n) matrix}, NaN for a
    pair without that coordinate. Sketch distances are NaN between runs whose sketches are not comparable (see
    `comparable`)."""
    n = len(trajectories)
    coords = [t.coordinates() for t in trajectories]
    names = ("raw", "canonical", "descriptors", "descriptors_sorted_heads")
    out = {name: np.full((n, n), math.nan) for name in names}
    for i in range(n):
        for name in names:
            out[name][i, i] = 0.0
        for j in range(i + 1, n):
            signature = trajectories[i].metadata.get("sketch_signature")
            same = signature is not None and signature == trajectories[j].metadata.get("sketch_signature")
            for name, value in coordinate_distances(coords[i], coords[j]).items():
                if same or name.startswith("descriptors"):
                    out[name][i, j] = out[name][j, i] = value
    return {name: m for name, m in out.items() if n < 2 or np.isfinite(m[~np.eye(n, dtype=bool)]).any()}


__all__ = [
    "DESCRIPTOR_KEYS",
    "FIELDS",
    "FORMAT_VERSION",
    "REQUIRED_FIELDS",
    "TRAJECTORY_NAME",
    "Trajectory",
    "comparable",
    "coordinate_distances",
    "descriptor_vector",
    "final_distances",
    "find_trajectories",
    "load_trajectory",
    "relative_distance",
    "save_trajectory",
]
