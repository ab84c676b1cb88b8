"""A stand-in for transformers' examples/pytorch/language-modeling/run_clm.py, for tests that
run a user's script unchanged (tests/test_hf_matrix.py). It goes the same way through the
library: ``HfArgumentParser`` over model, data and ``TrainingArguments`` dataclasses (command
line or one JSON file), a config from ``CONFIG_MAPPING`` with ``--config_overrides``, the
tokenizer by ``AutoTokenizer.from_pretrained``, ``AutoModelForCausalLM.from_config``, texts
tokenized and grouped in blocks of ``--block_size``, a ``Trainer`` with
``default_data_collator``, ``processing_class``, accuracy metrics on argmax logits, resuming
from ``--resume_from_checkpoint``, ``save_model``, ``save_metrics``, ``save_state`` and a final
``evaluate`` with the perplexity. DeepSpeed comes in only through ``--deepspeed ds.json``.

What differs: text files are read directly (the real script loads them with the ``datasets``
library, not installed here, and accepts hub datasets) and the accuracy is counted here (the
real one loads it with ``evaluate``); nothing is downloaded.

    python tests/run_clm.py --model_type llama --config_overrides hidden_size=32,... \
        --tokenizer_name DIR --train_file train.txt --validation_file valid.txt \
        --do_train --do_eval --output_dir out --deepspeed ds.json --use_cpu
"""
from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain

import torch
import transformers
from transformers import (CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser,
                          Trainer, TrainingArguments, default_data_collator, set_seed)

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_type: str = field(default="llama", metadata={"help": "model type trained from scratch"})
    config_overrides: str | None = field(default=None, metadata={
        "help": "config settings over the defaults, e.g. hidden_size=32,num_hidden_layers=2"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "tokenizer directory"})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "a text file"})
    validation_file: str | None = field(default=None, metadata={"help": "a text file"})
    block_size: int | None = field(default=None, metadata={"help": "tokens per training sample"})
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    set_seed(training_args.seed)

    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides:
        config.update_from_string(model_args.config_overrides)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    model = AutoModelForCausalLM.from_config(config)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))

    block_size = min(data_args.block_size or 1024, tokenizer.model_max_length)

    def blocks(path: str, limit: int | None) -> Blocks:
        with open(path, encoding="utf-8") as f:
            texts = [line for line in f.read().splitlines() if line.strip()]
        ids = list(chain(*tokenizer(texts)["input_ids"]))
        total = len(ids) // block_size * block_size
        if total == 0:
            raise ValueError(f"block_size of {block_size} is too big - use a value <= {len(ids)}")
        rows = [{"input_ids": ids[i:i + block_size], "labels": ids[i:i + block_size]}
                for i in range(0, total, block_size)]
        return Blocks(rows[:limit] if limit is not None else rows)

    train_dataset = eval_dataset = None
    if training_args.do_train:
        train_dataset = blocks(data_args.train_file, data_args.max_train_samples)
    if training_args.do_eval:
        eval_dataset = blocks(data_args.validation_file, data_args.max_eval_samples)

    def preprocess_logits_for_metrics(logits, labels):
        return (logits[0] if isinstance(logits, tuple) else logits).argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        labels, preds = labels[:, 1:].reshape(-1), preds[:, :-1].reshape(-1)
        return {"accuracy": float((preds == labels).mean())}

    trainer = Trainer(
        model=model, args=training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
        processing_class=tokenizer, data_collator=default_data_collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None)

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    trainer.create_model_card(tasks="text-generation")


if __name__ == "__main__":
    main()
