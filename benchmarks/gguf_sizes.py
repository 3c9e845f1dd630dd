"""Where the bytes of a GGUF file go: the header and vocabulary, and each tensor group in each block type.

Reads files already written (by `relational-hf export --to gguf`, e.g. the ones `gguf_llamacpp.py` leaves in its
workdir); runs nothing, times nothing. Every part is counted from the file itself (`gguf.GGUFReader`): the bytes
before the tensor data (header, metadata, vocabulary, tensor infos), each tensor's bytes, and the alignment padding
between them, which together are the file's size. The ratio of a file to the first one (the baseline) is given for
the whole file and for its tensors alone, so that what both files hold alike (the vocabulary) is seen apart.

    python benchmarks/gguf_sizes.py     # the dense, default and --kinds mlp --width-multiple 256 Q4_K_M files
    python benchmarks/gguf_sizes.py --files a.gguf b.gguf --tag mine

Writes results/gguf_sizes.json and gguf_sizes.png (gguf_sizes_TAG.* with --tag TAG).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from common import RESULTS, save_figure, write_json

WORKDIR = RESULTS / "gguf_runs" / "full"
DEFAULT_FILES = ("dense-Q4_K_M.gguf", "compressed-Q4_K_M.gguf", "compressed-mlp-w256-Q4_K_M.gguf")

#: tensor name (without its block prefix) -> the group it is counted in
GROUPS = (
    ("embedding", re.compile(r"^token_embd\.")),
    ("output head", re.compile(r"^output\.")),
    ("attention", re.compile(r"^attn_(q|k|v|output)\.")),
    ("MLP gate and up", re.compile(r"^ffn_(gate|up)\.")),
    ("MLP down", re.compile(r"^ffn_down\.")),
)


def group_of(name: str) -> str:
    """The group of tensor `name` ("blk.N." stripped): those of `GROUPS`, else "norms and other"."""
    bare = re.sub(r"^blk\.\d+\.", "", name)
    return next((group for group, pattern in GROUPS if pattern.match(bare)), "norms and other")


def breakdown(path: Path) -> dict:
    """The parts of GGUF file `path`, in bytes: "header" (everything before the tensor data; of it, "vocabulary" is
    the tokenizer's metadata), "tensors" by group and by group and block type, "padding" (alignment between tensors)
    and "file" (the size on disk, which header + tensors + padding equal)."""
    import gguf

    reader = gguf.GGUFReader(path)
    vocabulary = sum(
        int(part.nbytes) for key, field in reader.fields.items() if key.startswith("tokenizer.") for part in field.parts
    )
    groups: dict[str, int] = {}
    typed: dict[str, int] = {}
    for tensor in reader.tensors:
        group = group_of(tensor.name)
        groups[group] = groups.get(group, 0) + int(tensor.n_bytes)
        key = f"{group} ({tensor.tensor_type.name})"
        typed[key] = typed.get(key, 0) + int(tensor.n_bytes)
    tensors = sum(groups.values())
    size = path.stat().st_size
    return {
        "file": size,
        "header": int(reader.data_offset),
        "vocabulary": vocabulary,
        "tensors": tensors,
        "padding": size - int(reader.data_offset) - tensors,
        "groups": dict(sorted(groups.items())),
        "groups_by_type": dict(sorted(typed.items())),
    }


def ratios(parts: dict[str, dict], baseline: str) -> dict[str, dict[str, float]]:
    """Each file's size and tensor bytes over the baseline's."""
    base = parts[baseline]
    return {
        name: {"file": p["file"] / base["file"], "tensors": p["tensors"] / base["tensors"]}
        for name, p in parts.items()
        if name != baseline
    }


def plot(parts: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(parts)
    layers = ["header (of it the vocabulary)", *sorted({g for p in parts.values() for g in p["groups"]})]
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.5 * len(names)))
    left = [0.0] * len(names)
    for i, layer in enumerate(layers):
        widths = [
            (p["header"] + p["padding"] if i == 0 else p["groups"].get(layer, 0)) / 2**20 for p in parts.values()
        ]
        ax.barh(names, widths, left=left, label=layer, color=plt.cm.tab10(i))
        left = [a + b for a, b in zip(left, widths)]
    for y, p in enumerate(parts.values()):
        ax.text(p["file"] / 2**20, y, f" {p['file'] / 2**20:.1f} MiB", va="center", fontsize=8)
    ax.set_xlabel("MiB")
    ax.invert_yaxis()
    ax.set_xlim(0, max(left) * 1.15)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("Where the bytes of each GGUF file go", fontsize=10)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", type=Path, help=f"GGUF files, the first the baseline (default: {WORKDIR})")
    parser.add_argument("--tag", default="", help="suffix of the result files (gguf_sizes_TAG.json)")
    args = parser.parse_args(argv)
    files = args.files or [WORKDIR / name for name in DEFAULT_FILES]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"no such GGUF file: {', '.join(missing)} (python benchmarks/gguf_llamacpp.py writes them)")
    if len({f.name for f in files}) != len(files):
        raise SystemExit("two --files share a name: give each file a name of its own")
    parts = {f.name: breakdown(f) for f in files}
    payload = {"baseline": files[0].name, "files": parts, "ratio_to_baseline": ratios(parts, files[0].name)}
    path = write_json("gguf_sizes" + (f"_{args.tag}" if args.tag else ""), payload)
    plot(parts, path.with_suffix(".png"))
    for name, r in payload["ratio_to_baseline"].items():
        print(f"{name}: file {r['file']:.4f}x, tensors {r['tensors']:.4f}x of {files[0].name}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
