"""The same Trainer run as ``python -m workbench.train``, without workbench around it.

Used by bench_train.py as the baseline: identical model, data, tokenisation and TrainingArguments,
but no supervisor, no run-directory callback, no registry. Run under torchrun:

    torchrun --standalone --nproc_per_node 2 bench/bare_train.py RUN_DIR OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import time

T_START = time.time()


def main(run_dir: str, out: str) -> None:
    from transformers import Trainer, TrainerCallback

    from workbench.data.tokenize import Collator, load_tokenizer
    from workbench.runs.rundir import RunDir
    from workbench.spec.models import resolve_model
    from workbench.train.arguments import training_arguments
    from workbench.train.model import load_model
    from workbench.train.run import load_split

    rd = RunDir(run_dir)
    spec = rd.spec()
    source = resolve_model(spec.model.id)
    tok = load_tokenizer(spec, source)
    model = load_model(spec, source)
    train = load_split(rd, "train", tok, spec)
    args = training_arguments(spec, rd, has_eval=False)
    args.report_to = []
    first: dict[str, float] = {}

    class FirstLog(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if state.is_world_process_zero and "loss" in (logs or {}) and not first:
                first["time"] = time.time()

    trainer = Trainer(model=model, args=args, train_dataset=train,
                      data_collator=Collator(tok.pad_token_id), callbacks=[FirstLog()])
    result = trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as fh:
            json.dump({"first_log_time": first.get("time"), "train_runtime": result.metrics[
                "train_runtime"], "tokens": trainer.state.num_input_tokens_seen}, fh)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
