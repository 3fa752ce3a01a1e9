"""Fine-tune a Hugging Face model with elastic_zero, end to end, from a model directory back to one.

    pip install -e '.[hf,mlflow]'
    python examples/finetune_hf/finetune.py [--out runs/finetune_hf] [--short] [--only STAGE,...]

The stages, in order (each reads what the one before wrote under --out):
  data      two byte-level corpora: Python source code (the standard library's .py files) to
            pre-train on, and English prose (the Python documentation's topics) to fine-tune on,
            split by topic into train and eval;
  base      a small Llama directory written with save_pretrained (it stands in for a download);
  pretrain  pretrain.toml: a brief pre-training on code, exported to `pretrained/` (a Hugging Face
            directory);
  full      finetune.toml: a full fine-tune on prose from `pretrained/` (model.init_from), evaluated
            every N steps, logged to MLflow (`mlruns/`), through a kill and a preemption notice;
            exported with elastic_zero's exporter to `finetuned-full/`;
  lora      the same with LoRA adapters (lora.toml over finetune.toml); the trained adapters are
            merged into the weights and saved with save_pretrained to `finetuned-lora/`;
  check     each directory loaded with AutoModelForCausalLM.from_pretrained: its loss on the eval
            set (which must equal the job's own final evaluation) and a few bytes it generates.
`report.json` under --out has the figures; `full/run.png` is the plot with the eval line.
--short runs every stage with a few steps (the test's version).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root: examples.finetune_hf.model

import pyarrow.dataset as ds  # noqa: E402
import torch  # noqa: E402

import elastic_zero as ez  # noqa: E402
from elastic_zero.job.spec import apply_override, spec_from_dict  # noqa: E402

STAGES = ("data", "base", "pretrain", "full", "lora", "check")
SEQ_LEN = 128
PROMPT = b"The with statement "
SHORT = {  # the test's version: every stage, a few steps each
    "pretrain": ["train.steps=12"],
    "full": ["train.steps=20", "eval.every=8",
             'faults=[{at_step = 4, action = "kill", rank = 1}, {at_step = 12, action = "preempt", rank = 0, deadline_s = 30}]'],
    "lora": ["train.steps=12", "eval.every=6", 'faults=[{at_step = 4, action = "kill", rank = 1}]'],
}


def make_data(out: str) -> None:
    import pydoc_data.topics

    from elastic_zero.data.byte_corpus import file_bytes, stdlib_sources, write

    code = [p for p in stdlib_sources() if f"{os.sep}pydoc_data{os.sep}" not in p]  # the prose stays unseen
    n_code = write(f"{out}/data/code", SEQ_LEN, 2.0, documents=file_bytes(code))
    topics = sorted(pydoc_data.topics.topics.items())
    held_out = [text.encode() for i, (_, text) in enumerate(topics) if i % 8 == 0]
    train = [text.encode() for i, (_, text) in enumerate(topics) if i % 8 != 0]
    n_train = write(f"{out}/data/prose/train", SEQ_LEN, 8.0, documents=train)
    n_eval = write(f"{out}/data/prose/eval", SEQ_LEN, 8.0, documents=held_out)
    print(f"data: {n_code} samples of code; prose {n_train} to train on, {n_eval} held out "
          f"({len(held_out)} of {len(topics)} topics)")


def make_base(out: str) -> None:
    from transformers import LlamaForCausalLM

    from examples.finetune_hf.model import llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(seq_len=SEQ_LEN))
    model.save_pretrained(f"{out}/base")
    print(f"base: a Llama of {sum(p.numel() for p in model.parameters()):,} parameters in {out}/base")


def job_spec(out: str, tomls: list[str], model_dir: str, overrides: list[str]) -> ez.Job:
    """The TOML files merged in order (a later one's tables over an earlier one's), their paths
    pointed under `out`, then `overrides` (--set syntax)."""
    data: dict = {}
    for name in tomls:
        with open(os.path.join(HERE, name), "rb") as fh:
            for section, table in tomllib.load(fh).items():
                data[section] = {**data.get(section, {}), **table} if isinstance(table, dict) else table
    data["model"]["kwargs"]["path"] = data["model"]["init_from"] = model_dir
    for assignment in overrides:
        apply_override(data, assignment)
    for section, key in (("data", "source"), ("eval", "source"), ("checkpoint", "uri")):
        if key in data.get(section, {}):  # runs/finetune_hf/... in the TOML: under --out here
            data[section][key] = data[section][key].replace("runs/finetune_hf", out)
    spec = spec_from_dict(data)
    # the factory as the function itself, which Ray ships to the workers: they need not start in
    # the repository root to import it by name, as `elastic-zero run` of the TOML would
    module, function = spec.model.factory.split(":")
    factory = getattr(importlib.import_module(module), function)
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, factory=factory))


def train(out: str, stage: str, tomls: list[str], model_dir: str, short: bool) -> tuple[ez.Job, ez.Result]:
    overrides = [f'tracking.mlflow_uri="{out}/mlruns"'] if stage != "pretrain" else []
    spec = job_spec(out, tomls, model_dir, overrides + (SHORT[stage] if short else []))
    result = ez.run(spec, ez.RunConfig(run_dir=f"{out}/{stage}"))
    if not result.ok:
        raise SystemExit(f"{stage}: training failed: {result.error}")
    s = result.metrics
    evals = " -> ".join(f"{loss:.3f}" for _, loss in s.get("eval_curve", []))
    print(f"{stage}: {s['steps']} steps, train loss {s['final_loss']:.3f}" + (f", eval loss {evals}" if evals else "")
          + f", world sizes {' -> '.join(str(n) for _, n in s['world_size_history'])}, "
          f"{len(s['recoveries'])} recoveries, {len(s['reconfigurations'])} reconfigurations")
    return spec, result


def pretrain(out: str, short: bool) -> None:
    from elastic_zero.checkpoint.export import export

    _, result = train(out, "pretrain", ["pretrain.toml"], f"{out}/base", short)
    export(result.final_checkpoint, f"{out}/pretrained", "hf")
    print(f"pretrain: exported to {out}/pretrained")


def finetune_full(out: str, short: bool) -> dict:
    from elastic_zero.checkpoint.export import export

    _, result = train(out, "full", ["finetune.toml"], f"{out}/pretrained", short)
    export(result.final_checkpoint, f"{out}/finetuned-full", "hf")  # what `elastic-zero export --format hf` does
    print(f"full: exported to {out}/finetuned-full")
    return result.metrics


def finetune_lora(out: str, short: bool) -> dict:
    from transformers import AutoConfig, LlamaForCausalLM

    from examples.finetune_hf.model import merge_lora

    spec, result = train(out, "lora", ["finetune.toml", "lora.toml"], f"{out}/pretrained", short)
    state = result.state_dict  # the final weights: the adapters trained, the frozen base as loaded
    merged = merge_lora(state, rank=spec.model.kwargs["rank"], alpha=spec.model.kwargs["alpha"])
    model = LlamaForCausalLM(AutoConfig.from_pretrained(f"{out}/pretrained"))
    model.load_state_dict(merged, strict=True)
    model.save_pretrained(f"{out}/finetuned-lora")
    trained = sum(v.numel() for k, v in state.items() if k.endswith((".lora_A", ".lora_B")))
    print(f"lora: {trained:,} adapter parameters trained of {sum(v.numel() for v in merged.values()):,}; "
          f"merged and saved to {out}/finetuned-lora")
    return result.metrics


@torch.no_grad()
def eval_loss(model, source: str, batch: int = 64) -> float:
    """Mean next-token cross entropy over every target byte of the eval set (the job's measure)."""
    rows = ds.dataset(source, format="parquet").to_table(columns=["tokens"]).column("tokens").to_pylist()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        width = max(len(r) for r in chunk) - 1
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        targets = torch.full((len(chunk), width), -100, dtype=torch.long)
        for j, r in enumerate(chunk):  # right padding: a causal model's real positions never see it
            ids[j, : len(r) - 1] = torch.tensor(r[:-1])
            targets[j, : len(r) - 1] = torch.tensor(r[1:])
        logits = model(input_ids=ids).logits.float()
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                   ignore_index=-100, reduction="sum").item()
        count += int((targets != -100).sum())
    return total / count


def check(out: str, jobs: dict) -> dict:
    from transformers import AutoModelForCausalLM

    found = {}
    for name in ("pretrained", "finetuned-full", "finetuned-lora"):
        path = f"{out}/{name}"
        if not os.path.isdir(path):
            continue
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        loss = eval_loss(model, f"{out}/data/prose/eval")
        torch.manual_seed(0)
        ids = model.generate(torch.tensor([list(PROMPT)]), max_new_tokens=64, do_sample=True, temperature=0.7,
                             top_k=0, pad_token_id=0, eos_token_id=None)
        text = bytes(ids[0].tolist()).decode("utf-8", errors="replace")
        job = jobs.get(name)
        job_loss = job["final_eval"]["loss"] if job else None
        found[name] = {"eval_loss": loss, "job_final_eval_loss": job_loss, "generated": text}
        same = "" if job_loss is None else f" (the job's final evaluation: {job_loss:.4f})"
        print(f"check: {name}: from_pretrained, eval loss {loss:.4f}{same}\n  generates: {text!r}")
    return found


def main() -> int:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # save_pretrained's and from_pretrained's bars
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/finetune_hf", help="where every stage writes (default: %(default)s)")
    parser.add_argument("--short", action="store_true", help="a few steps a stage (the test's version)")
    parser.add_argument("--only", default=",".join(STAGES), help=f"stages to run, of {','.join(STAGES)}")
    args = parser.parse_args()
    stages = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        parser.error(f"--only: unknown stage {unknown[0]!r}; allowed: {', '.join(STAGES)}" if unknown else "--only: no stage")
    out = os.path.abspath(args.out)
    report_path = f"{out}/report.json"
    if "data" in stages and os.path.isdir(f"{out}/data"):
        parser.error(f"{out}/data exists: remove {out} first, or leave 'data' out of --only")
    report = {}
    if os.path.exists(report_path):  # the stages run before, when --only runs the later ones
        with open(report_path) as fh:
            report = json.load(fh)
    import ray

    if any(stage in stages for stage in ("pretrain", "full", "lora")):
        # one embedded Ray for the run's jobs (ez.run starts and stops one of its own when none is up)
        ray.init(num_cpus=max(os.cpu_count() or 1, 4), include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
    try:
        run_stages(out, stages, args.short, report)
    except ez.SpecError as exc:  # a TOML edited wrong: one line naming the field
        print(f"finetune.py: {exc}", file=sys.stderr)
        return 2
    finally:
        ray.shutdown()
    os.makedirs(out, exist_ok=True)
    with open(report_path, "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    print(f"report: {report_path}")
    return 0


def run_stages(out: str, stages: list[str], short: bool, report: dict) -> None:
    if "data" in stages:
        make_data(out)
    if "base" in stages:
        make_base(out)
    if "pretrain" in stages:
        pretrain(out, short)
    if "full" in stages:
        report["finetuned-full"] = finetune_full(out, short)
    if "lora" in stages:
        report["finetuned-lora"] = finetune_lora(out, short)
    if "check" in stages:
        report["check"] = check(out, {k: report[k] for k in ("finetuned-full", "finetuned-lora") if k in report})


if __name__ == "__main__":
    sys.exit(main())
