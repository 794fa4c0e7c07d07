"""Resident memory a prompt data module keeps for rows with large images (issue 52, item 6): ``--rows`` rows, each
one ``--size`` x ``--size`` PNG file (one colour: a few kB on disk), set up with the tiny Qwen2-VL processor; RSS
before and after ``setup()`` in a fresh process per measurement. ``--baseline DIR`` measures another checkout of this
project (e.g. the main branch) in the same invocation, alternated with this one.

    OMP_NUM_THREADS=1 python benchmarks/vision_rows_memory.py --rows 20 --size 3000 --baseline ../main
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import print_header

_MEASURE = """
import gc, json, sys
def rss():
    return int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) / 1024
from aitraining_pl.datamodules.prompt import PromptDataModule
from aitraining_pl.models.vision import load_processor
tokenizer = load_processor('tiny-qwen2-vl').tokenizer
gc.collect(); before = rss()
data = PromptDataModule(data_path=sys.argv[1], tokenizer=tokenizer, batch_size=1, max_prompt_length=4096)
data.setup()
gc.collect(); after = rss()
print(json.dumps({'rss_before_mb': round(before, 1), 'rss_after_mb': round(after, 1),
                  'kept_mb': round(after - before, 1), 'rows': len(data.train_dataset)}))
"""


def _rows(folder: Path, rows: int, size: int) -> str:
    from PIL import Image

    lines = []
    for i in range(rows):
        path = folder / f"{i}.png"
        Image.new("RGB", (size, size), (i * 12 % 256, 80, 160)).save(path)
        lines.append(json.dumps({"prompt": "colour?", "images": [str(path)]}))
    (folder / "rows.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder / "rows.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20, help="rows, one image each")
    parser.add_argument("--size", type=int, default=3000, help="each image's width and height")
    parser.add_argument("--repeats", type=int, default=2, help="measurements per side")
    parser.add_argument("--baseline", default=None, help="another checkout of this project to measure as well")
    args = parser.parse_args()
    print_header(int(os.environ.get("OMP_NUM_THREADS", "0")) or None, rows=args.rows, size=args.size)
    here = str(Path(__file__).resolve().parent.parent)
    sides = [("this", here)] + ([("baseline", str(Path(args.baseline).resolve()))] if args.baseline else [])
    with tempfile.TemporaryDirectory() as folder:
        data = _rows(Path(folder), args.rows, args.size)
        print(json.dumps({"png_bytes_per_row": (Path(folder) / "0.png").stat().st_size}), flush=True)
        for repeat in range(args.repeats):
            for side, root in sides if repeat % 2 == 0 else sides[::-1]:
                env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1"}
                out = subprocess.run([sys.executable, "-c", _MEASURE, data], cwd=root, env=env, capture_output=True,
                                     text=True, check=True)  # fmt: skip
                print(json.dumps({"side": side, "code": root, **json.loads(out.stdout.strip().splitlines()[-1])}),
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
