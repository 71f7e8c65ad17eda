"""zeroshard export — a sharded checkpoint as consolidated safetensors (Hugging Face layout).

Streams one parameter at a time, so host memory stays near the largest parameter
whatever the model's size. Splits into files of at most --max-shard-size with a
model.safetensors.index.json, as `from_pretrained` expects. A run of `zeroshard train
--hf-model DIR` exports as a folder `from_pretrained` loads: the weights under
transformers' names, and DIR's config.json (its dtype set to --dtype),
generation_config.json and tokenizer files. The files are written aside and moved in
whole: a failed export leaves the output folder as it was, and a re-export replaces what
the one before it wrote there; a file of anyone else's that it would replace is refused
by name before anything is written (the folder's .zeroshard-written.json records what
zeroshard wrote), and other files are left alone.

A run of `zeroshard train --lora R` exports its adapter in peft's layout
(adapter_model.safetensors, adapter_config.json: peft's from_pretrained loads it onto the
base model), or with --merge the model with the adapter merged into its weights.

example:
  zeroshard export runs/ckpt/latest out/ --dtype bf16 --max-shard-size 2GB
  zeroshard export runs/lora/latest adapter/          # the adapter, for peft
  zeroshard export runs/lora/latest merged/ --merge   # a folder from_pretrained loads
"""

from __future__ import annotations

import argparse
import math
import resource

from ..checkpoint.consolidated import export
from ..checkpoint.exportdir import check as check_out_dir
from ..checkpoint.hflayout import carried_files, carry_over, check_export, trained_from
from ..train import lora_export

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str) -> int:
    """--max-shard-size in bytes: a number with an optional unit (500MB, 2GiB, 1e9)."""
    t = text.strip().upper()
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(suffix):
            number = t[:-len(suffix)].strip()
            break
    else:
        suffix, number = "B", t
    try:
        value = float(number) * _UNITS[suffix]
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"--max-shard-size={text!r}; expected a size such as 500MB or 5GB")
    if value <= 0:
        raise ValueError(f"--max-shard-size={text!r} must be positive")
    if value < 1:
        raise ValueError(f"--max-shard-size={text!r} is less than a byte")
    return int(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="a checkpoint directory, a save directory with `latest`, or "
                                "that `latest` file")
    p.add_argument("out", help="output directory")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the exported weights (default fp32)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file (default 5GB)")
    p.add_argument("--merge", action="store_true",
                   help="a run of zeroshard train --lora: the model with its adapter merged "
                        "into the weights (default: the adapter alone, in peft's layout)")


def run(args) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    most = parse_size(args.max_shard_size)  # a flag's value before any file is read
    lora = lora_export.export(args.ckpt, args.out, args.dtype, most, args.merge)
    if lora is not None:  # a --lora run: its adapter, or the model merged
        print(f"wrote {lora} in {args.out}")
        return 0
    source = trained_from(args.ckpt)
    if source is not None:
        check_export(source, args.out)
        check_out_dir(args.out, [p.name for p in carried_files(source)])
    layout = export(args.ckpt, args.out, args.dtype, most)
    copied = carry_over(source, args.out, args.dtype) if source is not None else []
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    count = sum(len(v) for v in layout.values())
    also = f", and {', '.join(copied)} from {source}" if copied else ""
    print(f"wrote {count} tensors to {len(layout)} file(s) in {args.out}{also}; peak host "
          f"memory grew by {grown / 1e6:.1f} MB")
    return 0
