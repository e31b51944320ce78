"""A plain Hugging Face Trainer LoRA script with no workbench in it: the baseline of
bench_launch.py. It does the work a user's own script would (read the jsonl, tokenise, load the
model, wrap it in LoRA, train, save) with the knobs of the workbench run it is compared with
(batch 8 per rank, max_length 256, LoRA r 16 / alpha 32 on every linear layer, fp32 on CPU).

    torchrun --standalone --nproc_per_node 2 bench/plain_train.py MODEL_DIR DATA.jsonl STEPS OUT.json

Rank 0 writes the wall-clock time the first optimizer step was logged and the time it finished.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def main(model_dir: str, data: str, steps: int, out: str) -> None:
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    with open(data, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    texts = [f"{r['instruction']}\n{r.get('input', '')}\n{r['output']}{tok.eos_token}"
             for r in rows]
    train = datasets.Dataset.from_dict({"text": texts}).map(
        lambda b: tok(b["text"], truncation=True, max_length=256), batched=True,
        remove_columns=["text"])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    first: dict[str, float] = {}

    class FirstStep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if state.is_world_process_zero and "loss" in (logs or {}) and not first:
                first["time"] = time.time()

    cpu = not __import__("torch").cuda.is_available()
    # One plain process (no torchrun) has no process group: no DDP backend to name.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="plain-train-"), per_device_train_batch_size=8,
        max_steps=steps, learning_rate=3e-3, logging_steps=1, logging_first_step=True,
        save_strategy="no", report_to=[], use_cpu=cpu, ddp_backend="gloo" if cpu and distributed else None,
        disable_tqdm=True, ddp_find_unused_parameters=False)
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[FirstStep()],
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    trainer.train()
    trainer.save_model(os.path.join(args.output_dir, "adapter"))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as fh:
            json.dump({"first_step_time": first.get("time"), "done_time": time.time()}, fh)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
