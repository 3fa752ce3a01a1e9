"""Makes the byte_gpt example's corpus (elastic_zero/data/byte_corpus.py): the Python standard
library's own .py files, byte-tokenised into a Parquet dataset of samples of up to seq_len + 1 bytes.

    python examples/byte_gpt/make_dataset.py --out runs/byte_gpt/data [--seq-len 128] [--max-mb 8]
"""

from __future__ import annotations

import argparse
import os
import sys

from elastic_zero.data.byte_corpus import write


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/byte_gpt/data")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-mb", type=float, default=8.0, help="bytes of source to take, in MiB")
    args = parser.parse_args()
    if os.path.isdir(args.out) and os.listdir(args.out):
        print(f"{args.out} is not empty: remove it first", file=sys.stderr)
        return 2
    n = write(args.out, args.seq_len, args.max_mb)
    print(f"{n} samples of up to {args.seq_len + 1} bytes in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
