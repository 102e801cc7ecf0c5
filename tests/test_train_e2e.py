"""End to end on a tiny target: self-distilled data, training under the DeepSpeed launcher on the CPU, resuming,
and the saved head loading into EaModel with no conversion: greedy output equals plain decoding, and the trained
head's acceptance is clearly above an untrained head's. Bad input ends with a clear message."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle.traineagle3 import gen_data

pytestmark = pytest.mark.e2e  # training under the DeepSpeed launcher

REPO = Path(__file__).resolve().parents[1]
TRAIN_DIR = REPO / "eagle" / "traineagle3"
PROMPTS = ["Tell me a story.", "What is 2+2?", "Explain rain.", "Write a haiku."]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(command: list[str], cwd: Path = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def make_predictable_target(directory: Path):
    """A tiny Llama whose attention output is zeroed: every position's logits depend on its own token only, so
    greedy decoding follows a fixed token map (which a head can learn quickly). Special and filler tokens never
    win the argmax (rows of the LM head zeroed), so decoded text tokenizes back to the same ids."""
    from tiny_models import make_tokenizer, target_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = target_config("llama", layers=6)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tokenizer = make_tokenizer(directory)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
        tokens = tokenizer.convert_ids_to_tokens(list(range(config.vocab_size)))
        for token_id, token in enumerate(tokens):
            if token_id != tokenizer.eos_token_id and (token.startswith("<") and len(token) > 1):
                model.lm_head.weight[token_id] = 0.0
    model.save_pretrained(directory)
    return model


def tokens_per_forward(base: Path, head: Path) -> float:
    from eagle.model.ea_model import EaModel

    model = EaModel.from_pretrained(use_eagle3=True, base_model_path=str(base), ea_model_path=str(head),
                                    total_token=8, depth=4, top_k=3)
    new_tokens, forwards = 0, 0
    for prompt in PROMPTS:
        ids = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  return_tensors="pt", return_dict=True)["input_ids"]
        output, new, idx = model.eagenerate(ids, max_new_tokens=32, log=True)
        assert torch.equal(output, model.naivegenerate(ids, max_new_tokens=32))
        new_tokens += new
        forwards += idx + 2  # idx = cycles - 1; plus the prefill
    return new_tokens / forwards


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_e2e")
    base = root / "base"
    make_predictable_target(base)
    data = root / "train.jsonl"
    assert gen_data.main(["--basepath", str(base), "--output", str(data), "--synthesize", "40", "--turns", "1",
                          "--max-new-tokens", "48", "--batch-size", "20", "--prompt-max-tokens", "16"]) == 0
    return root, base, data


def train_command(launcher: list[str], base: Path, data: Path, savedir: Path, epochs: int, extra=()):
    return [*launcher, "--basepath", str(base), "--trainpath", str(data), "--testpath", str(data),
            "--savedir", str(savedir), "--epochs", str(epochs), "--draft_vocab_size", "64", "--lr", "3e-3",
            "--warmup_steps", "2", "--grad_accum", "1", "--vocab_cache_dir", str(savedir.parent / "vocab_cache"),
            "--cache_target", *extra]


def test_train_under_the_deepspeed_launcher_then_resume_and_load_into_eamodel(workspace):
    root, base, data = workspace
    savedir = root / "out"
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(free_port()),
                "main.py", "--deepspeed_config", "ds_config.json"]
    result = run(train_command(launcher, base, data, savedir, epochs=5), cwd=TRAIN_DIR)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "test_acc" in result.stdout  # the per-position table

    head = savedir / "state_4"
    config = json.loads((head / "config.json").read_text())
    target = json.loads((base / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        assert config[key] == target[key]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 64
    from safetensors import safe_open

    with safe_open(str(head / "model.safetensors"), framework="pt") as reader:
        keys = set(reader.keys())
        assert reader.get_tensor("d2t").shape == (64,) and reader.get_tensor("t2d").dtype == torch.bool
        assert reader.get_tensor("fc.weight").dtype == torch.float16
    assert keys == {
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
        *(f"midlayer.{name}.weight" for name in (
            "hidden_norm", "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
    }

    # Resume (as a module this time): only the missing epoch is trained.
    resumed = run(train_command([sys.executable, "-m", "eagle.traineagle3.main"], base, data, savedir, epochs=6))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "continuing at epoch 5" in resumed.stderr
    assert (savedir / "state_5" / "model.safetensors").is_file()

    # The checkpoint exports to the same head the trainer saved at that epoch's end.
    from safetensors.torch import load_file as read_weights

    exported = run([sys.executable, "-m", "eagle.traineagle3.save_head", "--savedir", str(savedir), "--output",
                    str(root / "exported")])
    assert exported.returncode == 0, exported.stderr[-3000:]
    saved, again = read_weights(str(savedir / "state_5" / "model.safetensors")), read_weights(str(root / "exported" / "model.safetensors"))
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
    assert json.loads((root / "exported" / "config.json").read_text())["draft_vocab_size"] == 64

    # An untrained head with the same vocabulary map, saved the same way.
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig
    from eagle.traineagle3.save_head import save_head
    from safetensors.torch import load_file

    torch.manual_seed(0)
    untrained = Model(EConfig.from_pretrained(str(head)))
    vocab_map = load_file(str(head / "model.safetensors"))
    untrained.d2t.copy_(vocab_map["d2t"])
    untrained.t2d.copy_(vocab_map["t2d"])
    save_head(untrained, EConfig.from_pretrained(str(head)), str(root / "untrained"), torch.float16)

    trained_rate = tokens_per_forward(base, savedir / "state_5")
    untrained_rate = tokens_per_forward(base, root / "untrained")
    assert trained_rate >= untrained_rate + 1.0, (trained_rate, untrained_rate)


def test_bad_input_ends_with_a_clear_message(workspace, tmp_path):
    root, base, data = workspace
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    module = [sys.executable, "-m", "eagle.traineagle3.main"]
    result = run(train_command(module, base, empty, tmp_path / "out", epochs=1))
    assert result.returncode != 0
    assert "No usable training conversations" in result.stderr and "Traceback" not in result.stderr

    too_big = run(train_command(module, base, data, tmp_path / "out2", epochs=1) + ["--draft_vocab_size", "100000"])
    assert too_big.returncode != 0
    assert "larger than the target's vocabulary" in too_big.stderr and "Traceback" not in too_big.stderr


def test_time_budget_ends_the_run_early_with_the_learning_rate_at_zero(workspace, tmp_path):
    """``--time_budget``: a run planned for far longer than its budget stops after about that long, its last
    epoch cut short and saved, the learning rate decayed to zero at the end (not left at its peak)."""
    root, base, data = workspace
    savedir = tmp_path / "out"
    epochs, budget_min = 300, 0.1
    command = [sys.executable, "-m", "eagle.traineagle3.main", "--basepath", str(base), "--trainpath", str(data),
               "--savedir", str(savedir), "--epochs", str(epochs), "--draft_vocab_size", "64", "--lr", "3e-3",
               "--warmup_steps", "2", "--grad_accum", "1", "--vocab_cache_dir", str(tmp_path / "vocab"),
               "--time_budget", str(budget_min)]
    result = run(command, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "--time_budget 0.1 min" in result.stderr
    states = sorted(int(p.name.split("_")[1]) for p in savedir.glob("state_*"))
    assert states and states[-1] < epochs - 1  # ended early
    args = json.loads((savedir / f"state_{states[-1]}" / "training_args.json").read_text())
    per_epoch = int(re.search(r"conversations, (\d+) used", result.stderr).group(1))  # one per micro batch
    assert args["end_micro_batch"] < epochs * per_epoch
    assert states[-1] == (args["end_micro_batch"] - 1) // per_epoch  # the epoch the plan ended in was saved
    assert args["last_lr"] == 0.0


def test_time_budget_plan():
    from eagle.traineagle3.schedule import plan_time_budget

    assert plan_time_budget(60.0, 0.5, 100, 10_000) == 220  # 120 more micro batches fit
    assert plan_time_budget(60.0, 0.5, 100, 150) == 150  # never beyond the planned end
    assert plan_time_budget(-5.0, 0.5, 100, 10_000) == 100  # budget spent: stop where it is
